package android.system;

public final class Os {
    private Os() { throw new RuntimeException("Stub!"); }
    public static void symlink(String oldPath, String newPath) throws ErrnoException { throw new RuntimeException("Stub!"); }
}
