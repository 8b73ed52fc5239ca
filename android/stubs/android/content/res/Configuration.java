package android.content.res;

public final class Configuration {
    public static final int UI_MODE_NIGHT_MASK = 48;
    public static final int UI_MODE_NIGHT_YES = 32;
    public int uiMode;
    public Configuration() { throw new RuntimeException("Stub!"); }
}
