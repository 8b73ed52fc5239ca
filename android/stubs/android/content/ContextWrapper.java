package android.content;

import java.io.File;

public class ContextWrapper extends Context {
    public ContextWrapper(Context base) { throw new RuntimeException("Stub!"); }
    public Object getSystemService(String name) { throw new RuntimeException("Stub!"); }
    public File getExternalFilesDir(String type) { throw new RuntimeException("Stub!"); }
    public File getNoBackupFilesDir() { throw new RuntimeException("Stub!"); }
    public File getCacheDir() { throw new RuntimeException("Stub!"); }
    public ContentResolver getContentResolver() { throw new RuntimeException("Stub!"); }
    public android.content.pm.ApplicationInfo getApplicationInfo() { throw new RuntimeException("Stub!"); }
}
