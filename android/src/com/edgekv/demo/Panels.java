package com.edgekv.demo;

import java.util.Locale;

/** The text of the screen's panels: what a model was compiled with, and what a run measured. Pure Java. */
final class Panels {
    private Panels() {
    }

    static String compiled(Artifact a, ModelInfo i) {
        StringBuilder b = new StringBuilder();
        b.append(String.format(Locale.US, "model    %s (%d layers, vocab %d, context %d)%n", i.modelId, i.numLayers,
                i.vocabSize, i.maxPosition));
        b.append(String.format(Locale.US, "policy   %s %s%n", i.policy,
                i.policyParams != null && i.policyParams.length() > 2 ? i.policyParams : ""));
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
        return b.toString();
    }

    static String measured(Engine.Answer a, ModelInfo i, Engine.Sampling sampling) {
        Stats s = a.stats;
        StringBuilder b = new StringBuilder();
        b.append(String.format(Locale.US, "prompt       %d tokens = document %d (%s%s) + question %d%n",
                a.promptTokens(), a.documentTokens, a.fromSnapshot ? "from the saved cache" : "read now",
                a.questionScoring ? ", scored by the question" : "", a.questionTokens));
        b.append(String.format(Locale.US, "prefill      %.1f tok/s (%d tokens, %d blocks, %.2f s)%n",
                s.prefillTokensPerSecond(), s.prefillTokens, s.prefillBlocks, s.prefillSeconds));
        if (a.fromSnapshot) {
            b.append(String.format(Locale.US, "document     %.2f s to read once; cache mapped back in %.3f s%n",
                    a.documentSeconds, a.snapshotLoadSeconds));
        }
        b.append(String.format(Locale.US, "decode       %.1f tok/s (%d tokens; %s)%n", s.decodeTokensPerSecond(),
                s.decodeTokens, sampling.describe()));
        b.append(String.format(Locale.US, "first token  %.2f s after Ask; %.2f s in all%n", a.firstTokenSeconds,
                a.totalSeconds));
        b.append(String.format(Locale.US, "KV cache     %s, fixed (N = %d; %d positions seen)%n",
                Artifact.mib(i.cacheBytes), i.budget, s.position));
        b.append(String.format(Locale.US, "peak memory  %s RSS vs plan %s (%.2fx)%n", Artifact.mib(s.peakRssBytes),
                Artifact.mib(i.planBytes), i.planBytes > 0 ? (double) s.peakRssBytes / i.planBytes : 0.0));
        b.append(String.format(Locale.US, "             runtime %s · weights mapped %s%s",
                Artifact.mib(s.runtimeBytesPeak), Artifact.mib(s.mappedBytes),
                s.deviceBytesPeak > 0 ? " · GPU buffers " + Artifact.mib(s.deviceBytesPeak) : ""));
        return b.toString();
    }
}
