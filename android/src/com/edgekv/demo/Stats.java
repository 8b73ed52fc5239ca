package com.edgekv.demo;

/** ekv_stats plus the position, filled by {@link EdgeKv#stats} (field names are read by the bridge). */
public final class Stats {
    public long prefillTokens, prefillBlocks, decodeTokens;
    public double prefillSeconds, decodeSeconds, prepareSeconds, loadSeconds, firstBlockSeconds;
    public long runtimeBytesPeak, workspaceBytesPeak, peakRssBytes, mappedBytes, deviceBytesPeak;
    public long position;

    public double prefillTokensPerSecond() {
        return prefillSeconds > 0 ? prefillTokens / prefillSeconds : 0;
    }

    public double decodeTokensPerSecond() {
        return decodeSeconds > 0 ? decodeTokens / decodeSeconds : 0;
    }
}
