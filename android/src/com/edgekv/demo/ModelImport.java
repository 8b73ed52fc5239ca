package com.edgekv.demo;

import android.content.Context;
import android.content.Intent;
import android.net.Uri;

import java.io.BufferedInputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;

/**
 * The app's side of ModelStore: where models are kept (app-private, not backed up: a model is
 * hundreds of MB that the user can import again), the model library the APK carries, and the
 * system file picker's document as the stream to import. Call {@link #importFrom} off the UI
 * thread; the picker's intent is ACTION_OPEN_DOCUMENT with CATEGORY_OPENABLE and type star/star
 * (a .ekvpkg has no registered MIME type).
 */
public final class ModelImport {
    /** The model library android/build.sh --model-lib puts in the APK (lib/arm64-v8a/). */
    public static final String BUNDLED_LIBRARY = "libedgekv_model.so";

    private ModelImport() {
    }

    /** The system file picker for a package: startActivityForResult(pickIntent(), ...), then importFrom(its getData()). */
    public static Intent pickIntent() {
        Intent pick = new Intent(Intent.ACTION_OPEN_DOCUMENT);
        pick.addCategory(Intent.CATEGORY_OPENABLE);
        pick.setType("*/*"); /* .ekvpkg has no MIME type of its own; the importer checks the magic */
        return pick;
    }

    /** The app's model store: getNoBackupFilesDir()/models, with the APK's model library if it carries one. */
    public static ModelStore store(Context context) throws IOException {
        String libDir = context.getApplicationInfo().nativeLibraryDir;
        File bundled = libDir != null ? new File(libDir, BUNDLED_LIBRARY) : null;
        return new ModelStore(new File(context.getNoBackupFilesDir(), "models"), bundled, null);
    }

    /** Imports the package the picker returned (its content:// Uri); returns the new model's name. */
    public static String importFrom(Context context, ModelStore store, Uri uri, ModelStore.Progress progress,
                                    ModelStore.CancelFlag cancel) throws IOException {
        InputStream in = context.getContentResolver().openInputStream(uri);
        if (in == null) throw new IOException("the file picker's document cannot be opened: " + uri);
        try {
            return store.importFrom(new BufferedInputStream(in, 1 << 16), progress, cancel);
        } finally {
            in.close();
        }
    }
}
