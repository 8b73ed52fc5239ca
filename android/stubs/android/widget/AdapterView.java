package android.widget;

import android.content.Context;
import android.view.ViewGroup;

public abstract class AdapterView<T> extends ViewGroup {
    public AdapterView(Context context) { super(context); throw new RuntimeException("Stub!"); }
    public Object getSelectedItem() { throw new RuntimeException("Stub!"); }
    public void setSelection(int position) { throw new RuntimeException("Stub!"); }
}
