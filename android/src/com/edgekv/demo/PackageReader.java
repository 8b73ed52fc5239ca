package com.edgekv.demo;

import java.io.EOFException;
import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.List;
import java.util.Set;

/**
 * Reads a package that `edgekv pack` wrote (its layout: edgekv/artifact/package.py, version 1,
 * little-endian) from a stream, once and in order, as the system file picker hands it over: the
 * header with its own SHA-256, then each part, hashed as it is copied. Every failure names the
 * part and says what to do.
 */
final class PackageReader {
    static final byte[] MAGIC = {'E', 'K', 'V', 'P', 'K', 'G', '\r', '\n'};
    static final int VERSION = 1;
    static final int EXTERNAL = 1;
    private static final int FIXED = 24, ENTRY = 56, MAX_PARTS = 4096, MAX_NAME = 255;
    private static final long MAX_HEADER = 1 << 20;

    static final class Part {
        final String name;
        final long offset, size;
        final String sha256;
        final boolean external;

        Part(String name, long offset, long size, String sha256, boolean external) {
            this.name = name;
            this.offset = offset;
            this.size = size;
            this.sha256 = sha256;
            this.external = external;
        }
    }

    private final InputStream in;
    private long position;
    private final byte[] buf = new byte[1 << 16];
    private long total, done;
    private List<Part> parts;

    PackageReader(InputStream in) {
        this.in = in;
    }

    List<Part> readHeader() throws IOException {
        byte[] fixed = readFully(FIXED, "the header");
        if (!Arrays.equals(Arrays.copyOf(fixed, 8), MAGIC)) {
            throw new IOException("This file is not an edgekv model package: make one with "
                    + "`edgekv pack ARTIFACT -o model.ekvpkg` on a computer (android/README.md)");
        }
        int version = u32(fixed, 8);
        int count = u32(fixed, 12);
        long headerSize = u64(fixed, 16);
        if (version != VERSION) {
            throw new IOException("This package is format " + version + "; this app reads format " + VERSION
                    + ": update the app, or pack with the matching edgekv");
        }
        if (count <= 0 || count > MAX_PARTS || headerSize < FIXED + 32 || headerSize > MAX_HEADER) {
            throw new IOException("The package's header is damaged: copy the file again");
        }
        byte[] rest = readFully((int) headerSize - FIXED, "the header");
        MessageDigest md = digest();
        md.update(fixed);
        md.update(rest, 0, rest.length - 32);
        if (!Arrays.equals(md.digest(), Arrays.copyOfRange(rest, rest.length - 32, rest.length))) {
            throw new IOException("The package's header does not match its SHA-256: the file is damaged; copy it again");
        }
        List<Part> out = new ArrayList<Part>();
        Set<String> names = new HashSet<String>();
        int pos = 0;
        long next = headerSize;
        for (int i = 0; i < count; i++) {
            if (pos + ENTRY > rest.length - 32) throw new IOException("The package's header is damaged: copy the file again");
            int flags = u32(rest, pos), nameLen = u32(rest, pos + 4);
            long offset = u64(rest, pos + 8), size = u64(rest, pos + 16);
            String sha = hex(Arrays.copyOfRange(rest, pos + 24, pos + 56));
            if (nameLen <= 0 || nameLen > MAX_NAME || pos + ENTRY + nameLen > rest.length - 32) {
                throw new IOException("The package's header is damaged: copy the file again");
            }
            String name = new String(rest, pos + ENTRY, nameLen, "UTF-8");
            pos += ENTRY + nameLen + pad8(ENTRY + nameLen);
            checkName(name);
            if (!names.add(name)) throw new IOException("The package names " + name + " twice: pack it again");
            boolean external = (flags & EXTERNAL) != 0;
            if (size < 0 || (!external && offset < next)) {
                throw new IOException("The package's part " + name + " is out of order: pack it again");
            }
            if (!external) {
                next = offset + size;
                total += size;
            }
            out.add(new Part(name, offset, size, sha, external));
        }
        parts = out;
        return out;
    }

    /** Copies the part's bytes (the stream must be at or before its offset) into `to`, checking its SHA-256. */
    void copyPart(Part p, File to, ModelStore.Progress progress, ModelStore.CancelFlag cancel) throws IOException {
        skipTo(p.offset, p.name);
        MessageDigest md = digest();
        OutputStream out = new FileOutputStream(to);
        try {
            long left = p.size;
            while (left > 0) {
                if (cancel != null && cancel.isCancelled()) throw new ModelStore.CancelledException();
                int n = in.read(buf, 0, (int) Math.min(buf.length, left));
                if (n < 0) {
                    throw new IOException("The package is truncated: part " + p.name + " ends after " + (p.size - left)
                            + " of " + p.size + " bytes; copy the whole file again");
                }
                md.update(buf, 0, n);
                out.write(buf, 0, n);
                left -= n;
                position += n;
                done += n;
                if (progress != null) progress.onProgress(p.name, done, total);
            }
        } finally {
            out.close();
        }
        if (!hex(md.digest()).equals(p.sha256)) {
            throw new IOException("The package's part " + p.name + " does not match its SHA-256: the file is damaged; "
                    + "copy it again (or pack the artifact again)");
        }
    }

    /** Nothing may follow the last part (a longer file is not the package that was written). */
    void expectEnd() throws IOException {
        if (in.read() >= 0) throw new IOException("The package has bytes after its last part: it is not the file edgekv pack wrote");
    }

    private void skipTo(long offset, String part) throws IOException {
        while (position < offset) {
            int n = in.read(buf, 0, (int) Math.min(buf.length, offset - position));
            if (n < 0) throw new IOException("The package is truncated before part " + part + ": copy the whole file again");
            position += n;
        }
    }

    private byte[] readFully(int n, String what) throws IOException {
        byte[] b = new byte[n];
        for (int got = 0; got < n;) {
            int r = in.read(b, got, n - got);
            if (r < 0) {
                if (position + got == 0) throw new EOFException("The file is empty: copy the package again");
                throw new IOException("The package is truncated in " + what + ": copy the whole file again");
            }
            got += r;
        }
        position += n;
        return b;
    }

    static void checkName(String name) throws IOException {
        boolean bad = name.startsWith("/") || name.contains("\\") || name.indexOf('\0') >= 0;
        for (String c : name.split("/", -1)) bad |= c.isEmpty() || c.equals(".") || c.equals("..");
        if (bad) throw new IOException("The package names a part " + name + ", which is not a plain relative path: refused");
    }

    private static int pad8(int n) {
        return (8 - n % 8) % 8;
    }

    private static int u32(byte[] b, int at) {
        return (b[at] & 0xff) | (b[at + 1] & 0xff) << 8 | (b[at + 2] & 0xff) << 16 | (b[at + 3] & 0xff) << 24;
    }

    private static long u64(byte[] b, int at) {
        return (u32(b, at) & 0xffffffffL) | ((long) u32(b, at + 4)) << 32;
    }

    static MessageDigest digest() {
        try {
            return MessageDigest.getInstance("SHA-256");
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    static byte[] sha256(File f) throws IOException {
        MessageDigest md = digest();
        InputStream s = new FileInputStream(f);
        try {
            byte[] b = new byte[1 << 16];
            for (int n; (n = s.read(b)) > 0;) md.update(b, 0, n);
        } finally {
            s.close();
        }
        return md.digest();
    }

    static String hex(byte[] b) {
        StringBuilder s = new StringBuilder(b.length * 2);
        for (byte x : b) s.append(Character.forDigit((x >> 4) & 15, 16)).append(Character.forDigit(x & 15, 16));
        return s.toString();
    }
}
