package com.edgekv.demo;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.Charset;
import java.nio.charset.CodingErrorAction;
import java.util.Locale;

/**
 * The document lives in one file in the app's private storage (files/document.txt), not in an
 * EditText: an 8 MiB text in a view is slow on the UI thread and lost when the Activity is
 * recreated. The screen shows a preview (the first lines and the size); the worker reads the whole
 * file when a question is asked. A new document is written beside it and renamed, so a reader never
 * sees half of one; it must be UTF-8 and at most MAX_BYTES. All methods do I/O: call them off the
 * UI thread. Pure Java (tests/test_android_ui.py runs it on a desktop JVM).
 */
public final class DocumentStore {
    public static final int MAX_BYTES = 8 << 20;

    private final File file;

    public DocumentStore(File dir) {
        file = new File(dir, "document.txt");
    }

    public File file() {
        return file;
    }

    public boolean isEmpty() {
        return !file.isFile() || file.length() == 0;
    }

    /** Replaces the document with `in`'s bytes (refused, the old one kept, when too large or not UTF-8). */
    public void replace(InputStream in) throws IOException {
        File dir = file.getParentFile();
        if (dir != null && !dir.isDirectory() && !dir.mkdirs()) throw new IOException("cannot create " + dir);
        File part = new File(file.getPath() + ".part");
        try {
            OutputStream out = new FileOutputStream(part);
            try {
                byte[] buf = new byte[1 << 16];
                long total = 0;
                for (int n; (n = in.read(buf)) > 0;) {
                    total += n;
                    if (total > MAX_BYTES) {
                        throw new IOException("the document is larger than " + Artifact.mib(MAX_BYTES)
                                + ": open a shorter text file");
                    }
                    out.write(buf, 0, n);
                }
            } finally {
                out.close();
            }
            checkUtf8(part);
            if (!part.renameTo(file)) throw new IOException("cannot write " + file);
        } finally {
            if (part.exists()) part.delete(); /* a refused or failed copy leaves nothing behind */
        }
    }

    public void replace(String text) throws IOException {
        replace(new java.io.ByteArrayInputStream(text.getBytes("UTF-8")));
    }

    public void clear() {
        file.delete();
    }

    /** The whole document ("" when there is none). */
    public String read() throws IOException {
        return file.isFile() ? Artifact.readUtf8(file, MAX_BYTES) : "";
    }

    /**
     * What the screen shows: the size, then the first `lines` lines (at most `chars` characters);
     * "" when there is no document.
     */
    public String preview(int lines, int chars) throws IOException {
        if (!file.isFile()) return "";
        long size = file.length();
        ByteArrayOutputStream head = new ByteArrayOutputStream();
        InputStream in = new FileInputStream(file);
        try {
            byte[] buf = new byte[Math.min(1 << 16, chars * 4 + 4)];
            for (int n; head.size() < chars * 4 && (n = in.read(buf)) > 0;) head.write(buf, 0, n);
        } finally {
            in.close();
        }
        String text = new String(head.toByteArray(), "UTF-8"); /* a character cut at the end becomes U+FFFD */
        StringBuilder b = new StringBuilder();
        int shown = 0, at = 0;
        while (shown < lines && at < text.length() && b.length() < chars) {
            int nl = text.indexOf('\n', at);
            String line = nl < 0 ? text.substring(at) : text.substring(at, nl);
            b.append(line.length() > chars - b.length() ? line.substring(0, chars - b.length()) + "…" : line).append('\n');
            shown++;
            at = nl < 0 ? text.length() : nl + 1;
        }
        boolean more = at < text.length() || head.size() < size;
        String shownSize = size >= 1 << 20 ? Artifact.mib(size)
                : size >= 1024 ? String.format(Locale.US, "%.1f KiB", size / 1024.0) : size + " B";
        return String.format(Locale.US, "%s (%d bytes)%s%n%s", shownSize, size,
                more ? ", first lines:" : ":", b.toString() + (more ? "…" : ""));
    }

    private static void checkUtf8(File f) throws IOException {
        InputStream in = new FileInputStream(f);
        try {
            ByteArrayOutputStream all = new ByteArrayOutputStream((int) Math.min(f.length(), MAX_BYTES));
            byte[] buf = new byte[1 << 16];
            for (int n; (n = in.read(buf)) > 0;) all.write(buf, 0, n);
            Charset.forName("UTF-8").newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(all.toByteArray()));
        } catch (CharacterCodingException e) {
            throw new IOException("the document is not UTF-8 text: open a plain-text (.txt) file");
        } finally {
            in.close();
        }
    }
}
