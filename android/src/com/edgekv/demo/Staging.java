package com.edgekv.demo;

import android.system.ErrnoException;
import android.system.Os;

import java.io.File;
import java.io.IOException;

/**
 * Makes a pushed artifact loadable. `adb push` can write the app's external files directory
 * (/sdcard/Android/data/PACKAGE/files), but the runtime cannot dlopen() model.so from there: app
 * processes may load native code only from paths their linker namespace permits (the APK's library
 * directory and /data), and external storage is mounted noexec. So the artifact is "staged" in the
 * app's internal storage: model.so (and the OpenCL kernel source in device/, beside which the
 * runtime caches the compiled kernels) are copied, read-only; every other file — the weights
 * above all — is a symbolic link to the pushed file, which the runtime maps read-only, so nothing
 * large is copied. A copy is refreshed when the pushed file's size or time changes (and the runtime
 * checks the library's CRC-32 against the program at load anyway).
 */
final class Staging {
    private Staging() {
    }

    static File stage(File source, File stagingRoot) throws IOException {
        File target = new File(stagingRoot, source.getName());
        mirror(source, target, false);
        return target;
    }

    private static void mirror(File from, File to, boolean copyAll) throws IOException {
        if (!to.isDirectory() && !to.mkdirs()) throw new IOException("cannot create " + to);
        File[] entries = from.listFiles();
        if (entries == null) throw new IOException("cannot list " + from);
        for (File f : entries) {
            File t = new File(to, f.getName());
            if (f.isDirectory()) {
                mirror(f, t, copyAll || f.getName().equals("device"));
            } else if (copyAll || f.getName().endsWith(".so")) {
                copyIfChanged(f, t);
            } else {
                link(f, t);
            }
        }
    }

    private static void link(File from, File to) throws IOException {
        if (to.getCanonicalPath().equals(from.getCanonicalPath())) return; /* already the link */
        to.delete(); /* a copy, or a link to another place (or to nothing): replaced */
        try {
            Os.symlink(from.getAbsolutePath(), to.getPath());
        } catch (ErrnoException e) {
            copyIfChanged(from, to); /* no symlinks here: copy */
        }
    }

    private static void copyIfChanged(File from, File to) throws IOException {
        if (to.isFile() && to.length() == from.length() && to.lastModified() == from.lastModified()) return;
        File part = new File(to.getPath() + ".part");
        ModelStore.copyFile(from, part);
        if (to.exists() && !to.delete()) throw new IOException("cannot replace " + to);
        if (!part.renameTo(to)) throw new IOException("cannot write " + to);
        to.setLastModified(from.lastModified());
        to.setWritable(false, false); /* code loaded at run time must not be writable */
    }
}
