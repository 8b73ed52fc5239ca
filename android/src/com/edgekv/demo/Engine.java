package com.edgekv.demo;

import java.io.File;
import java.io.UnsupportedEncodingException;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;

/**
 * The app's use of the runtime, without any UI: one model, one session, and the open document's
 * saved cache. Reading a document once and answering several questions about it (issue 20): the
 * first question about a document prefills it block by block, saves the cache state
 * (ekv_session_save) and continues with the question; every later question about the same
 * document maps that file back (ekv_session_load) and prefills only the question.
 * An artifact compiled with --question-rows reads the document knowing the question (issue 16):
 * the question's rows score every block, so the kept cache belongs to that question; its saved
 * cache serves the same question again, and another question reads the document again.
 *
 * Pure Java: the Activity runs it on its worker thread, and tests/test_android_app.py runs it on a
 * desktop JVM against a host artifact. All methods but {@link #cancel} belong to one thread.
 */
public final class Engine {
    /** What a run reports as it goes (called on the worker thread). */
    public interface Listener {
        void onPhase(String phase);

        /** Prefill: tokens done / total, and blocks done / total. */
        void onProgress(String what, long done, long total, long blocksDone, long blocksTotal);

        void onText(String text);
    }

    /** A Listener that also hears each generated token: decode progress (tokens so far, the most asked for). */
    public interface DecodeListener extends Listener {
        void onDecoded(int tokens, int maxNewTokens);
    }

    /** How the next token is chosen: temperature 0 is greedy (argmax); top-p in (0, 1]; the seed fixes the RNG. */
    public static final class Sampling {
        public final float temperature, topP;
        public final long seed;

        public Sampling(float temperature, float topP, long seed) {
            this.temperature = temperature;
            this.topP = topP;
            this.seed = seed;
        }

        public static final Sampling GREEDY = new Sampling(0f, 1f, 0);

        public boolean greedy() {
            return temperature <= 0f;
        }

        /** "greedy (temperature 0)" or "temperature 0.7 · top-p 0.9 · seed 42" */
        public String describe() {
            return greedy() ? "greedy (temperature 0)"
                    : String.format(java.util.Locale.US, "temperature %.2f · top-p %.2f · seed %d", temperature, topP, seed);
        }
    }

    /** One answer and what its run measured. */
    public static final class Answer {
        public String question = "", text = "";
        public int[] ids = new int[0];
        public boolean fromSnapshot;
        public boolean questionScoring;     /* the document was read knowing the question (--question-rows) */
        public int documentTokens, questionTokens;
        public double documentSeconds;      /* the document's prefill (then, or when the snapshot was made) */
        public double snapshotLoadSeconds;  /* mapping the saved cache back (0 when read now) */
        public double firstTokenSeconds;    /* from the start of this answer to its first token */
        public double totalSeconds;
        public Stats stats = new Stats();   /* since the document was read (now) or the snapshot loaded */

        public int promptTokens() {
            return documentTokens + questionTokens;
        }
    }

    private final Object lock = new Object();
    private long model, session;
    private ModelInfo info;
    private File artifactDir;
    private File snapshotDir;
    private String documentKey;
    private File documentSnapshot;
    private int documentTokens;
    private double documentSeconds;
    private volatile boolean cancelled;

    public boolean isOpen() {
        return model != 0;
    }

    public ModelInfo info() {
        return info;
    }

    public File artifactDir() {
        return artifactDir;
    }

    /**
     * Opens an artifact (closing the one before). memLimitBytes &gt; 0: the runtime refuses a plan
     * above it before allocating. Document caches are saved in snapshotDir.
     */
    public void open(File dir, int threads, long memLimitBytes, File snapshotDir) throws EdgeKvException {
        close();
        long m = EdgeKv.modelOpen(dir.getPath(), threads, memLimitBytes);
        long s;
        try {
            s = EdgeKv.sessionNew(m);
        } catch (EdgeKvException e) {
            EdgeKv.modelClose(m);
            throw e;
        }
        ModelInfo i = new ModelInfo();
        EdgeKv.modelInfo(m, i);
        synchronized (lock) {
            model = m;
            session = s;
        }
        info = i;
        artifactDir = dir;
        this.snapshotDir = snapshotDir;
        if (!snapshotDir.isDirectory() && !snapshotDir.mkdirs()) {
            throw new EdgeKvException(EdgeKvException.IO, "cannot create " + snapshotDir);
        }
        File[] old = snapshotDir.listFiles(); /* caches of an earlier process: no document is open now */
        if (old != null) {
            for (File f : old) if (f.getName().startsWith("document-") && f.getName().endsWith(".ekv")) f.delete();
        }
    }

    public void close() {
        synchronized (lock) {
            if (session != 0) EdgeKv.sessionFree(session);
            if (model != 0) EdgeKv.modelClose(model);
            session = 0;
            model = 0;
        }
        info = null;
        forgetDocument();
    }

    /** Any thread: stop the running prefill or generation at the next block or token. */
    public void cancel() {
        synchronized (lock) {
            cancelled = true;
            if (session != 0) EdgeKv.cancel(session);
        }
    }

    /** Drop the saved cache of the open document (the next question reads it again). */
    public void forgetDocument() {
        if (documentSnapshot != null && !documentSnapshot.delete() && documentSnapshot.exists()) {
            documentSnapshot.deleteOnExit();
        }
        documentSnapshot = null;
        documentKey = null;
    }

    /** Token ids of a text as the open artifact's tokenizer encodes it (EdgeKv.PART_*). */
    public int[] encode(String text, boolean chat, int part) throws EdgeKvException {
        if (model == 0) throw new EdgeKvException(EdgeKvException.INVALID_ARG, "open an artifact first");
        return EdgeKv.encode(model, text, chat, part);
    }

    /* for Bench: the open handles, and whether Cancel was asked since the last clearCancel() */
    long modelHandle() {
        return model;
    }

    long sessionHandle() {
        return session;
    }

    void clearCancel() {
        cancelled = false;
    }

    boolean cancelRequested() {
        return cancelled;
    }

    public Stats stats() {
        Stats s = new Stats();
        if (session != 0) EdgeKv.stats(session, s);
        return s;
    }

    /**
     * Answers a question about a document. An empty question runs the document alone as the
     * prompt (no cache saved); an empty document, the question alone. Greedy decoding when
     * temperature is 0. Cancelling throws EdgeKvException with status CANCELLED.
     */
    public Answer ask(String document, String question, int maxNewTokens, float temperature, final Listener listener)
            throws EdgeKvException {
        return ask(document, question, maxNewTokens, new Sampling(temperature, 1.0f, 0), listener);
    }

    /** As above, with the sampling settings (a DecodeListener also hears each token's count). */
    public Answer ask(String document, String question, final int maxNewTokens, Sampling sampling, final Listener listener)
            throws EdgeKvException {
        if (model == 0) throw new EdgeKvException(EdgeKvException.INVALID_ARG, "open an artifact first");
        cancelled = false;
        final long t0 = System.nanoTime();
        final Answer a = new Answer();
        a.question = question;
        boolean chat = info.chat;
        final long block = Math.max(1, info.block);
        final StringBuilder text = new StringBuilder();
        final double[] firstToken = {0};
        final int[] decoded = {0};
        final DecodeListener decodes = listener instanceof DecodeListener ? (DecodeListener) listener : null;
        EdgeKv.Tokens tokens = new EdgeKv.Tokens() {
            @Override
            public boolean onToken(int id, String piece) {
                if (firstToken[0] == 0) firstToken[0] = (System.nanoTime() - t0) / 1e9;
                decoded[0]++;
                if (decodes != null) decodes.onDecoded(decoded[0], maxNewTokens);
                if (piece.length() > 0) {
                    text.append(piece);
                    listener.onText(piece);
                }
                return cancelled;
            }
        };
        boolean hasQuestion = question.trim().length() > 0, hasDocument = document.trim().length() > 0;
        if (!hasQuestion && !hasDocument) {
            throw new EdgeKvException(EdgeKvException.INVALID_ARG, "paste or open a document, or type a question");
        }
        int[] prompt;
        if (hasQuestion && hasDocument) {
            prompt = EdgeKv.encode(model, question, chat, EdgeKv.PART_QUESTION);
            a.questionScoring = info.questionRows > 0;
            String key = key(document, chat, a.questionScoring ? question : null);
            if (key.equals(documentKey) && documentSnapshot != null && documentSnapshot.isFile()) {
                listener.onPhase("loading the saved document cache");
                long l0 = System.nanoTime();
                EdgeKv.load(session, documentSnapshot.getPath());
                a.snapshotLoadSeconds = (System.nanoTime() - l0) / 1e9;
                SnapshotInfo si = new SnapshotInfo();
                if (EdgeKv.snapshotInfo(session, si)) {
                    a.documentTokens = (int) si.tokens;
                    a.documentSeconds = si.documentSeconds;
                } else {
                    a.documentTokens = documentTokens;
                    a.documentSeconds = documentSeconds;
                }
                a.fromSnapshot = true;
            } else {
                forgetDocument();
                EdgeKv.sessionReset(session);
                int[] doc = EdgeKv.encode(model, document, chat, EdgeKv.PART_DOCUMENT);
                listener.onPhase("reading the document: " + doc.length + " tokens in " + blocks(doc.length, block)
                        + " blocks of " + block);
                if (a.questionScoring) EdgeKv.setQuestion(session, prompt); /* refused past the rows, with the fix */
                try {
                    EdgeKv.prefill(session, doc, progress("document", block, listener));
                } finally {
                    if (a.questionScoring) EdgeKv.setQuestion(session, null);
                }
                Stats st = stats();
                documentTokens = a.documentTokens = doc.length;
                documentSeconds = a.documentSeconds = st.prefillSeconds;
                File snap = new File(snapshotDir, "document-" + key.substring(0, 16) + ".ekv");
                listener.onPhase("saving the document cache");
                EdgeKv.save(session, snap.getPath(), a.questionScoring ? question : null, chat);
                documentSnapshot = snap;
                documentKey = key;
            }
        } else {
            forgetDocument();
            EdgeKv.sessionReset(session);
            prompt = EdgeKv.encode(model, hasQuestion ? question : document, chat, EdgeKv.PART_WHOLE);
        }
        a.questionTokens = prompt.length;
        listener.onPhase(a.fromSnapshot ? "answering from the saved document cache" : "answering");
        a.ids = EdgeKv.generate(session, prompt, maxNewTokens, sampling.temperature, sampling.topP, sampling.seed,
                progress("question", block, listener), tokens);
        a.text = text.toString();
        a.firstTokenSeconds = firstToken[0];
        a.totalSeconds = (System.nanoTime() - t0) / 1e9;
        a.stats = stats();
        return a;
    }

    private EdgeKv.Progress progress(final String what, final long block, final Listener listener) {
        return new EdgeKv.Progress() {
            @Override
            public boolean onBlock(long done, long total) {
                listener.onProgress(what, done, total, blocks(done, block), blocks(total, block));
                return cancelled;
            }
        };
    }

    static long blocks(long tokens, long block) {
        return (tokens + block - 1) / block;
    }

    /**
     * The identity of a saved document cache: SHA-256 of the document's text and form, and of the
     * question that scored its blocks (null: read without one).
     */
    static String key(String document, boolean chat, String scoringQuestion) {
        try {
            MessageDigest d = MessageDigest.getInstance("SHA-256");
            d.update((chat ? "chat\n" : "plain\n").getBytes("UTF-8"));
            if (scoringQuestion != null) {
                byte[] q = scoringQuestion.getBytes("UTF-8");
                d.update(("question " + q.length + "\n").getBytes("UTF-8"));
                d.update(q);
            }
            byte[] h = d.digest(document.getBytes("UTF-8"));
            StringBuilder b = new StringBuilder();
            for (byte x : h) b.append(String.format("%02x", x & 0xff));
            return b.toString();
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        } catch (UnsupportedEncodingException e) {
            throw new IllegalStateException(e);
        }
    }
}
