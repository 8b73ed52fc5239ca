package com.edgekv.demo;

import android.content.Context;

import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * THE ONE PLACE WHERE THE MODEL STORE PLUGS IN. The screens (MainActivity's "Models" section,
 * BenchActivity) and scripted runs only call list() and loadable(): which models there are, and a
 * directory the runtime can open for one of them.
 *
 * Today a model is an artifact directory pushed with adb to files/artifacts/NAME (external
 * storage), staged into internal storage on Open (Staging: model.so copied, the rest linked).
 * The model store of issue 33 (ModelStore: packages imported through the file picker into
 * app-private storage and verified against their checksum; list(), open(name), delete(name),
 * importFrom(...)) replaces the two bodies below: list() -> store.list(), loadable(name) ->
 * store.open(name); its Import and Delete buttons go in MainActivity's Models row
 * (MainActivity.buildModelsSection).
 */
final class Models {
    private Models() {
    }

    /** Where adb pushes artifacts: files/artifacts under the app's external files directory. */
    static File pushedRoot(Context c) {
        File ext = c.getExternalFilesDir(null);
        return new File(ext != null ? ext : c.getNoBackupFilesDir(), "artifacts");
    }

    /** The models there are, by name (sorted). */
    static List<String> list(Context c) {
        File root = pushedRoot(c);
        if (!root.isDirectory()) root.mkdirs();
        File[] dirs = root.listFiles();
        List<String> names = new ArrayList<String>();
        if (dirs != null) {
            for (File d : dirs) if (d.isDirectory()) names.add(d.getName());
        }
        Collections.sort(names);
        return names;
    }

    /** The model's manifest directory (for the memory check before loading). */
    static File source(Context c, String name) {
        if (name.equals(".") || name.equals("..") || name.indexOf('/') >= 0 || name.indexOf('\0') >= 0) {
            throw new IllegalArgumentException("\"" + name + "\" is not a model's name");
        }
        return new File(pushedRoot(c), name);
    }

    /** A directory the runtime may open (code in internal storage only). Worker thread. */
    static File loadable(Context c, String name) throws IOException {
        return Staging.stage(source(c, name), new File(c.getNoBackupFilesDir(), "staged"));
    }

    /** What the screen says when there is no model yet. */
    static String whereFrom(Context c) {
        return "Models are artifact directories pushed with adb to " + pushedRoot(c) + "/NAME (android/README.md).";
    }
}
