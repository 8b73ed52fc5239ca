package android.content;

public class ClipData {
    ClipData() { throw new RuntimeException("Stub!"); }
    public static ClipData newPlainText(CharSequence label, CharSequence text) { throw new RuntimeException("Stub!"); }
    public int getItemCount() { throw new RuntimeException("Stub!"); }
    public ClipData.Item getItemAt(int index) { throw new RuntimeException("Stub!"); }
    public static class Item {
        public Item(CharSequence text) { throw new RuntimeException("Stub!"); }
        public CharSequence coerceToText(Context context) { throw new RuntimeException("Stub!"); }
    }
}
