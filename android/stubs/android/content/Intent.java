package android.content;

import android.net.Uri;

public class Intent {
    public static final String ACTION_OPEN_DOCUMENT = "android.intent.action.OPEN_DOCUMENT";
    public static final String CATEGORY_OPENABLE = "android.intent.category.OPENABLE";
    public Intent() { throw new RuntimeException("Stub!"); }
    public Intent(String action) { throw new RuntimeException("Stub!"); }
    public Intent setClassName(Context packageContext, String className) { throw new RuntimeException("Stub!"); }
    public Intent setAction(String action) { throw new RuntimeException("Stub!"); }
    public String getAction() { throw new RuntimeException("Stub!"); }
    public Intent addCategory(String category) { throw new RuntimeException("Stub!"); }
    public Intent setType(String type) { throw new RuntimeException("Stub!"); }
    public Uri getData() { throw new RuntimeException("Stub!"); }
    public String getStringExtra(String name) { throw new RuntimeException("Stub!"); }
    public String[] getStringArrayExtra(String name) { throw new RuntimeException("Stub!"); }
    public int getIntExtra(String name, int defaultValue) { throw new RuntimeException("Stub!"); }
    public boolean getBooleanExtra(String name, boolean defaultValue) { throw new RuntimeException("Stub!"); }
    public boolean hasExtra(String name) { throw new RuntimeException("Stub!"); }
}
