package android.content;

import java.io.File;

public abstract class Context {
    public static final String ACTIVITY_SERVICE = "activity";
    public abstract Object getSystemService(String name);
    public abstract File getExternalFilesDir(String type);
    public abstract File getNoBackupFilesDir();
    public abstract File getCacheDir();
    public abstract ContentResolver getContentResolver();
    public abstract android.content.pm.ApplicationInfo getApplicationInfo();
}
