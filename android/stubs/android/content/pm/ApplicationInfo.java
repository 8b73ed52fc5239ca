package android.content.pm;

public class ApplicationInfo {
    public String nativeLibraryDir;
    public ApplicationInfo() { throw new RuntimeException("Stub!"); }
}
