package android.system;

public final class ErrnoException extends Exception {
    public ErrnoException(String functionName, int errno) { throw new RuntimeException("Stub!"); }
}
