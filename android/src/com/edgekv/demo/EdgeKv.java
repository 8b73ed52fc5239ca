package com.edgekv.demo;

/**
 * The native runtime, one static method per call of {@code edgekv.h} (android/jni/edgekv_jni.c).
 * Handles are the runtime's pointers; a failing call throws {@link EdgeKvException} with the
 * runtime's message. Pure Java (no android.*): the same class runs on a desktop JVM in the tests.
 */
public final class EdgeKv {
    /** ekv_text_part: how a text is encoded (document and question parts share the chat template). */
    public static final int PART_WHOLE = 0;
    public static final int PART_DOCUMENT = 1;
    public static final int PART_QUESTION = 2;

    /** After each prefill block: tokens done so far and in all; return true to cancel. */
    public interface Progress {
        boolean onBlock(long done, long total);
    }

    /** Each generated token and its text (whole UTF-8 characters; "" for special tokens); return true to stop. */
    public interface Tokens {
        boolean onToken(int id, String text);
    }

    private EdgeKv() {
    }

    /** Loads libedgekv_runtime.so, then the bridge (which needs it). */
    public static void loadLibraries() {
        System.loadLibrary("edgekv_runtime");
        System.loadLibrary("edgekv_jni");
    }

    /** "cpu" or "cpu,opencl": the devices this build of the runtime runs artifacts on. */
    public static native String runtimeDevices();

    public static native String statusName(int status);

    /** Opens an artifact directory; memLimitBytes &gt; 0 refuses a plan above it before allocating. */
    public static native long modelOpen(String artifactDir, int threads, long memLimitBytes) throws EdgeKvException;

    public static native void modelClose(long model);

    public static native String modelLastError(long model);

    public static native void modelInfo(long model, ModelInfo out);

    public static native long sessionNew(long model) throws EdgeKvException;

    public static native void sessionFree(long session);

    public static native void sessionReset(long session);

    public static native String sessionLastError(long session);

    public static native long position(long session);

    /** Any thread: stops a running prefill or generation at the next block or token. */
    public static native void cancel(long session);

    public static native int[] encode(long model, String text, boolean chat, int part) throws EdgeKvException;

    public static native void prefill(long session, int[] ids, Progress progress) throws EdgeKvException;

    /**
     * The question whose rows score every following prefill block (artifacts compiled with
     * --question-rows; {@link ModelInfo#questionRows} &gt; 0); null clears it.
     */
    public static native void setQuestion(long session, int[] ids) throws EdgeKvException;

    public static native void decode(long session, int token) throws EdgeKvException;

    public static native int greedy(long session, long model) throws EdgeKvException;

    public static native int[] generate(long session, int[] prompt, int maxNewTokens, float temperature, float topP,
                                        long seed, Progress progress, Tokens tokens) throws EdgeKvException;

    public static native void stats(long session, Stats out);

    public static native void save(long session, String path, String question, boolean chat) throws EdgeKvException;

    public static native void load(long session, String path) throws EdgeKvException;

    public static native boolean snapshotInfo(long session, SnapshotInfo out);
}
