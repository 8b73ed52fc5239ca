package com.edgekv.demo;

import android.app.ActivityManager;
import android.content.Context;
import android.os.Build;
import android.util.Log;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The work the screens and scripts start, as AppState jobs (run on the worker thread). Each holds
 * the Application's context only, never an Activity: a job outlives the screen that started it.
 */
final class Jobs {
    static final String TAG = "edgekv";

    private Jobs() {
    }

    static DocumentStore documents(Context app) {
        return new DocumentStore(app.getFilesDir());
    }

    /** Imports the package the file picker returned; Cancel stops it and nothing is kept. */
    static AppState.Job importModel(final Context app, final android.net.Uri uri) {
        return new AppState.Job() {
            @Override
            public void run(final AppState state) throws Exception {
                final ModelStore.CancelFlag cancel = new ModelStore.CancelFlag();
                String name = ModelImport.importFrom(app, Models.store(app), uri, new ModelStore.Progress() {
                    @Override
                    public void onProgress(String part, long done, long total) {
                        if (state.cancelling()) cancel.cancel();
                        state.progress("Importing " + part, done, total);
                    }
                }, cancel);
                state.message("Imported " + name + ": tap Refresh, choose it, Open.", AppState.Tone.OK);
            }
        };
    }

    /** Deletes imported model `name` (closing it first when it is the open one). */
    static AppState.Job deleteModel(final Context app, final String name) {
        return new AppState.Job() {
            @Override
            public void run(AppState state) throws Exception {
                if (name.equals(state.openName())) {
                    state.engine.close();
                    state.setOpen(null, 0);
                    state.setCompiled("No model open.");
                }
                Models.delete(app, name);
                state.message("Deleted " + name + ".", AppState.Tone.OK);
            }
        };
    }

    /** Opens model `name` (the memory check first, then the runtime's own check of the plan). */
    static AppState.Job open(final Context app, final String name) {
        return new AppState.Job() {
            @Override
            public void run(AppState state) throws Exception {
                openNow(app, state, name);
                state.message("Opened " + name + " on " + state.engine.info().device + ".", AppState.Tone.OK);
            }
        };
    }

    private static void openNow(Context app, AppState state, String name) throws IOException, EdgeKvException {
        Engine engine = state.engine;
        engine.close();
        state.setOpen(null, 0);
        state.setCompiled("No model open.");
        File source = Models.source(app, name);
        Artifact a = Artifact.read(source);
        ActivityManager am = (ActivityManager) app.getSystemService(Context.ACTIVITY_SERVICE);
        ActivityManager.MemoryInfo mem = new ActivityManager.MemoryInfo();
        am.getMemoryInfo(mem);
        String refusal = a.memoryRefusal(mem.availMem, mem.threshold);
        if (refusal != null) throw new IllegalArgumentException(refusal);
        state.message("Opening " + name + "…", AppState.Tone.NOTE);
        File loadable = Models.loadable(app, name);
        long limit = mem.availMem - mem.threshold;
        engine.open(loadable, threads(), limit > 0 ? limit : 0, new File(app.getCacheDir(), "snapshots"));
        state.setOpen(name, engine.info().planBytes);
        state.setCompiled(Panels.compiled(a, engine.info()));
        Log.i(TAG, "opened " + source + " (loadable at " + loadable + ") on " + engine.info().device);
    }

    /** The model closed to free memory comes back before the work that needs it. */
    private static void reopenIfTrimmed(Context app, AppState state) throws IOException, EdgeKvException {
        if (!state.engine.isOpen() && state.closedForMemory() && state.openName() != null) {
            openNow(app, state, state.openName());
        }
        if (!state.engine.isOpen()) throw new IllegalArgumentException("Open a model first (Models, above).");
    }

    /** Answers `question` about the document file. */
    static AppState.Job ask(final Context app, final String question, final int maxNew,
                            final Engine.Sampling sampling) {
        return new AppState.Job() {
            @Override
            public void run(AppState state) throws Exception {
                reopenIfTrimmed(app, state);
                state.clearAnswer();
                state.setSampling(sampling.describe());
                String doc = documents(app).read();
                Engine.Answer a = state.engine.ask(doc, question, maxNew, sampling, state.listener());
                state.setMeasured(Panels.measured(a, state.engine.info(), sampling));
                state.message(a.fromSnapshot ? "Answered from the saved document cache." : "Answered.", AppState.Tone.OK);
            }
        };
    }

    /** The benchmark screen's run: pp then tg, `reps` times each (Bench). */
    static AppState.Job bench(final Context app, final int pp, final int tg, final int reps) {
        return new AppState.Job() {
            @Override
            public void run(final AppState state) throws Exception {
                reopenIfTrimmed(app, state);
                ModelInfo i = state.engine.info();
                StringBuilder b = new StringBuilder(String.format(java.util.Locale.US,
                        "%s · %s · N=%d · B=%d · %s · %d threads%n", i.modelId, i.policy, i.budget, i.block, i.device,
                        threads()));
                state.setBenchReport(b + "running…");
                List<Bench.Result> results = Bench.run(state.engine, pp, tg, reps, new Bench.Listener() {
                    @Override
                    public void onStep(String test, long done, long total, int rep) {
                        state.progress(String.format(java.util.Locale.US, "%s: %d / %d tokens (repetition %d of %d)",
                                test, done, total, rep, reps), done, total);
                    }
                });
                for (Bench.Result r : results) b.append(r.row()).append('\n');
                b.append(String.format(java.util.Locale.US, "(mean ± sd of %d; runtime timers; random ids, seed 1234)",
                        reps));
                state.setBenchReport(b.toString());
                state.readMemory(true);
                state.message("Benchmark done.", AppState.Tone.OK);
            }
        };
    }

    /**
     * A scripted run (ScriptActivity): opens the model, answers every question in turn (the second
     * and later from the saved document cache) and writes one JSON file to files/results/NAME
     * (its path goes to logcat: "edgekv result: PATH"). Errors go into the file too.
     */
    static AppState.Job script(final Context app, final ScriptRequest r) {
        return new AppState.Job() {
            @Override
            public void run(AppState state) throws Exception {
                Map<String, Object> result = new LinkedHashMap<String, Object>();
                result.put("artifact", r.artifact);
                List<Object> answers = new ArrayList<Object>();
                result.put("answers", answers);
                try {
                    String doc = r.documentText != null ? r.documentText : "";
                    if (r.documentFile != null) {
                        File f = new File(app.getExternalFilesDir(null), r.documentFile);
                        doc = Artifact.readUtf8(f, DocumentStore.MAX_BYTES);
                    }
                    documents(app).replace(doc); /* the screen shows what the script asked about */
                    state.setDocumentPreview(documents(app).preview(8, 600));
                    openNow(app, state, r.artifact);
                    result.put("compiled", compiledJson(state.engine.info()));
                    for (String q : r.questions) {
                        state.clearAnswer();
                        Engine.Answer a = state.engine.ask(doc, q, r.maxNewTokens, Engine.Sampling.GREEDY,
                                state.listener());
                        state.setMeasured(Panels.measured(a, state.engine.info(), Engine.Sampling.GREEDY));
                        answers.add(answerJson(a));
                    }
                    result.put("stats_after", statsJson(state.engine.stats()));
                    state.message("Scripted run done: files/results/" + r.result, AppState.Tone.OK);
                } catch (Exception e) {
                    result.put("error", AppState.describe(e));
                    throw e;
                } finally {
                    writeResult(app, r.result, result);
                }
            }
        };
    }

    /** files/results/NAME (a checked name), written atomically. */
    static void writeResult(Context app, String name, Map<String, Object> result) {
        File dir = new File(app.getExternalFilesDir(null), "results");
        File out = new File(dir, ScriptRequest.name("result", name, "a file under files/results"));
        try {
            if (!dir.isDirectory() && !dir.mkdirs()) throw new IOException("cannot create " + dir);
            File part = new File(out.getPath() + ".part");
            OutputStream o = new FileOutputStream(part);
            try {
                o.write(Json.write(result).getBytes("UTF-8"));
            } finally {
                o.close();
            }
            if (!part.renameTo(out)) throw new IOException("cannot rename " + part);
            Log.i(TAG, "edgekv result: " + out);
        } catch (IOException e) {
            Log.e(TAG, "cannot write the result " + out + ": " + e);
        }
    }

    static Map<String, Object> compiledJson(ModelInfo i) {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        m.put("model", i.modelId);
        m.put("policy", i.policy);
        m.put("budget", i.budget);
        m.put("block", i.block);
        m.put("target", i.targetProfile);
        m.put("target_arch", i.targetArch);
        m.put("device", i.device);
        m.put("chat", i.chat);
        m.put("plan_bytes", i.planBytes);
        m.put("weights_bytes", i.weightsBytes);
        m.put("cache_bytes", i.cacheBytes);
        m.put("arena_bytes", i.arenaBytes);
        m.put("runtime_devices", EdgeKv.runtimeDevices());
        m.put("android_sdk", Build.VERSION.SDK_INT);
        m.put("phone", Build.MANUFACTURER + " " + Build.MODEL);
        return m;
    }

    static Map<String, Object> answerJson(Engine.Answer a) {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        m.put("question", a.question);
        m.put("text", a.text);
        m.put("generated_ids", a.ids);
        m.put("from_snapshot", a.fromSnapshot);
        m.put("question_scoring", a.questionScoring);
        m.put("prompt_tokens", a.promptTokens());
        m.put("document_tokens", a.documentTokens);
        m.put("question_tokens", a.questionTokens);
        m.put("document_seconds", a.documentSeconds);
        m.put("snapshot_load_seconds", a.snapshotLoadSeconds);
        m.put("first_token_seconds", a.firstTokenSeconds);
        m.put("prefill_tok_s", a.stats.prefillTokensPerSecond());
        m.put("decode_tok_s", a.stats.decodeTokensPerSecond());
        m.put("stats", statsJson(a.stats));
        return m;
    }

    static Map<String, Object> statsJson(Stats s) {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        m.put("prefill_tokens", s.prefillTokens);
        m.put("prefill_blocks", s.prefillBlocks);
        m.put("decode_tokens", s.decodeTokens);
        m.put("prefill_seconds", s.prefillSeconds);
        m.put("decode_seconds", s.decodeSeconds);
        m.put("load_seconds", s.loadSeconds);
        m.put("peak_rss_bytes", s.peakRssBytes);
        m.put("runtime_bytes_peak", s.runtimeBytesPeak);
        m.put("mapped_bytes", s.mappedBytes);
        m.put("device_bytes_peak", s.deviceBytesPeak);
        m.put("position", s.position);
        return m;
    }

    /**
     * Kernel threads: at most 4. Phones mix fast and slow cores, and a parallel loop waits for its
     * slowest thread, so spreading over every core (the runtime's default) often runs slower.
     */
    static int threads() {
        return Math.max(1, Math.min(4, Runtime.getRuntime().availableProcessors()));
    }
}
