package android.widget;

import android.content.Context;
import android.graphics.Typeface;
import android.view.View;

public class TextView extends View {
    public TextView(Context context) { super(context); throw new RuntimeException("Stub!"); }
    public void setText(CharSequence text) { throw new RuntimeException("Stub!"); }
    public CharSequence getText() { throw new RuntimeException("Stub!"); }
    public final void append(CharSequence text) { throw new RuntimeException("Stub!"); }
    public void setHint(CharSequence hint) { throw new RuntimeException("Stub!"); }
    public void setTextSize(float size) { throw new RuntimeException("Stub!"); }
    public void setTextColor(int color) { throw new RuntimeException("Stub!"); }
    public void setTypeface(Typeface tf) { throw new RuntimeException("Stub!"); }
    public void setTextIsSelectable(boolean selectable) { throw new RuntimeException("Stub!"); }
    public void setMinLines(int minLines) { throw new RuntimeException("Stub!"); }
    public void setMaxLines(int maxLines) { throw new RuntimeException("Stub!"); }
    public void setSingleLine(boolean singleLine) { throw new RuntimeException("Stub!"); }
    public void setInputType(int type) { throw new RuntimeException("Stub!"); }
}
