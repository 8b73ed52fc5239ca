import com.edgekv.demo.AppState;
import com.edgekv.demo.Bench;
import com.edgekv.demo.DocumentStore;
import com.edgekv.demo.EdgeKv;
import com.edgekv.demo.EdgeKvException;
import com.edgekv.demo.Engine;
import com.edgekv.demo.Json;
import com.edgekv.demo.MemoryProbe;
import com.edgekv.demo.ScriptRequest;

import java.io.ByteArrayInputStream;
import java.io.File;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;

/**
 * The app's UI-side logic that needs no framework, on a desktop JVM (tests/test_android_ui.py runs
 * it and checks what it prints):
 *
 *   java UiCheck WORK_DIR [ARTIFACT DOCUMENT QUESTION [PP TG REPS]]
 *
 * Prints one JSON object: the scripted entry point's name checks (refusals of "..", absolute
 * paths, separators), the document store (preview, the 8 MiB and UTF-8 refusals, nothing left
 * behind), AppState through an Activity recreation with a fake UI thread (a job started by one
 * screen reports to the next; a second job is refused while it runs; cancel), and with an
 * artifact: a question through AppState as the screen asks it (the same ids as the Engine alone,
 * decode progress), the benchmark (pp/tg), and onTrimMemory closing an idle model and keeping a
 * busy one.
 */
public final class UiCheck {
    /** A screen that records what it rendered (on the fake UI thread). */
    static final class Screen implements AppState.Screen {
        final String name;
        final List<String> seen = new ArrayList<String>();

        Screen(String name) {
            this.name = name;
        }

        @Override
        public synchronized void render(AppState s) {
            seen.add((s.busy() ? "busy" : "idle") + "|" + s.message() + "|" + s.progressText() + "|" + s.answer());
        }

        synchronized List<String> seen() {
            return new ArrayList<String>(seen);
        }
    }

    static final ExecutorService UI = Executors.newSingleThreadExecutor();
    static final List<String> HOST_EVENTS = new ArrayList<String>();

    public static void main(String[] args) throws Exception {
        File work = new File(args[0]);
        Map<String, Object> out = new LinkedHashMap<String, Object>();
        out.put("names", names());
        out.put("requests", requests());
        out.put("documents", documents(new File(work, "docs")));
        MemoryProbe m = MemoryProbe.now();
        out.put("memory_rss", m.rssBytes);
        out.put("memory_peak", m.peakRssBytes);
        out.put("memory_text", m.describe(m.peakRssBytes * 2));

        AppState state = AppState.install(new AppState.Host() {
            @Override
            public void post(Runnable r) {
                UI.execute(r);
            }

            @Override
            public synchronized void workStarted(String title) {
                HOST_EVENTS.add("started " + title);
            }

            @Override
            public void workProgress(String title, String text, long done, long max) {
            }

            @Override
            public synchronized void workFinished() {
                HOST_EVENTS.add("finished");
            }
        });
        out.put("recreation", recreation(state));
        int[] bench = args.length > 6 ? new int[]{Integer.parseInt(args[4]), Integer.parseInt(args[5]),
                Integer.parseInt(args[6])} : new int[]{12, 6, 2};
        if (args.length > 1) out.put("model", model(state, new File(args[1]), read(new File(args[2])), args[3],
                new File(work, "snapshots"), bench));
        out.put("host_events", HOST_EVENTS);
        UI.shutdown();
        System.out.println(Json.write(out));
        System.exit(0);
    }

    static Map<String, Object> names() {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        for (String v : Arrays.asList("smol-android", "doc.txt", "run-2.json", "..", "../etc", "a/../../b", "/sdcard/x",
                "/data/data/com.other/files/secret", "a/b", "a\\b", ".hidden", "", "caf\u00e9", "x\u0000y",
                "sub/..")) {
            try {
                m.put(v, "ok " + ScriptRequest.name("artifact", v, "a directory under files/artifacts"));
            } catch (IllegalArgumentException e) {
                m.put(v, "refused: " + e.getMessage());
            }
        }
        return m;
    }

    static Map<String, Object> requests() {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        m.put("good", request(extras("artifact", "smol", "document_file", "doc.txt", "result", "r.json",
                "questions", new String[]{"Q1", "Q2"})));
        m.put("document_path", request(extras("artifact", "smol", "document_file", "/sdcard/Download/doc.txt")));
        m.put("document_up", request(extras("artifact", "smol", "document_file", "../../shared_prefs/x.xml")));
        m.put("result_up", request(extras("artifact", "smol", "result", "../../lib/libedgekv_jni.so")));
        m.put("artifact_up", request(extras("artifact", "../staged/smol")));
        m.put("no_artifact", request(extras("document_file", "doc.txt")));
        return m;
    }

    static Map<String, Object> extras(Object... kv) {
        Map<String, Object> m = new HashMap<String, Object>();
        for (int i = 0; i < kv.length; i += 2) m.put((String) kv[i], kv[i + 1]);
        return m;
    }

    static Object request(final Map<String, Object> x) {
        try {
            ScriptRequest r = ScriptRequest.parse(new ScriptRequest.Extras() {
                @Override
                public boolean has(String key) {
                    return x.containsKey(key);
                }

                @Override
                public String string(String key) {
                    return x.get(key) instanceof String ? (String) x.get(key) : null;
                }

                @Override
                public String[] strings(String key) {
                    return x.get(key) instanceof String[] ? (String[]) x.get(key) : null;
                }

                @Override
                public int integer(String key, int otherwise) {
                    return x.get(key) instanceof Integer ? (Integer) x.get(key) : otherwise;
                }
            });
            return r.artifact + " " + r.documentFile + " " + r.result + " " + r.questions;
        } catch (IllegalArgumentException e) {
            return "refused: " + e.getMessage();
        }
    }

    static Map<String, Object> documents(File dir) throws Exception {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        DocumentStore store = new DocumentStore(dir);
        m.put("empty_preview", store.preview(3, 100));
        StringBuilder text = new StringBuilder();
        for (int i = 1; i <= 200; i++) text.append("line ").append(i).append(": the lighthouse keeper\n");
        store.replace(text.toString());
        m.put("preview", store.preview(3, 100));
        m.put("read_equal", store.read().equals(text.toString()));
        byte[] big = new byte[DocumentStore.MAX_BYTES + 1];
        Arrays.fill(big, (byte) 'a');
        try {
            store.replace(new ByteArrayInputStream(big));
            m.put("too_large", "accepted");
        } catch (java.io.IOException e) {
            m.put("too_large", e.getMessage());
        }
        try {
            store.replace(new ByteArrayInputStream(new byte[]{'o', 'k', (byte) 0xff, (byte) 0xfe}));
            m.put("not_utf8", "accepted");
        } catch (java.io.IOException e) {
            m.put("not_utf8", e.getMessage());
        }
        m.put("kept_after_refusals", store.read().equals(text.toString()));
        m.put("files", Arrays.asList(dir.list()));
        return m;
    }

    /** A job started under screen A; A is destroyed and B attached (a recreation) while it runs. */
    static Map<String, Object> recreation(final AppState state) throws Exception {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        Screen a = new Screen("A"), b = new Screen("B");
        state.attach(a);
        final CountDownLatch started = new CountDownLatch(1), recreated = new CountDownLatch(1);
        final CountDownLatch cancelSeen = new CountDownLatch(1);
        boolean first = state.start("Answering", new AppState.Job() {
            @Override
            public void run(AppState s) throws Exception {
                s.progress("document: block 1 / 4", 1, 4);
                started.countDown();
                recreated.await(10, TimeUnit.SECONDS);
                s.progress("document: block 2 / 4", 2, 4);
                s.appendAnswer("The ship");
                while (!s.cancelling()) Thread.sleep(5);
                cancelSeen.countDown();
                throw new EdgeKvException(EdgeKvException.CANCELLED, "cancelled at block 2");
            }
        });
        started.await(10, TimeUnit.SECONDS);
        settle();
        state.detach(a);     /* onStop/onDestroy of the old Activity */
        state.attach(b);     /* onStart of the new one */
        settle();
        m.put("b_first_render", last(b.seen()));
        boolean second = state.start("Another", new AppState.Job() {
            @Override
            public void run(AppState s) {
            }
        });
        int aRenders = a.seen().size();
        recreated.countDown();
        for (int i = 0; i < 200 && !last(b.seen()).contains("block 2"); i++) Thread.sleep(10);
        state.cancel();
        cancelSeen.await(10, TimeUnit.SECONDS);
        for (int i = 0; i < 200 && state.busy(); i++) Thread.sleep(10);
        settle();
        m.put("first_started", first);
        m.put("second_refused_while_busy", !second);
        m.put("a_renders_after_detach", a.seen().size() - aRenders);
        m.put("a_last", last(a.seen()));
        m.put("b_last", last(b.seen()));
        m.put("b_saw_block_2", b.seen().toString().contains("document: block 2 / 4"));
        m.put("busy_after", state.busy());
        m.put("third_started_after", state.start("Third", new AppState.Job() {
            @Override
            public void run(AppState s) {
                s.message("third ran", AppState.Tone.OK);
            }
        }));
        for (int i = 0; i < 200 && state.busy(); i++) Thread.sleep(10);
        settle();
        m.put("b_after_third", last(b.seen()));
        state.detach(b);
        return m;
    }

    /** The real engine through AppState: a question, decode progress, the benchmark, onTrimMemory. */
    static Map<String, Object> model(final AppState state, final File artifact, final String document,
                                     final String question, final File snapshots, final int[] bench)
            throws Exception {
        final Map<String, Object> m = new LinkedHashMap<String, Object>();
        EdgeKv.loadLibraries();
        Engine alone = new Engine();
        alone.open(artifact, 1, 0, new File(snapshots, "alone"));
        m.put("alone_ids", alone.ask(document, question, 8, 0f, quiet()).ids);
        alone.close();

        Screen screen = new Screen("S");
        state.attach(screen);
        final List<String> decodeProgress = new ArrayList<String>();
        run(state, "Opening", new AppState.Job() {
            @Override
            public void run(AppState s) throws Exception {
                s.engine.open(artifact, 1, 0, snapshots);
                s.setOpen(artifact.getName(), s.engine.info().planBytes);
            }
        });
        waitIdle(state);
        run(state, "Answering", new AppState.Job() {
            @Override
            public void run(AppState s) throws Exception {
                s.clearAnswer();
                final Engine.Listener inner = s.listener();
                Engine.Answer a = s.engine.ask(document, question, 8, Engine.Sampling.GREEDY, new Engine.DecodeListener() {
                    @Override
                    public void onDecoded(int tokens, int max) {
                        ((Engine.DecodeListener) inner).onDecoded(tokens, max);
                        decodeProgress.add(state.progressText());
                    }

                    @Override
                    public void onPhase(String phase) {
                        inner.onPhase(phase);
                    }

                    @Override
                    public void onProgress(String what, long done, long total, long bd, long bt) {
                        inner.onProgress(what, done, total, bd, bt);
                    }

                    @Override
                    public void onText(String text) {
                        inner.onText(text);
                    }
                });
                m.put("state_ids", a.ids);
                m.put("state_answer_equal", s.answer().equals(a.text));
            }
        });
        waitIdle(state);
        m.put("decode_progress", decodeProgress);
        m.put("memory_text", state.memoryText());
        m.put("plan_bytes", state.planBytes());
        run(state, "Benchmark", new AppState.Job() {
            @Override
            public void run(AppState s) throws Exception {
                List<Object> rows = new ArrayList<Object>();
                for (Bench.Result r : Bench.run(s.engine, bench[0], bench[1], bench[2], new Bench.Listener() {
                    @Override
                    public void onStep(String test, long done, long total, int rep) {
                    }
                })) {
                    Map<String, Object> row = new LinkedHashMap<String, Object>();
                    row.put("test", r.test);
                    row.put("tokens", r.tokens);
                    row.put("reps", r.reps);
                    row.put("mean_tok_s", r.meanTokS);
                    row.put("sd_tok_s", r.sdTokS);
                    row.put("peak_rss_bytes", r.peakRssBytes);
                    row.put("plan_bytes", r.planBytes);
                    row.put("row", r.row());
                    rows.add(row);
                }
                m.put("bench", rows);
                try {
                    Bench.run(s.engine, 1 << 20, 0, 1, null);
                    m.put("bench_too_long", "accepted");
                } catch (EdgeKvException e) {
                    m.put("bench_too_long", e.status + " " + e.getMessage());
                }
            }
        });
        waitIdle(state);
        m.put("bench_message", state.message());
        /* after the benchmark the same question still answers the same (its saved cache or a new read) */
        run(state, "Again", new AppState.Job() {
            @Override
            public void run(AppState s) throws Exception {
                m.put("again_ids", s.engine.ask(document, question, 8, 0f, quiet()).ids);
            }
        });
        waitIdle(state);

        /* onTrimMemory while a job runs: the model stays open */
        final CountDownLatch inJob = new CountDownLatch(1), release = new CountDownLatch(1);
        state.start("Holding", new AppState.Job() {
            @Override
            public void run(AppState s) throws Exception {
                inJob.countDown();
                release.await(10, TimeUnit.SECONDS);
            }
        });
        inJob.await(10, TimeUnit.SECONDS);
        state.trimMemory(80 /* TRIM_MEMORY_COMPLETE */);
        m.put("trim_busy_note", state.memoryText());
        release.countDown();
        waitIdle(state);
        m.put("open_after_busy_trim", state.engine.isOpen());
        state.trimMemory(20 /* TRIM_MEMORY_UI_HIDDEN: nothing to drop */);
        Thread.sleep(100);
        m.put("open_after_ui_hidden", state.engine.isOpen());
        state.trimMemory(80);
        for (int i = 0; i < 300 && !state.closedForMemory(); i++) Thread.sleep(10);
        m.put("open_after_idle_trim", state.engine.isOpen());
        m.put("closed_for_memory", state.closedForMemory());
        m.put("compiled_after_trim", state.compiled());
        settle();
        m.put("screen_last", last(screen.seen()));
        state.detach(screen);
        return m;
    }

    static void waitIdle(AppState state) throws InterruptedException {
        Thread.sleep(20);
        while (state.busy()) Thread.sleep(10); /* the test's own timeout bounds it */
        settle();
    }

    /** Starts a job that must start (nothing else runs). */
    static void run(AppState state, String title, AppState.Job job) throws InterruptedException {
        if (!state.start(title, job)) throw new IllegalStateException(title + " did not start: " + state.jobTitle() + " runs");
        waitIdle(state);
    }

    /** Lets the fake UI thread run what was posted. */
    static void settle() throws InterruptedException {
        final CountDownLatch done = new CountDownLatch(1);
        UI.execute(new Runnable() {
            @Override
            public void run() {
                done.countDown();
            }
        });
        done.await(10, TimeUnit.SECONDS);
    }

    static String last(List<String> l) {
        return l.isEmpty() ? "" : l.get(l.size() - 1);
    }

    static Engine.Listener quiet() {
        return new Engine.Listener() {
            @Override
            public void onPhase(String phase) {
            }

            @Override
            public void onProgress(String what, long done, long total, long blocksDone, long blocksTotal) {
            }

            @Override
            public void onText(String text) {
            }
        };
    }

    static String read(File f) throws Exception {
        return new String(java.nio.file.Files.readAllBytes(f.toPath()), "UTF-8");
    }
}
