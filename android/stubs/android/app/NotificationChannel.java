package android.app;

/* API 26 */
public final class NotificationChannel {
    public NotificationChannel(String id, CharSequence name, int importance) { throw new RuntimeException("Stub!"); }
}
