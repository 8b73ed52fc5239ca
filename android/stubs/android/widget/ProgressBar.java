package android.widget;

import android.content.Context;
import android.util.AttributeSet;
import android.view.View;

public class ProgressBar extends View {
    public ProgressBar(Context context, AttributeSet attrs, int defStyleAttr) { super(context); throw new RuntimeException("Stub!"); }
    public void setMax(int max) { throw new RuntimeException("Stub!"); }
    public void setProgress(int progress) { throw new RuntimeException("Stub!"); }
    public void setIndeterminate(boolean indeterminate) { throw new RuntimeException("Stub!"); }
}
