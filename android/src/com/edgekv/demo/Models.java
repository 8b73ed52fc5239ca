package com.edgekv.demo;

import android.content.Context;

import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * The one place where the model store plugs in. The screens (MainActivity's "Models" section,
 * BenchActivity) and scripted runs call list(), source() and loadable().
 *
 * Models are imported packages (`edgekv pack`, through the file picker: ModelStore, in
 * app-private storage, every part verified; open() checks the model library again), and, for
 * adb users and device tests, artifact directories pushed to files/artifacts/NAME on external
 * storage, staged into internal storage on Open (Staging: model.so copied, the rest linked). An
 * imported model wins over a pushed one of the same name.
 */
final class Models {
    private Models() {
    }

    /** The imported models (ModelImport.store: no_backup/models, the APK's model library). */
    static ModelStore store(Context c) throws IOException {
        return ModelImport.store(c.getApplicationContext());
    }

    /** Where adb pushes artifacts: files/artifacts under the app's external files directory. */
    static File pushedRoot(Context c) {
        File ext = c.getExternalFilesDir(null);
        return new File(ext != null ? ext : c.getNoBackupFilesDir(), "artifacts");
    }

    private static List<String> imported(Context c) {
        try {
            return store(c).list();
        } catch (IOException e) {
            return new ArrayList<String>();
        }
    }

    /** The models there are, by name (sorted): imported, then pushed ones of other names. */
    static List<String> list(Context c) {
        List<String> names = new ArrayList<String>(imported(c));
        File root = pushedRoot(c);
        if (!root.isDirectory()) root.mkdirs();
        File[] dirs = root.listFiles();
        if (dirs != null) {
            for (File d : dirs) if (d.isDirectory() && !names.contains(d.getName())) names.add(d.getName());
        }
        Collections.sort(names);
        return names;
    }

    private static String checked(String name) {
        if (name.equals(".") || name.equals("..") || name.indexOf('/') >= 0 || name.indexOf('\0') >= 0) {
            throw new IllegalArgumentException("\"" + name + "\" is not a model's name");
        }
        return name;
    }

    /** The model's manifest directory (for the memory check before loading). */
    static File source(Context c, String name) throws IOException {
        if (imported(c).contains(checked(name))) return new File(store(c).root(), name);
        return new File(pushedRoot(c), name);
    }

    /** A directory the runtime may open (code in internal storage only, verified). Worker thread. */
    static File loadable(Context c, String name) throws IOException {
        if (imported(c).contains(checked(name))) return store(c).open(name);
        return Staging.stage(source(c, name), new File(c.getNoBackupFilesDir(), "staged"));
    }

    /** Deletes an imported model (a pushed one is deleted with adb). */
    static void delete(Context c, String name) throws IOException {
        if (!imported(c).contains(checked(name))) {
            throw new IOException(name + " was pushed with adb, not imported: delete it with adb shell rm -r");
        }
        store(c).delete(name);
    }

    /** What the screen says when there is no model yet. */
    static String whereFrom(Context c) {
        return "Import a package made with `edgekv pack` (Import model…), or push an artifact directory with adb to "
                + pushedRoot(c) + "/NAME (android/README.md).";
    }
}
