package android.content;

import android.content.pm.ApplicationInfo;
import android.content.res.Resources;
import java.io.File;

public abstract class Context {
    public static final String ACTIVITY_SERVICE = "activity";
    public static final String NOTIFICATION_SERVICE = "notification";
    public static final String CLIPBOARD_SERVICE = "clipboard";
    public abstract Object getSystemService(String name);
    public abstract File getExternalFilesDir(String type);
    public abstract File getNoBackupFilesDir();
    public abstract File getCacheDir();
    public abstract ContentResolver getContentResolver();
    public abstract Context getApplicationContext();
    public abstract ApplicationInfo getApplicationInfo();
    public abstract Resources getResources();
    public abstract File getFilesDir();
    public abstract void startActivity(Intent intent);
    public abstract ComponentName startService(Intent service);
    /* API 26 */
    public abstract ComponentName startForegroundService(Intent service);
}
