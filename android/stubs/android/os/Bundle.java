package android.os;

public final class Bundle {
    public Bundle() { throw new RuntimeException("Stub!"); }
    public void putString(String key, String value) { throw new RuntimeException("Stub!"); }
    public String getString(String key) { throw new RuntimeException("Stub!"); }
}
