package android.app;

public class NotificationManager {
    public static final int IMPORTANCE_LOW = 2;
    NotificationManager() { throw new RuntimeException("Stub!"); }
    public void notify(int id, Notification notification) { throw new RuntimeException("Stub!"); }
    /* API 26 */
    public void createNotificationChannel(NotificationChannel channel) { throw new RuntimeException("Stub!"); }
}
