package com.edgekv.demo;

/** ekv_snapshot_info: what a loaded document cache records. */
public final class SnapshotInfo {
    public String question, madeFrom;
    public boolean chat;
    public long tokens;
    public double documentSeconds;
}
