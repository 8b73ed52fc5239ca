package com.edgekv.demo;

import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;

/**
 * What outlives an Activity: the engine (model and session), the one worker thread, the running
 * job and everything the screen shows about it (message, progress, the answer so far, the panels).
 * Dark mode, a locale or font-scale change recreate the Activity; the new one attaches here and
 * renders what is here, so a running job keeps its progress, its buttons stay disabled, and every
 * update goes to the Activity that is on screen now (never to the one that was destroyed).
 *
 * Data flow is one-way: jobs (worker thread) change the state under its lock and call changed();
 * changed() posts one render to the UI thread (coalesced: many tokens, one redraw); the attached
 * Screen reads the state there. One job runs at a time: start() refuses a second.
 *
 * Pure Java (no android.*): the Application supplies a Host (the UI thread's Handler, and the
 * foreground service that keeps a long prefill alive in the background), and
 * tests/test_android_ui.py drives it on a desktop JVM through a recreation (UiCheck).
 */
public final class AppState {
    public enum Tone { NOTE, OK, ERROR }

    /** The screen on display: render() runs on the UI thread and reads the state. */
    public interface Screen {
        void render(AppState state);
    }

    /** The platform around the state. */
    public interface Host {
        /** Runs r on the UI thread. */
        void post(Runnable r);

        /** A job started: keep the process alive (foreground service and its notification). */
        void workStarted(String title);

        /** The job's progress, for the notification (called often: rate-limit there). */
        void workProgress(String title, String text, long done, long max);

        /** The job ended (the service may stop). */
        void workFinished();
    }

    /** A piece of work for the worker thread; an exception is shown as the job's error. */
    public interface Job {
        void run(AppState state) throws Exception;
    }

    /* trim levels (the values of android.content.ComponentCallbacks2's constants) */
    public static final int TRIM_RUNNING_CRITICAL = 15, TRIM_UI_HIDDEN = 20, TRIM_MODERATE = 60;

    private static AppState instance;

    /** The process's one state; the Application installs its Host before any Activity starts. */
    public static synchronized AppState install(Host host) {
        if (instance == null) instance = new AppState(host);
        return instance;
    }

    public static synchronized AppState get() {
        if (instance == null) throw new IllegalStateException("AppState.install was not called");
        return instance;
    }

    public final Engine engine = new Engine();
    private final Host host;
    private final ExecutorService worker = Executors.newSingleThreadExecutor();
    private final ExecutorService io = Executors.newSingleThreadExecutor(); /* documents: never behind a prefill */

    /* guarded by this */
    private Screen screen;
    private boolean renderPending;
    private boolean busy, cancelling;
    private String jobTitle = "";
    private String message = "";
    private Tone tone = Tone.NOTE;
    private String progressText = "", memoryText = "";
    private long progressDone, progressMax = 1;
    private final StringBuilder answer = new StringBuilder();
    private String compiled = "No model open.", measured = "Nothing run yet.", benchReport = "";
    private String sampling = Engine.Sampling.GREEDY.describe();
    private String openName;       /* the model open now, or the one closed to free memory */
    private boolean closedForMemory;
    private long planBytes;
    private String documentPreview = "";
    private long lastMemoryRead;
    private int renders;

    public AppState(Host host) {
        this.host = host;
    }

    // ---- the screen ------------------------------------------------------------------------------

    /** The Activity on screen now (onCreate / onStart); renders the current state at once. */
    public synchronized void attach(Screen s) {
        screen = s;
        changed();
    }

    /** The Activity goes away (onStop / onDestroy): nothing more is posted to it. */
    public synchronized void detach(Screen s) {
        if (screen == s) screen = null;
    }

    /** Coalesced: one render pending at a time, run on the UI thread for the screen attached then. */
    void changed() {
        Host h = host;
        String title, text;
        long done, max;
        boolean post;
        synchronized (this) {
            post = !renderPending && screen != null;
            if (post) renderPending = true;
            title = jobTitle;
            text = progressText;
            done = progressDone;
            max = progressMax;
        }
        if (busy()) h.workProgress(title, text, done, max);
        if (!post) return;
        h.post(new Runnable() {
            @Override
            public void run() {
                Screen s;
                synchronized (AppState.this) {
                    renderPending = false;
                    s = screen;
                    renders++;
                }
                if (s != null) s.render(AppState.this);
            }
        });
    }

    // ---- jobs ------------------------------------------------------------------------------------

    /**
     * Runs `job` on the worker; false (and nothing started) while another job runs. The message,
     * progress and answer are cleared first; the job's error, or "Cancelled", ends it.
     */
    public boolean start(final String title, final Job job) {
        synchronized (this) {
            if (busy) return false;
            busy = true;
            cancelling = false;
            jobTitle = title;
            message = title + "…";
            tone = Tone.NOTE;
            progressText = "";
            progressDone = 0;
            progressMax = 1;
        }
        host.workStarted(title);
        changed();
        worker.execute(new Runnable() {
            @Override
            public void run() {
                try {
                    job.run(AppState.this);
                } catch (Throwable t) {
                    if (t instanceof EdgeKvException && ((EdgeKvException) t).cancelled()) {
                        message("Cancelled: " + t.getMessage(), Tone.NOTE);
                    } else {
                        message(describe(t), Tone.ERROR);
                    }
                } finally {
                    synchronized (AppState.this) {
                        busy = false;
                        cancelling = false;
                    }
                    host.workFinished();
                    changed();
                }
            }
        });
        return true;
    }

    /** Runs r on the document thread (reading or writing the document file; never behind a prefill). */
    public void io(Runnable r) {
        io.execute(r);
    }

    /** Any thread: stop the running job at the next block or token. */
    public void cancel() {
        synchronized (this) {
            if (!busy) return;
            cancelling = true;
            message = "Cancelling…";
            tone = Tone.NOTE;
        }
        engine.cancel();
        changed();
    }

    /**
     * The system asks for memory (Application.onTrimMemory). At TRIM_MODERATE and above (the
     * process is in the background and next in line to be killed) or TRIM_RUNNING_CRITICAL, and
     * when no job runs, the model is closed: its KV cache and activations are the runtime's largest
     * allocations, and Open (or the next question, which reopens it) rebuilds them; the saved
     * document cache stays on disk. A running job keeps it. The screen says which happened.
     * The close runs on the worker (engine calls belong to it); the UI thread does not wait.
     */
    public void trimMemory(final int level) {
        if (level < TRIM_MODERATE && level != TRIM_RUNNING_CRITICAL) return;
        synchronized (this) {
            if (busy) {
                memoryText = "The system is short of memory (level " + level
                        + "); the model stays open for the running job.";
            }
        }
        if (busy()) {
            changed();
            return;
        }
        worker.execute(new Runnable() {
            @Override
            public void run() {
                synchronized (AppState.this) {
                    if (busy || !engine.isOpen()) return;
                }
                engine.close();
                synchronized (AppState.this) {
                    closedForMemory = true;
                    compiled = "Closed " + openName + " to give memory back to the system (level " + level
                            + "). Open it again, or ask: it reopens.";
                    message = "The model was closed to free memory; it reopens when needed.";
                    tone = Tone.NOTE;
                }
                changed();
            }
        });
    }

    // ---- what jobs report ------------------------------------------------------------------------

    public void message(String text, Tone t) {
        synchronized (this) {
            message = text;
            tone = t;
        }
        changed();
    }

    public void progress(String text, long done, long max) {
        synchronized (this) {
            progressText = text;
            progressDone = done;
            progressMax = Math.max(1, max);
        }
        readMemory(false);
        changed();
    }

    /** Live memory (at most every 500 ms unless forced): RSS now and its peak, against the plan. */
    void readMemory(boolean force) {
        long now = System.nanoTime();
        synchronized (this) {
            if (!force && now - lastMemoryRead < 500000000L) return;
            lastMemoryRead = now;
        }
        String text = "memory now: " + MemoryProbe.now().describe(planBytes());
        synchronized (this) {
            memoryText = text;
        }
    }

    public synchronized void clearAnswer() {
        answer.setLength(0);
    }

    public void appendAnswer(String text) {
        synchronized (this) {
            answer.append(text);
        }
        changed();
    }

    public void setCompiled(String text) {
        synchronized (this) {
            compiled = text;
        }
        changed();
    }

    public void setMeasured(String text) {
        synchronized (this) {
            measured = text;
        }
        changed();
    }

    public void setBenchReport(String text) {
        synchronized (this) {
            benchReport = text;
        }
        changed();
    }

    public void setSampling(String text) {
        synchronized (this) {
            sampling = text;
        }
        changed();
    }

    public void setDocumentPreview(String text) {
        synchronized (this) {
            documentPreview = text;
        }
        changed();
    }

    /** A model was opened (name, its plan) or closed (null). */
    public void setOpen(String name, long plan) {
        synchronized (this) {
            openName = name;
            planBytes = plan;
            closedForMemory = false;
        }
        readMemory(true);
        changed();
    }

    /** The engine's listener for an answer: phases, prefill blocks, decoded tokens, the text. */
    public Engine.Listener listener() {
        return new Engine.DecodeListener() {
            @Override
            public void onPhase(String phase) {
                message(phase.isEmpty() ? phase : Character.toUpperCase(phase.charAt(0)) + phase.substring(1) + "…",
                        Tone.NOTE);
            }

            @Override
            public void onProgress(String what, long done, long total, long blocksDone, long blocksTotal) {
                progress(String.format(java.util.Locale.US, "%s: block %d / %d (%d / %d tokens)", what, blocksDone,
                        blocksTotal, done, total), blocksDone, blocksTotal);
            }

            @Override
            public void onDecoded(int tokens, int maxNewTokens) {
                progress(String.format(java.util.Locale.US, "decoding: token %d / %d at most", tokens, maxNewTokens),
                        tokens, maxNewTokens);
            }

            @Override
            public void onText(String text) {
                appendAnswer(text);
            }
        };
    }

    // ---- what the screen reads -------------------------------------------------------------------

    public synchronized boolean busy() {
        return busy;
    }

    public synchronized boolean cancelling() {
        return cancelling;
    }

    public synchronized String jobTitle() {
        return jobTitle;
    }

    public synchronized String message() {
        return message;
    }

    public synchronized Tone tone() {
        return tone;
    }

    public synchronized String progressText() {
        return progressText;
    }

    public synchronized long progressDone() {
        return progressDone;
    }

    public synchronized long progressMax() {
        return progressMax;
    }

    public synchronized String memoryText() {
        return memoryText;
    }

    public synchronized String answer() {
        return answer.toString();
    }

    public synchronized String compiled() {
        return compiled;
    }

    public synchronized String measured() {
        return measured;
    }

    public synchronized String benchReport() {
        return benchReport;
    }

    public synchronized String sampling() {
        return sampling;
    }

    public synchronized String documentPreview() {
        return documentPreview;
    }

    public synchronized String openName() {
        return openName;
    }

    public synchronized boolean closedForMemory() {
        return closedForMemory;
    }

    public synchronized long planBytes() {
        return planBytes;
    }

    /** Renders run so far (the host test counts them). */
    public synchronized int renders() {
        return renders;
    }

    static String describe(Throwable t) {
        if (t instanceof EdgeKvException) {
            EdgeKvException e = (EdgeKvException) t;
            String status;
            try {
                status = EdgeKv.statusName(e.status);
            } catch (Throwable notLoaded) { /* UnsatisfiedLinkError: the bridge is not loaded */
                status = "status " + e.status;
            }
            return "Runtime error (" + status + "): " + e.getMessage();
        }
        if (t instanceof OutOfMemoryError) return "Out of memory: " + t.getMessage();
        if (t instanceof IllegalArgumentException && t.getMessage() != null) return t.getMessage();
        return t == null ? "unknown error" : t.toString();
    }
}
