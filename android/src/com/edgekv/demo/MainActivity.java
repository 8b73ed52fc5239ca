package com.edgekv.demo;

import android.app.Activity;
import android.app.ActivityManager;
import android.content.Context;
import android.content.Intent;
import android.graphics.Typeface;
import android.net.Uri;
import android.os.Build;
import android.os.Bundle;
import android.util.Log;
import android.view.View;
import android.view.ViewGroup;
import android.widget.ArrayAdapter;
import android.widget.Button;
import android.widget.EditText;
import android.widget.LinearLayout;
import android.widget.ProgressBar;
import android.widget.ScrollView;
import android.widget.Spinner;
import android.widget.TextView;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;

/**
 * The demo: pick an artifact pushed with adb, paste or open a document, ask about it; the answer
 * streams in; panels show what the artifact was compiled with and what the run measured. The UI is
 * built in code (no layouts, no AndroidX). All model work runs on one worker thread; the UI thread
 * only posts work and shows results. Runtime errors are messages on the screen.
 *
 * Also an entry point for scripts (device_tests/test_android_device.py):
 * <pre>
 * adb shell am start -S -n com.edgekv.demo/.MainActivity --es artifact NAME --es document_file doc.txt \
 *     --esa questions "Q1,Q2" --ei max_new_tokens 16 --es result run.json
 * </pre>
 * runs the same steps and writes the answers and measurements as JSON to files/results/run.json.
 */
public final class MainActivity extends Activity {
    static final String TAG = "edgekv";
    private static final int REQUEST_OPEN_DOCUMENT = 1;
    private static final int MAX_DOCUMENT_BYTES = 8 << 20;
    private static final int COLOR_ERROR = 0xFFB00020, COLOR_NOTE = 0xFF555555, COLOR_OK = 0xFF1B5E20;

    /* one engine and one worker thread for the process: they outlive an Activity instance */
    private static final Engine ENGINE = new Engine();
    private static final ExecutorService WORKER = Executors.newSingleThreadExecutor();
    private static String librariesError; /* why the native libraries did not load, or null */
    private static Artifact openArtifact;

    static {
        try {
            EdgeKv.loadLibraries();
        } catch (Throwable t) { /* UnsatisfiedLinkError: shown on the screen, not a crash */
            librariesError = t.toString();
        }
    }

    private Spinner artifacts;
    private List<String> artifactNames = new ArrayList<String>();
    private EditText document, question, maxTokens;
    private TextView status, compiled, measured, message, answer, progressText;
    private ProgressBar progress;
    private Button openButton, askButton, cancelButton, fileButton;
    private ScrollView scroll;
    private volatile boolean busy;

    @Override
    protected void onCreate(Bundle savedInstanceState) {
        super.onCreate(savedInstanceState);
        setTitle("edgekv demo");
        buildUi();
        refreshArtifacts();
        if (librariesError != null) {
            showError("The native runtime did not load: " + librariesError);
            openButton.setEnabled(false);
            askButton.setEnabled(false);
        } else {
            status.setText(String.format(Locale.US, "runtime devices: %s · Android %s (API %d) · %s",
                    EdgeKv.runtimeDevices(), Build.VERSION.RELEASE, Build.VERSION.SDK_INT, Build.MODEL));
            if (ENGINE.isOpen() && openArtifact != null) showCompiled(openArtifact, ENGINE.info());
        }
        if (savedInstanceState == null) automate(getIntent());
    }

    @Override
    protected void onNewIntent(Intent intent) {
        super.onNewIntent(intent);
        setIntent(intent);
        automate(intent);
    }

    // ---- the screen ------------------------------------------------------------------------

    private void buildUi() {
        LinearLayout root = new LinearLayout(this);
        root.setOrientation(LinearLayout.VERTICAL);
        root.setPadding(24, 24, 24, 24);

        status = small(root, "");
        artifacts = new Spinner(this);
        openButton = button("Open", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                Object name = artifacts.getSelectedItem();
                if (name != null) openArtifact(name.toString(), null);
            }
        });
        Button refresh = button("Refresh", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                refreshArtifacts();
            }
        });
        row(root, weighted(artifacts), openButton, refresh);
        small(root, "Artifacts are directories pushed with adb to " + artifactsRoot()
                + "/NAME (android/README.md)");
        compiled = mono(root, "No artifact open.");

        label(root, "Document");
        fileButton = button("Open file…", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                Intent pick = new Intent(Intent.ACTION_OPEN_DOCUMENT);
                pick.addCategory(Intent.CATEGORY_OPENABLE);
                pick.setType("text/*");
                startActivityForResult(pick, REQUEST_OPEN_DOCUMENT);
            }
        });
        Button clear = button("Clear", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                document.setText("");
            }
        });
        row(root, fileButton, clear);
        document = new EditText(this);
        document.setHint("Paste a long document here, or open a text file");
        document.setMinLines(4);
        document.setMaxLines(12);
        root.addView(document, fill());

        label(root, "Question");
        question = new EditText(this);
        question.setHint("Ask about the document");
        question.setSingleLine(true);
        root.addView(question, fill());
        askButton = button("Ask", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                ask(null);
            }
        });
        cancelButton = button("Cancel", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                ENGINE.cancel();
                message("Cancelling…", COLOR_NOTE);
            }
        });
        cancelButton.setEnabled(false);
        maxTokens = new EditText(this);
        maxTokens.setText("128");
        maxTokens.setSingleLine(true);
        maxTokens.setInputType(2 /* InputType.TYPE_CLASS_NUMBER */);
        TextView maxLabel = new TextView(this);
        maxLabel.setText("max new tokens");
        row(root, askButton, cancelButton, maxLabel, maxTokens);

        progress = new ProgressBar(this, null, android.R.attr.progressBarStyleHorizontal);
        progress.setMax(1);
        progress.setProgress(0);
        root.addView(progress, fill());
        progressText = small(root, "");
        message = new TextView(this);
        root.addView(message, fill());
        answer = new TextView(this);
        answer.setTextIsSelectable(true);
        answer.setTextSize(16);
        root.addView(answer, fill());
        label(root, "Measured");
        measured = mono(root, "Nothing run yet.");

        scroll = new ScrollView(this);
        scroll.addView(root);
        setContentView(scroll);
    }

    private LinearLayout.LayoutParams fill() {
        return new LinearLayout.LayoutParams(ViewGroup.LayoutParams.MATCH_PARENT, ViewGroup.LayoutParams.WRAP_CONTENT,
                0);
    }

    private View weighted(View v) {
        v.setLayoutParams(new LinearLayout.LayoutParams(0, ViewGroup.LayoutParams.WRAP_CONTENT, 1));
        return v;
    }

    private void row(LinearLayout parent, View... views) {
        LinearLayout r = new LinearLayout(this);
        r.setOrientation(LinearLayout.HORIZONTAL);
        for (View v : views) r.addView(v);
        parent.addView(r, fill());
    }

    private Button button(String text, View.OnClickListener l) {
        Button b = new Button(this);
        b.setText(text);
        b.setOnClickListener(l);
        return b;
    }

    private TextView label(LinearLayout parent, String text) {
        TextView t = new TextView(this);
        t.setText(text);
        t.setTypeface(Typeface.DEFAULT_BOLD);
        t.setPadding(0, 24, 0, 4);
        parent.addView(t, fill());
        return t;
    }

    private TextView small(LinearLayout parent, String text) {
        TextView t = new TextView(this);
        t.setText(text);
        t.setTextSize(12);
        t.setTextColor(COLOR_NOTE);
        parent.addView(t, fill());
        return t;
    }

    private TextView mono(LinearLayout parent, String text) {
        TextView t = new TextView(this);
        t.setText(text);
        t.setTypeface(Typeface.MONOSPACE);
        t.setTextSize(12);
        t.setTextIsSelectable(true);
        parent.addView(t, fill());
        return t;
    }

    private void setBusy(final boolean on) {
        busy = on;
        openButton.setEnabled(!on && librariesError == null);
        askButton.setEnabled(!on && librariesError == null);
        fileButton.setEnabled(!on);
        cancelButton.setEnabled(on);
    }

    private void message(final String text, final int color) {
        message.setTextColor(color);
        message.setText(text);
    }

    private void showError(String text) {
        Log.e(TAG, text);
        message(text, COLOR_ERROR);
    }

    /** Posts to the UI thread. */
    private void ui(Runnable r) {
        runOnUiThread(r);
    }

    private File artifactsRoot() {
        File ext = getExternalFilesDir(null);
        return new File(ext != null ? ext : getNoBackupFilesDir(), "artifacts");
    }

    private void refreshArtifacts() {
        File root = artifactsRoot();
        if (!root.isDirectory()) root.mkdirs();
        File[] dirs = root.listFiles();
        artifactNames = new ArrayList<String>();
        if (dirs != null) {
            for (File d : dirs) if (d.isDirectory()) artifactNames.add(d.getName());
        }
        java.util.Collections.sort(artifactNames);
        ArrayAdapter<String> adapter = new ArrayAdapter<String>(this, android.R.layout.simple_spinner_item,
                artifactNames);
        adapter.setDropDownViewResource(android.R.layout.simple_spinner_dropdown_item);
        artifacts.setAdapter(adapter);
        if (artifactNames.isEmpty()) {
            message("No artifact yet: push one to " + root + " (android/README.md)", COLOR_NOTE);
        } else if (openArtifact != null && artifactNames.contains(openArtifact.dir.getName())) {
            artifacts.setSelection(artifactNames.indexOf(openArtifact.dir.getName()));
        }
    }

    // ---- opening an artifact ---------------------------------------------------------------

    /** Opens artifacts/NAME on the worker; then runs `then` there (scripts), if any. */
    private void openArtifact(final String name, final Runnable then) {
        setBusy(true);
        message("Opening " + name + "…", COLOR_NOTE);
        WORKER.execute(new Runnable() {
            @Override
            public void run() {
                String error = null;
                try {
                    error = openOnWorker(name);
                } catch (Throwable t) {
                    error = "Cannot open " + name + ": " + describe(t);
                }
                final String shown = error;
                ui(new Runnable() {
                    @Override
                    public void run() {
                        setBusy(false);
                        if (shown != null) showError(shown);
                        else message("Opened " + name + " on " + ENGINE.info().device + ".", COLOR_OK);
                        if (ENGINE.isOpen() && openArtifact != null) showCompiled(openArtifact, ENGINE.info());
                        else compiled.setText("No artifact open.");
                    }
                });
                if (then != null) then.run();
            }
        });
    }

    /** Null when opened, else the message to show. Worker thread. */
    private String openOnWorker(String name) throws IOException, EdgeKvException {
        File source = new File(artifactsRoot(), name);
        ENGINE.close();
        openArtifact = null;
        Artifact a = Artifact.read(source);
        ActivityManager am = (ActivityManager) getSystemService(Context.ACTIVITY_SERVICE);
        ActivityManager.MemoryInfo mem = new ActivityManager.MemoryInfo();
        am.getMemoryInfo(mem);
        String refusal = a.memoryRefusal(mem.availMem, mem.threshold);
        if (refusal != null) return refusal;
        File staged = Staging.stage(source, new File(getNoBackupFilesDir(), "staged"));
        long limit = mem.availMem - mem.threshold;
        ENGINE.open(staged, threads(), limit > 0 ? limit : 0, new File(getCacheDir(), "snapshots"));
        openArtifact = a;
        Log.i(TAG, "opened " + source + " (staged at " + staged + ") on " + ENGINE.info().device);
        return null;
    }

    private void showCompiled(Artifact a, ModelInfo i) {
        StringBuilder b = new StringBuilder();
        b.append(String.format(Locale.US, "model    %s (%d layers, vocab %d, context %d)%n", i.modelId, i.numLayers,
                i.vocabSize, i.maxPosition));
        b.append(String.format(Locale.US, "policy   %s %s%n", i.policy, i.policyParams != null && i.policyParams.length() > 2 ? i.policyParams : ""));
        b.append(String.format(Locale.US, "budget   N = %d cache entries per layer and KV head%n", i.budget));
        b.append(String.format(Locale.US, "block    B = %d prompt tokens per step%n", i.block));
        b.append(i.questionRows > 0
                ? String.format(Locale.US, "question scores the document's blocks (up to %d tokens)%n", i.questionRows)
                : "question read after the document (compiled without --question-rows)\n");
        b.append(String.format(Locale.US, "weights  %s, %s%n", a.dtype, Artifact.mib(i.weightsBytes)));
        b.append(String.format(Locale.US, "target   %s (%s) on %s%n", i.targetProfile, i.targetArch, i.device));
        b.append(String.format(Locale.US, "plan     %s = weights %s + KV cache %s + activations %s%n",
                Artifact.mib(i.planBytes), Artifact.mib(i.weightsBytes), Artifact.mib(i.cacheBytes),
                Artifact.mib(i.arenaBytes)));
        b.append(String.format(Locale.US, "chat     %s · edgekv %s · %d kernels", i.chat ? "template" : "none",
                i.edgekvVersion, i.kernels));
        compiled.setText(b.toString());
    }

    // ---- asking ----------------------------------------------------------------------------

    /** Runs the question in the fields on the worker; `done` (scripts) gets the answer or the error. */
    private void ask(final Done done) {
        if (!ENGINE.isOpen()) {
            showError("Open an artifact first.");
            if (done != null) done.finished(null, new EdgeKvException(EdgeKvException.INVALID_ARG, "no artifact open"));
            return;
        }
        final String doc = document.getText().toString();
        final String q = question.getText().toString();
        final int maxNew = parseInt(maxTokens.getText().toString(), 128);
        setBusy(true);
        answer.setText("");
        progress.setProgress(0);
        progressText.setText("");
        message("Working…", COLOR_NOTE);
        WORKER.execute(new Runnable() {
            @Override
            public void run() {
                Engine.Answer a = null;
                Throwable error = null;
                try {
                    a = ENGINE.ask(doc, q, maxNew, 0f, listener());
                } catch (Throwable t) {
                    error = t;
                }
                final Engine.Answer result = a;
                final Throwable failure = error;
                ui(new Runnable() {
                    @Override
                    public void run() {
                        setBusy(false);
                        if (result != null) {
                            message(result.fromSnapshot ? "Answered from the saved document cache." : "Answered.", COLOR_OK);
                            showMeasured(result);
                        } else if (failure instanceof EdgeKvException && ((EdgeKvException) failure).cancelled()) {
                            message("Cancelled: " + failure.getMessage(), COLOR_NOTE);
                        } else {
                            showError(describe(failure));
                        }
                    }
                });
                if (done != null) done.finished(result, failure);
            }
        });
    }

    private Engine.Listener listener() {
        return new Engine.Listener() {
            @Override
            public void onPhase(final String phase) {
                ui(new Runnable() {
                    @Override
                    public void run() {
                        message(capitalized(phase) + "…", COLOR_NOTE);
                    }
                });
            }

            @Override
            public void onProgress(final String what, final long done, final long total, final long blocksDone,
                                   final long blocksTotal) {
                ui(new Runnable() {
                    @Override
                    public void run() {
                        progress.setMax((int) Math.max(1, blocksTotal));
                        progress.setProgress((int) blocksDone);
                        progressText.setText(String.format(Locale.US, "%s: block %d / %d (%d / %d tokens)", what,
                                blocksDone, blocksTotal, done, total));
                    }
                });
            }

            @Override
            public void onText(final String text) {
                ui(new Runnable() {
                    @Override
                    public void run() {
                        answer.append(text);
                    }
                });
            }
        };
    }

    private void showMeasured(Engine.Answer a) {
        ModelInfo i = ENGINE.info();
        Stats s = a.stats;
        StringBuilder b = new StringBuilder();
        b.append(String.format(Locale.US, "prompt       %d tokens = document %d (%s%s) + question %d%n", a.promptTokens(),
                a.documentTokens, a.fromSnapshot ? "from the saved cache" : "read now",
                a.questionScoring ? ", scored by the question" : "", a.questionTokens));
        b.append(String.format(Locale.US, "prefill      %.1f tok/s (%d tokens, %d blocks, %.2f s)%n",
                s.prefillTokensPerSecond(), s.prefillTokens, s.prefillBlocks, s.prefillSeconds));
        if (a.fromSnapshot) {
            b.append(String.format(Locale.US, "document     %.2f s to read once; cache mapped back in %.3f s%n",
                    a.documentSeconds, a.snapshotLoadSeconds));
        }
        b.append(String.format(Locale.US, "decode       %.1f tok/s (%d tokens)%n", s.decodeTokensPerSecond(),
                s.decodeTokens));
        b.append(String.format(Locale.US, "first token  %.2f s after Ask; %.2f s in all%n", a.firstTokenSeconds,
                a.totalSeconds));
        b.append(String.format(Locale.US, "KV cache     %s, fixed (N = %d; %d positions seen)%n",
                Artifact.mib(i.cacheBytes), i.budget, s.position));
        b.append(String.format(Locale.US, "peak memory  %s RSS vs plan %s (%.2fx)%n", Artifact.mib(s.peakRssBytes),
                Artifact.mib(i.planBytes), i.planBytes > 0 ? (double) s.peakRssBytes / i.planBytes : 0.0));
        b.append(String.format(Locale.US, "             runtime %s · weights mapped %s%s", Artifact.mib(s.runtimeBytesPeak),
                Artifact.mib(s.mappedBytes),
                s.deviceBytesPeak > 0 ? " · GPU buffers " + Artifact.mib(s.deviceBytesPeak) : ""));
        measured.setText(b.toString());
    }

    // ---- documents -------------------------------------------------------------------------

    @Override
    protected void onActivityResult(int requestCode, int resultCode, Intent data) {
        super.onActivityResult(requestCode, resultCode, data);
        if (requestCode != REQUEST_OPEN_DOCUMENT || resultCode != RESULT_OK || data == null || data.getData() == null) {
            return;
        }
        final Uri uri = data.getData();
        message("Reading the file…", COLOR_NOTE);
        WORKER.execute(new Runnable() {
            @Override
            public void run() {
                String text = null, error = null;
                try {
                    InputStream in = getContentResolver().openInputStream(uri);
                    if (in == null) throw new IOException("the file could not be opened");
                    try {
                        text = Artifact.readUtf8(in, MAX_DOCUMENT_BYTES);
                    } finally {
                        in.close();
                    }
                } catch (Throwable t) {
                    error = "Cannot read " + uri.getLastPathSegment() + ": " + describe(t);
                }
                final String got = text, failed = error;
                ui(new Runnable() {
                    @Override
                    public void run() {
                        if (failed != null) {
                            showError(failed);
                        } else {
                            document.setText(got);
                            message(String.format(Locale.US, "Document: %d characters.", got.length()), COLOR_OK);
                        }
                    }
                });
            }
        });
    }

    // ---- scripted runs (intent extras) -----------------------------------------------------

    interface Done {
        void finished(Engine.Answer answer, Throwable error);
    }

    /**
     * Extras: artifact (a directory name under files/artifacts), document (text) or document_file
     * (under files/), question or questions (string array), max_new_tokens, result (a file name
     * under files/results; default last-run.json). Answers every question in turn (the second and
     * later ones from the saved document cache) and writes one JSON file.
     */
    private void automate(Intent intent) {
        if (intent == null || !intent.hasExtra("artifact")) return;
        final String name = intent.getStringExtra("artifact");
        final String resultName = intent.hasExtra("result") ? intent.getStringExtra("result") : "last-run.json";
        final Map<String, Object> result = new LinkedHashMap<String, Object>();
        result.put("artifact", name);
        final List<Object> answers = new ArrayList<Object>();
        result.put("answers", answers);
        final List<String> questions = new ArrayList<String>();
        String[] many = intent.getStringArrayExtra("questions"); /* null when passed as a plain string */
        if (many != null) questions.addAll(Arrays.asList(many));
        else if (intent.getStringExtra("questions") != null) questions.add(intent.getStringExtra("questions"));
        if (intent.getStringExtra("question") != null) questions.add(intent.getStringExtra("question"));
        String doc = intent.getStringExtra("document");
        try {
            if (intent.hasExtra("document_file")) {
                File f = new File(intent.getStringExtra("document_file"));
                if (!f.isAbsolute()) f = new File(getExternalFilesDir(null), f.getPath());
                doc = Artifact.readUtf8(f, MAX_DOCUMENT_BYTES);
            }
        } catch (IOException e) {
            result.put("error", "cannot read the document: " + e.getMessage());
            writeResult(resultName, result);
            return;
        }
        document.setText(doc != null ? doc : "");
        if (intent.hasExtra("max_new_tokens")) maxTokens.setText(Integer.toString(intent.getIntExtra("max_new_tokens", 128)));
        Log.i(TAG, "scripted run: artifact " + name + ", " + questions.size() + " question(s)");
        openArtifact(name, new Runnable() {
            @Override
            public void run() { /* worker thread, after the open */
                if (!ENGINE.isOpen()) {
                    result.put("error", "could not open " + name + ": see the screen or logcat");
                    writeResult(resultName, result);
                    return;
                }
                result.put("compiled", compiledJson(openArtifact, ENGINE.info()));
                ui(new Runnable() {
                    @Override
                    public void run() {
                        askNext(questions, 0, answers, result, resultName);
                    }
                });
            }
        });
    }

    private void askNext(final List<String> questions, final int k, final List<Object> answers,
                         final Map<String, Object> result, final String resultName) {
        if (k >= questions.size()) {
            result.put("stats_after", statsJson(ENGINE.stats()));
            writeResult(resultName, result);
            return;
        }
        question.setText(questions.get(k));
        ask(new Done() {
            @Override
            public void finished(Engine.Answer a, Throwable error) { /* worker thread */
                if (a == null) {
                    result.put("error", describe(error));
                    writeResult(resultName, result);
                    return;
                }
                answers.add(answerJson(a));
                ui(new Runnable() {
                    @Override
                    public void run() {
                        askNext(questions, k + 1, answers, result, resultName);
                    }
                });
            }
        });
    }

    private static Map<String, Object> compiledJson(Artifact a, ModelInfo i) {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        m.put("model", i.modelId);
        m.put("policy", i.policy);
        m.put("budget", i.budget);
        m.put("block", i.block);
        m.put("dtype", a.dtype);
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

    /** files/results/NAME, written atomically; its path goes to logcat ("edgekv result: PATH"). */
    private void writeResult(String name, Map<String, Object> result) {
        File dir = new File(getExternalFilesDir(null), "results");
        File out = new File(dir, new File(name).getName());
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

    // ---- small helpers ---------------------------------------------------------------------

    static String describe(Throwable t) {
        if (t instanceof EdgeKvException) {
            EdgeKvException e = (EdgeKvException) t;
            return "Runtime error (" + EdgeKv.statusName(e.status) + "): " + e.getMessage();
        }
        if (t instanceof OutOfMemoryError) return "Out of memory: " + t.getMessage();
        return t == null ? "unknown error" : t.toString();
    }

    /**
     * Kernel threads: at most 4. Phones mix fast and slow cores, and a parallel loop waits for its
     * slowest thread, so spreading over every core (the runtime's default) often runs slower.
     */
    static int threads() {
        return Math.max(1, Math.min(4, Runtime.getRuntime().availableProcessors()));
    }

    static int parseInt(String s, int otherwise) {
        try {
            int v = Integer.parseInt(s.trim());
            return v > 0 ? v : otherwise;
        } catch (NumberFormatException e) {
            return otherwise;
        }
    }

    static String capitalized(String s) {
        return s.isEmpty() ? s : Character.toUpperCase(s.charAt(0)) + s.substring(1);
    }
}
