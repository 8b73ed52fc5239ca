package com.edgekv.demo;

import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Locale;

/**
 * The models the app holds, in app-private storage (ROOT/NAME/, one directory each): imported
 * from a package that `edgekv pack` wrote (PackageReader), listed, chosen and deleted here.
 *
 * An import streams the package (from the system file picker's ContentResolver stream, or any
 * InputStream) into ROOT/.import-N/, checks the free space first, every part against its SHA-256
 * as it is copied, and the model library against the one the app carries when the package leaves
 * it out; only a complete, verified model is renamed into place. A failure or a cancel deletes the
 * partial copy, and partial copies left by a killed process are deleted when the store opens.
 * {@link #open} checks the model library again before the runtime loads it: whatever code is
 * loaded is the bytes the package vouched for, in storage no other app can write.
 *
 * Pure Java (no android.*): the Activity passes its storage, the bundled library's path and the
 * picker's stream; android/test/ImportCheck.java runs the same code on a desktop JVM.
 */
public final class ModelStore {
    /** Import progress: bytes copied of the package's total (called on the importing thread). */
    public interface Progress {
        void onProgress(String part, long done, long total);
    }

    /** Free bytes where the models are kept (File.getUsableSpace; tests pass their own). */
    public interface FreeSpace {
        long usable(File dir);
    }

    /** Set from any thread to stop an import at its next chunk. */
    public static final class CancelFlag {
        private volatile boolean cancelled;

        public void cancel() {
            cancelled = true;
        }

        public boolean isCancelled() {
            return cancelled;
        }
    }

    /** An import stopped by its CancelFlag (nothing is left behind). */
    public static final class CancelledException extends IOException {
        private static final long serialVersionUID = 1L;

        public CancelledException() {
            super("import cancelled: nothing was kept");
        }
    }

    static final String RECORD = "package.sha256";   /* NAME/package.sha256: "sha256  part" per line */
    static final String LIBRARY = "model.so";
    private static final String PARTIAL = ".import-";
    /** Room kept free beyond the model itself (the OS, the document cache). */
    static final long SPARE_BYTES = 64L << 20;

    private final File root;
    private final File bundledLibrary;
    private final FreeSpace space;

    /**
     * root: the models' directory (app-private: Context.getNoBackupFilesDir()/models);
     * bundledLibrary: the model library the APK carries (nativeLibraryDir/libedgekv_model.so), or
     * null; space: null for File.getUsableSpace.
     */
    public ModelStore(File root, File bundledLibrary, FreeSpace space) throws IOException {
        this.root = root;
        this.bundledLibrary = bundledLibrary != null && bundledLibrary.isFile() ? bundledLibrary : null;
        this.space = space != null ? space : new FreeSpace() {
            @Override
            public long usable(File dir) {
                return dir.getUsableSpace();
            }
        };
        if (!root.isDirectory() && !root.mkdirs()) throw new IOException("cannot create " + root);
        File[] stale = root.listFiles();
        if (stale != null) {
            for (File f : stale) if (f.getName().startsWith(PARTIAL)) deleteTree(f); /* a killed import */
        }
    }

    public File root() {
        return root;
    }

    /** The models, by name (each a directory with a manifest the app can read). */
    public List<String> list() {
        List<String> names = new ArrayList<String>();
        File[] dirs = root.listFiles();
        if (dirs != null) {
            for (File d : dirs) {
                if (d.isDirectory() && !d.getName().startsWith(".") && new File(d, RECORD).isFile()) names.add(d.getName());
            }
        }
        Collections.sort(names);
        return names;
    }

    /** What the model NAME was compiled with (manifest.json). */
    public Artifact describe(String name) throws IOException {
        return Artifact.read(dir(name));
    }

    /** Bytes the model NAME takes in the app's storage. */
    public long bytes(String name) throws IOException {
        return treeBytes(dir(name));
    }

    public void delete(String name) throws IOException {
        File d = dir(name);
        if (!d.isDirectory()) throw new IOException("no model named " + name);
        deleteTree(d);
        if (d.exists()) throw new IOException("could not delete all of " + d);
    }

    /**
     * The directory to open NAME from (Engine.open), after checking its model library against the
     * package's SHA-256 once more (the library is code the runtime loads).
     */
    public File open(String name) throws IOException {
        File d = dir(name);
        if (!new File(d, RECORD).isFile()) throw new IOException("no model named " + name + ": import it first");
        String want = null;
        for (String line : Artifact.readUtf8(new File(d, RECORD), 1 << 20).split("\n")) {
            if (line.endsWith("  " + LIBRARY)) want = line.substring(0, 64);
        }
        File lib = new File(d, LIBRARY);
        if (want == null || !lib.isFile()) throw new IOException(name + " has no model library: import it again");
        String got = PackageReader.hex(PackageReader.sha256(lib));
        if (!got.equals(want)) {
            throw new IOException(name + "'s model library no longer matches the package's SHA-256: delete the model "
                    + "and import it again");
        }
        return d;
    }

    /**
     * Imports the package read from `in` (streamed once, in order): verifies it and adds it as a
     * new model, named after what it holds (model, policy, N, B, target), which is returned.
     * IOException naming the part for a damaged or truncated package, not enough space, another
     * model library; CancelledException when `cancel` is set. Nothing is kept on any failure.
     */
    public String importFrom(InputStream in, Progress progress, CancelFlag cancel) throws IOException {
        File tmp = null;
        for (int i = 0; tmp == null || tmp.exists(); i++) tmp = new File(root, PARTIAL + i);
        boolean ok = false;
        try {
            if (!tmp.mkdirs()) throw new IOException("cannot create " + tmp);
            PackageReader reader = new PackageReader(in);
            List<PackageReader.Part> parts = reader.readHeader();
            long needed = 0;
            for (PackageReader.Part p : parts) needed += p.external ? (bundledLibrary != null ? bundledLibrary.length() : 0) : p.size;
            long free = space.usable(root);
            if (needed + SPARE_BYTES > free) {
                throw new IOException(String.format(Locale.US, "Not enough space to import this model: it needs %s "
                        + "(and %s kept free), the app's storage has %s free. Delete a model or free space, then "
                        + "import again.", Artifact.mib(needed), Artifact.mib(SPARE_BYTES), Artifact.mib(free)));
            }
            StringBuilder record = new StringBuilder();
            for (PackageReader.Part p : parts) {
                if (p.external) {
                    copyBundledLibrary(p, new File(tmp, p.name));
                } else {
                    File target = new File(tmp, p.name);
                    File parent = target.getParentFile();
                    if (!parent.isDirectory() && !parent.mkdirs()) throw new IOException("cannot create " + parent);
                    reader.copyPart(p, target, progress, cancel);
                }
                record.append(p.sha256).append("  ").append(p.name).append('\n');
            }
            reader.expectEnd();
            File lib = new File(tmp, LIBRARY);
            if (!lib.isFile()) throw new IOException("the package holds no " + LIBRARY + ": pack a linked artifact");
            lib.setWritable(false, false); /* code loaded at run time must not be writable */
            Artifact a = Artifact.read(tmp); /* an artifact the app can open, or why not */
            write(new File(tmp, RECORD), record.toString());
            String name = freeName(a);
            if (!tmp.renameTo(new File(root, name))) throw new IOException("cannot move the model into " + root);
            ok = true;
            return name;
        } finally {
            if (!ok && tmp != null) deleteTree(tmp);
        }
    }

    private void copyBundledLibrary(PackageReader.Part p, File target) throws IOException {
        if (!LIBRARY.equals(p.name)) throw new IOException("the package leaves out " + p.name + ", which the app cannot supply");
        if (bundledLibrary == null) {
            throw new IOException("This package leaves the model library out (edgekv pack --bundled-library), and this "
                    + "app carries none: pack the artifact without --bundled-library, or build the app with "
                    + "android/build.sh --model-lib ARTIFACT/model.so");
        }
        if (!PackageReader.hex(PackageReader.sha256(bundledLibrary)).equals(p.sha256)) {
            throw new IOException("This package was made for another model library than the one this app carries "
                    + "(the SHA-256 of model.so differs): pack it from the artifact whose model.so the app was built "
                    + "with, or pack it without --bundled-library");
        }
        copyFile(bundledLibrary, target);
        if (!PackageReader.hex(PackageReader.sha256(target)).equals(p.sha256)) throw new IOException("copying " + p.name + " failed");
    }

    private String freeName(Artifact a) {
        String base = (a.modelId + "-" + a.policy + "-N" + a.budget + "-B" + a.block + "-" + a.targetProfile)
                .replaceAll("[^A-Za-z0-9._+-]", "_");
        if (base.startsWith(".")) base = "_" + base.substring(1);
        String name = base;
        for (int i = 2; new File(root, name).exists(); i++) name = base + "-" + i;
        return name;
    }

    /** ROOT/NAME for a plain name (no path separators, not "." or ".."). */
    File dir(String name) throws IOException {
        if (name == null || name.isEmpty() || name.contains("/") || name.contains("\\") || name.startsWith(".")) {
            throw new IOException("not a model name: " + name);
        }
        return new File(root, name);
    }

    static void deleteTree(File f) {
        File[] kids = f.isDirectory() && !isLink(f) ? f.listFiles() : null;
        if (kids != null) for (File k : kids) deleteTree(k);
        f.delete();
    }

    /** A symbolic link is removed, never followed (its target may lie outside the store). */
    private static boolean isLink(File f) {
        try {
            File parent = f.getAbsoluteFile().getParentFile();
            if (parent == null) return false;
            File here = new File(parent.getCanonicalFile(), f.getName());
            return !here.getCanonicalFile().equals(here.getAbsoluteFile());
        } catch (IOException e) {
            return true;
        }
    }

    private static long treeBytes(File f) {
        if (!f.isDirectory()) return f.length();
        long n = 0;
        File[] kids = f.listFiles();
        if (kids != null) for (File k : kids) n += treeBytes(k);
        return n;
    }

    static void copyFile(File from, File to) throws IOException {
        InputStream in = new FileInputStream(from);
        try {
            OutputStream out = new FileOutputStream(to);
            try {
                byte[] buf = new byte[1 << 16];
                for (int n; (n = in.read(buf)) > 0;) out.write(buf, 0, n);
            } finally {
                out.close();
            }
        } finally {
            in.close();
        }
    }

    private static void write(File f, String text) throws IOException {
        OutputStream out = new FileOutputStream(f);
        try {
            out.write(text.getBytes("UTF-8"));
        } finally {
            out.close();
        }
    }
}
