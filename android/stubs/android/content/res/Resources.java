package android.content.res;

import android.util.DisplayMetrics;

public class Resources {
    Resources() { throw new RuntimeException("Stub!"); }
    public DisplayMetrics getDisplayMetrics() { throw new RuntimeException("Stub!"); }
    public Configuration getConfiguration() { throw new RuntimeException("Stub!"); }
}
