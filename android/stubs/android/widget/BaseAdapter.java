package android.widget;

public abstract class BaseAdapter implements SpinnerAdapter {
}
