package android.content;

import android.content.pm.ApplicationInfo;
import android.content.res.Resources;
import java.io.File;

public class ContextWrapper extends Context {
    public ContextWrapper(Context base) { throw new RuntimeException("Stub!"); }
    public Object getSystemService(String name) { throw new RuntimeException("Stub!"); }
    public File getExternalFilesDir(String type) { throw new RuntimeException("Stub!"); }
    public File getNoBackupFilesDir() { throw new RuntimeException("Stub!"); }
    public File getCacheDir() { throw new RuntimeException("Stub!"); }
    public ContentResolver getContentResolver() { throw new RuntimeException("Stub!"); }
    public Context getApplicationContext() { throw new RuntimeException("Stub!"); }
    public ApplicationInfo getApplicationInfo() { throw new RuntimeException("Stub!"); }
    public Resources getResources() { throw new RuntimeException("Stub!"); }
    public File getFilesDir() { throw new RuntimeException("Stub!"); }
    public void startActivity(Intent intent) { throw new RuntimeException("Stub!"); }
    public ComponentName startService(Intent service) { throw new RuntimeException("Stub!"); }
    public ComponentName startForegroundService(Intent service) { throw new RuntimeException("Stub!"); }
}
