package android.os;

public final class Looper {
    Looper() { throw new RuntimeException("Stub!"); }
    public static Looper getMainLooper() { throw new RuntimeException("Stub!"); }
}
