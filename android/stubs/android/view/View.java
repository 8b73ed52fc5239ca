package android.view;

import android.content.Context;

public class View {
    public static final int VISIBLE = 0;
    public static final int GONE = 8;
    public static final int FOCUS_DOWN = 130;
    public View(Context context) { throw new RuntimeException("Stub!"); }
    public void setId(int id) { throw new RuntimeException("Stub!"); }
    public void setOnClickListener(OnClickListener l) { throw new RuntimeException("Stub!"); }
    public void setEnabled(boolean enabled) { throw new RuntimeException("Stub!"); }
    public void setPadding(int left, int top, int right, int bottom) { throw new RuntimeException("Stub!"); }
    public void setVisibility(int visibility) { throw new RuntimeException("Stub!"); }
    public void setLayoutParams(ViewGroup.LayoutParams params) { throw new RuntimeException("Stub!"); }
    public boolean post(Runnable action) { throw new RuntimeException("Stub!"); }
    public interface OnClickListener {
        void onClick(View v);
    }
}
