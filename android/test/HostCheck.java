import com.edgekv.demo.Artifact;
import com.edgekv.demo.EdgeKv;
import com.edgekv.demo.EdgeKvException;
import com.edgekv.demo.Engine;
import com.edgekv.demo.Json;
import com.edgekv.demo.ModelInfo;

import java.io.File;
import java.io.FileInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Drives the app's Engine and the JNI bridge on a desktop JVM, against a host artifact, the way
 * MainActivity does on the phone (tests/test_android_app.py runs it and checks what it prints):
 *
 *   java HostCheck ARTIFACT DOCUMENT_FILE SNAPSHOT_DIR MAX_NEW PROBE_FILE QUESTION...
 *
 * Prints one JSON object: the answers (the first reads the document, the later ones come from its
 * saved cache), the ids of the text in PROBE_FILE as the bridge encodes it, a cancelled run, and the errors of
 * a missing artifact, of a memory limit below the plan, and of a bad prompt.
 */
public final class HostCheck {
    public static void main(String[] args) throws Exception {
        File artifact = new File(args[0]);
        String document = read(new File(args[1]));
        File snapshots = new File(args[2]);
        int maxNew = Integer.parseInt(args[3]);
        String probe = read(new File(args[4]));
        Map<String, Object> out = new LinkedHashMap<String, Object>();
        EdgeKv.loadLibraries();
        out.put("runtime_devices", EdgeKv.runtimeDevices());

        Artifact facts = Artifact.read(artifact);
        out.put("describe", facts.describe());
        out.put("manifest_plan_bytes", facts.planBytes);
        out.put("refusal_small", facts.memoryRefusal(facts.planBytes / 2, 0));
        out.put("refusal_large", facts.memoryRefusal(facts.planBytes * 4, facts.planBytes));

        Engine engine = new Engine();
        engine.open(artifact, 2, 0, snapshots);
        ModelInfo info = engine.info();
        Map<String, Object> i = new LinkedHashMap<String, Object>();
        i.put("model", info.modelId);
        i.put("policy", info.policy);
        i.put("budget", info.budget);
        i.put("block", info.block);
        i.put("target", info.targetProfile);
        i.put("device", info.device);
        i.put("chat", info.chat);
        i.put("plan_bytes", info.planBytes);
        i.put("cache_bytes", info.cacheBytes);
        i.put("vocab_size", info.vocabSize);
        i.put("question_rows", info.questionRows);
        out.put("info", i);

        final List<Object> events = new ArrayList<Object>();
        List<Object> answers = new ArrayList<Object>();
        for (int k = 5; k < args.length; k++) {
            final StringBuilder streamed = new StringBuilder();
            final List<Object> progress = new ArrayList<Object>();
            Engine.Answer a = engine.ask(document, args[k], maxNew, 0f, new Engine.Listener() {
                @Override
                public void onPhase(String phase) {
                    events.add(phase);
                }

                @Override
                public void onProgress(String what, long done, long total, long blocksDone, long blocksTotal) {
                    progress.add(what + " " + done + "/" + total + " " + blocksDone + "/" + blocksTotal);
                }

                @Override
                public void onText(String text) {
                    streamed.append(text);
                }
            });
            Map<String, Object> m = new LinkedHashMap<String, Object>();
            m.put("question", a.question);
            m.put("generated_ids", a.ids);
            m.put("text", a.text);
            m.put("streamed", streamed.toString());
            m.put("from_snapshot", a.fromSnapshot);
            m.put("question_scoring", a.questionScoring);
            m.put("document_tokens", a.documentTokens);
            m.put("question_tokens", a.questionTokens);
            m.put("prefill_tokens", a.stats.prefillTokens);
            m.put("prefill_blocks", a.stats.prefillBlocks);
            m.put("decode_tokens", a.stats.decodeTokens);
            m.put("position", a.stats.position);
            m.put("peak_rss_bytes", a.stats.peakRssBytes);
            m.put("progress", progress);
            answers.add(m);
        }
        out.put("answers", answers);
        out.put("phases", events);

        /* the bridge's text path in: UTF-16 -> UTF-8 (surrogate pairs, NUL) */
        out.put("probe_ids", engine.encode(probe, false, EdgeKv.PART_WHOLE));

        /* cancel from the progress callback, as the Cancel button does from the UI thread */
        final Engine e2 = engine;
        try {
            engine.ask(document + " (another document)", "why?", maxNew, 0f, new Engine.Listener() {
                @Override
                public void onPhase(String phase) {
                }

                @Override
                public void onProgress(String what, long done, long total, long blocksDone, long blocksTotal) {
                    e2.cancel();
                }

                @Override
                public void onText(String text) {
                }
            });
            out.put("cancelled", "not cancelled");
        } catch (EdgeKvException ex) {
            out.put("cancelled", ex.status + " " + ex.getMessage());
        }
        /* the engine still answers after a cancel */
        Engine.Answer again = engine.ask(document, args[5], maxNew, 0f, quiet());
        out.put("after_cancel_ids", again.ids);
        out.put("after_cancel_from_snapshot", again.fromSnapshot);
        engine.close();

        out.put("error_missing", error(new File(artifact, "no-such-dir"), 0));
        out.put("error_memory", error(artifact, 1024));
        Engine e3 = new Engine();
        e3.open(artifact, 1, 0, snapshots);
        try {
            e3.ask("", "", maxNew, 0f, quiet());
            out.put("error_empty", "accepted");
        } catch (EdgeKvException ex) {
            out.put("error_empty", ex.status + " " + ex.getMessage());
        }
        if (e3.info().questionRows > 0) { /* a question past the artifact's rows: refused with the fix */
            StringBuilder longQuestion = new StringBuilder();
            while (longQuestion.length() <= e3.info().questionRows) longQuestion.append("why? ");
            try {
                e3.ask(document, longQuestion.toString(), maxNew, 0f, quiet());
                out.put("error_long_question", "accepted");
            } catch (EdgeKvException ex) {
                out.put("error_long_question", ex.status + " " + ex.getMessage());
            }
        }
        e3.close();
        System.out.println(Json.write(out));
    }

    private static String error(File dir, long limit) {
        Engine e = new Engine();
        try {
            e.open(dir, 1, limit, new File(System.getProperty("java.io.tmpdir")));
            e.close();
            return "opened";
        } catch (EdgeKvException ex) {
            return ex.status + " " + ex.getMessage();
        }
    }

    private static Engine.Listener quiet() {
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

    private static String read(File f) throws IOException {
        FileInputStream in = new FileInputStream(f);
        try {
            ByteArrayOutputStream b = new ByteArrayOutputStream();
            byte[] buf = new byte[65536];
            for (int n; (n = in.read(buf)) > 0;) b.write(buf, 0, n);
            return new String(b.toByteArray(), "UTF-8");
        } finally {
            in.close();
        }
    }
}
