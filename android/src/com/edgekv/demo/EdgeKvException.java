package com.edgekv.demo;

/** A runtime call failed: {@link #status} is the ekv_status code, the message the runtime's. */
public final class EdgeKvException extends Exception {
    private static final long serialVersionUID = 1L;

    public static final int IO = 1;
    public static final int FORMAT = 2;
    public static final int MISMATCH = 3;
    public static final int INVALID_ARG = 4;
    public static final int NO_MEMORY = 5;
    public static final int KERNEL = 6;
    public static final int CANCELLED = 7;
    public static final int CAPACITY = 8;
    public static final int DEVICE = 9;

    public final int status;

    public EdgeKvException(int status, String message) {
        super(message);
        this.status = status;
    }

    public boolean cancelled() {
        return status == CANCELLED;
    }
}
