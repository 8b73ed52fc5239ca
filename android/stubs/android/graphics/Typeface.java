package android.graphics;

public class Typeface {
    public static final Typeface MONOSPACE = null;
    public static final Typeface DEFAULT_BOLD = null;
    Typeface() { throw new RuntimeException("Stub!"); }
}
