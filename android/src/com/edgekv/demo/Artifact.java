package com.edgekv.demo;

import static com.edgekv.demo.ManifestKeys.*;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.util.Locale;

/**
 * What an artifact directory says about itself before the runtime opens it (manifest.json):
 * what it was compiled with, and its static memory plan, which the app holds against the memory
 * the phone has free before loading anything.
 */
public final class Artifact {
    public final File dir;
    public String modelId = "?", policy = "?", dtype = "?", targetProfile = "?", targetKind = "?";
    public String libraryName = "?", toolchainStatus = "";
    public long budget, block, weightsBytes, cacheBytes, activationBytes, planBytes;

    private Artifact(File dir) {
        this.dir = dir;
    }

    /**
     * Reads dir/manifest.json (its keys: ManifestKeys, generated from edgekv/artifact/manifest.py); IOException with
     * what is wrong (missing, unreadable, not an artifact).
     */
    public static Artifact read(File dir) throws IOException {
        File f = new File(dir, FILE_NAME);
        if (!f.isFile()) {
            throw new IOException(dir + " holds no " + FILE_NAME + ": push the whole artifact directory "
                    + "that `edgekv compile` wrote (see android/README.md)");
        }
        Object m;
        try {
            m = Json.parse(readUtf8(f, 4 << 20));
        } catch (IllegalArgumentException e) {
            throw new IOException(f + ": " + e.getMessage());
        }
        if (!ARTIFACT_FORMAT.equals(Json.str(m, FORMAT))) {
            throw new IOException(f + " is not an edgekv artifact manifest");
        }
        Artifact a = new Artifact(dir);
        a.modelId = or(Json.str(m, MODEL, Model.ID), "?");
        a.policy = or(Json.str(m, POLICY, Policy.NAME), "?");
        a.dtype = or(Json.str(m, DTYPE), "?");
        a.targetProfile = or(Json.str(m, TARGET, Target.PROFILE), "?");
        a.targetKind = or(Json.str(m, TARGET, Target.TVM, TvmTarget.KIND), "?");
        a.libraryName = or(Json.str(m, FILES, Files.LIBRARY, FileEntry.NAME), "?");
        a.toolchainStatus = or(Json.str(m, DEVICE, Device.TOOLCHAIN, Toolchain.STATUS), "");
        a.budget = Json.num(m, 0, BUDGET);
        a.block = Json.num(m, 0, BLOCK);
        a.weightsBytes = Json.num(m, 0, MEMORY_PLAN, MemoryPlan.WEIGHTS_BYTES);
        a.cacheBytes = Json.num(m, 0, MEMORY_PLAN, MemoryPlan.CACHE_BYTES);
        a.activationBytes = Json.num(m, 0, MEMORY_PLAN, MemoryPlan.ACTIVATION_BYTES);
        a.planBytes = Json.num(m, 0, MEMORY_PLAN, MemoryPlan.TOTAL_BYTES);
        if (Json.at(m, FILES, Files.PROGRAM) == null) {
            throw new IOException(dir.getName() + " has no program.ekv: it was compiled for a runtime other than the "
                    + "native one (--target " + a.targetProfile + "); compile with --target android-cpu or opencl");
        }
        if (ToolchainStatus.NEEDS_TOOLCHAIN.equals(a.toolchainStatus) || a.libraryName.endsWith(".tar")) {
            throw new IOException(dir.getName() + " is not linked yet (model.tar, no model.so): run `android/finish.sh "
                    + dir.getName() + "` (or `python -m edgekv.compiler.backend.finish`) on the computer, then push it again");
        }
        return a;
    }

    public boolean opencl() {
        return "opencl".equals(targetKind);
    }

    /**
     * Bytes this artifact needs in the phone's RAM: the plan (weights + KV cache + activations);
     * an OpenCL artifact also holds a copy of the weights in GPU buffers, which on a phone are
     * the same RAM, while the mapped weights file stays.
     */
    public long memoryNeeded() {
        return planBytes + (opencl() ? weightsBytes : 0);
    }

    /**
     * Null when the plan fits in what the phone has free (ActivityManager.MemoryInfo: availMem
     * less the threshold at which the system starts killing processes), else the refusal with
     * the numbers.
     */
    public String memoryRefusal(long availMem, long threshold) {
        long usable = availMem - threshold;
        if (planBytes <= 0) return null; /* an old manifest without a plan: the runtime still checks its own */
        if (memoryNeeded() <= usable) return null;
        return String.format(Locale.US,
                "Not loading %s: its memory plan needs %s (weights %s + KV cache %s + activations %s%s), and this phone "
                + "has %s free (available %s minus the low-memory threshold %s). Close other apps, or compile with a "
                + "smaller --budget or --block.",
                dir.getName(), mib(memoryNeeded()), mib(weightsBytes), mib(cacheBytes), mib(activationBytes),
                opencl() ? " + the weights' copy on the GPU " + mib(weightsBytes) : "", mib(Math.max(0, usable)),
                mib(availMem), mib(threshold));
    }

    /** "smollm2-135m · keydiff · N=512 · B=128 · float32 · android-cpu" */
    public String describe() {
        return modelId + " · " + policy + " · N=" + budget + " · B=" + block + " · " + dtype + " · " + targetProfile;
    }

    public static String mib(long bytes) {
        return String.format(Locale.US, "%.1f MiB", bytes / 1048576.0);
    }

    static String or(String s, String otherwise) {
        return s != null ? s : otherwise;
    }

    static String readUtf8(File f, int max) throws IOException {
        InputStream in = new FileInputStream(f);
        try {
            return readUtf8(in, max);
        } finally {
            in.close();
        }
    }

    static String readUtf8(InputStream in, int max) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        byte[] buf = new byte[65536];
        for (int n; (n = in.read(buf)) > 0;) {
            out.write(buf, 0, n);
            if (out.size() > max) throw new IOException("larger than " + mib(max));
        }
        return new String(out.toByteArray(), "UTF-8");
    }
}
