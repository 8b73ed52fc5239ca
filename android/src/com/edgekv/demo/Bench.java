package com.edgekv.demo;

import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Random;

/**
 * The benchmark screen's measurement, as llama-bench's pp/tg tests: "pp" prefills P prompt tokens
 * into an empty cache (block by block, B at a time), "tg" decodes T tokens one at a time after a
 * one-token prompt; each is repeated R times and reported as mean ± standard deviation of tokens
 * per second, from the runtime's own timers (ekv_stats). The tokens are random ids of the model's
 * vocabulary with a fixed seed, so two runs read the same text; tg takes each next token by argmax
 * and never stops early. Peak RSS comes with each result, next to the plan. Pure Java (the
 * Activity runs it on the worker; tests/test_android_ui.py runs it on a desktop JVM).
 */
public final class Bench {
    /** After each step: which test, tokens done, tokens in all, repetition (1-based). */
    public interface Listener {
        void onStep(String test, long done, long total, int rep);
    }

    /** One test's figures. */
    public static final class Result {
        public final String test;     /* "pp512" or "tg128" */
        public final int tokens, reps;
        public final double meanTokS, sdTokS;
        public final long peakRssBytes, planBytes;

        Result(String test, int tokens, double[] tokS, long peakRss, long plan) {
            this.test = test;
            this.tokens = tokens;
            this.reps = tokS.length;
            double sum = 0;
            for (double v : tokS) sum += v;
            meanTokS = sum / tokS.length;
            double sq = 0;
            for (double v : tokS) sq += (v - meanTokS) * (v - meanTokS);
            sdTokS = tokS.length > 1 ? Math.sqrt(sq / (tokS.length - 1)) : 0;
            peakRssBytes = peakRss;
            planBytes = plan;
        }

        /** "pp512   123.45 ± 1.20 tok/s   peak RSS 540.1 MiB / plan 565.0 MiB" */
        public String row() {
            return String.format(Locale.US, "%-7s %9.2f ± %-7.2f tok/s  peak RSS %s / plan %s", test, meanTokS, sdTokS,
                    Artifact.mib(peakRssBytes), Artifact.mib(planBytes));
        }
    }

    private Bench() {
    }

    /**
     * Runs pp (promptTokens &gt; 0) then tg (genTokens &gt; 0), each `reps` times, on the open model.
     * Refused before anything runs when the lengths do not fit the model's context. Cancel (Engine.cancel)
     * stops it with EdgeKvException CANCELLED. The session is reset: the next question reads its
     * document again or maps its saved cache back.
     */
    public static List<Result> run(Engine engine, int promptTokens, int genTokens, int reps, Listener listener)
            throws EdgeKvException {
        if (!engine.isOpen()) throw new EdgeKvException(EdgeKvException.INVALID_ARG, "open a model first");
        ModelInfo info = engine.info();
        if (promptTokens < 0 || genTokens < 0 || promptTokens + genTokens == 0 || reps < 1) {
            throw new EdgeKvException(EdgeKvException.INVALID_ARG,
                    "choose a prompt length (pp) or a generation length (tg) above 0, and at least one repetition");
        }
        int most = Math.max(promptTokens, genTokens + 1);
        if (info.maxPosition > 0 && most > info.maxPosition) {
            throw new EdgeKvException(EdgeKvException.INVALID_ARG, String.format(Locale.US,
                    "%d tokens exceed %s's context of %d: choose shorter lengths", most, info.modelId, info.maxPosition));
        }
        long session = engine.sessionHandle(), model = engine.modelHandle();
        Random random = new Random(1234);
        List<Result> out = new ArrayList<Result>();
        engine.clearCancel();
        if (promptTokens > 0) {
            double[] tokS = new double[reps];
            int[] ids = new int[promptTokens];
            for (int i = 0; i < ids.length; i++) ids[i] = random.nextInt(Math.max(1, info.vocabSize));
            for (int r = 0; r < reps; r++) {
                final int rep = r + 1;
                final Listener l = listener;
                final Engine e = engine;
                EdgeKv.sessionReset(session);
                EdgeKv.prefill(session, ids, new EdgeKv.Progress() {
                    @Override
                    public boolean onBlock(long done, long total) {
                        l.onStep("pp", done, total, rep);
                        return e.cancelRequested();
                    }
                });
                Stats s = engine.stats();
                tokS[r] = s.prefillTokensPerSecond();
            }
            out.add(new Result("pp" + promptTokens, promptTokens, tokS, engine.stats().peakRssBytes, info.planBytes));
        }
        if (genTokens > 0) {
            double[] tokS = new double[reps];
            for (int r = 0; r < reps; r++) {
                EdgeKv.sessionReset(session);
                EdgeKv.prefill(session, new int[]{random.nextInt(Math.max(1, info.vocabSize))}, null);
                for (int t = 0; t < genTokens; t++) {
                    if (engine.cancelRequested()) {
                        throw new EdgeKvException(EdgeKvException.CANCELLED, "benchmark cancelled");
                    }
                    EdgeKv.decode(session, EdgeKv.greedy(session, model));
                    listener.onStep("tg", t + 1, genTokens, r + 1);
                }
                tokS[r] = engine.stats().decodeTokensPerSecond();
            }
            out.add(new Result("tg" + genTokens, genTokens, tokS, engine.stats().peakRssBytes, info.planBytes));
        }
        EdgeKv.sessionReset(session);
        return out;
    }
}
