package com.edgekv.demo;

/** ekv_model_info, filled by {@link EdgeKv#modelInfo} (field names are read by the bridge). */
public final class ModelInfo {
    public String modelId, policy, policyParams, targetProfile, targetArch, edgekvVersion, weightHash, device;
    public int numLayers, vocabSize, maxPosition, budget, block, pseudoRows, questionRows, threads, kernels;
    public boolean chat;
    public long weightsBytes, cacheBytes, arenaBytes, planBytes;
}
