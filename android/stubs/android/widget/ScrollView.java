package android.widget;

import android.content.Context;

public class ScrollView extends FrameLayout {
    public ScrollView(Context context) { super(context); throw new RuntimeException("Stub!"); }
    public final boolean fullScroll(int direction) { throw new RuntimeException("Stub!"); }
}
