package android.app;

import android.content.Context;

public class Notification {
    public Notification() { throw new RuntimeException("Stub!"); }
    public static class Builder {
        public Builder(Context context) { throw new RuntimeException("Stub!"); }
        /* API 26 */
        public Builder(Context context, String channelId) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setSmallIcon(int icon) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setContentTitle(CharSequence title) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setContentText(CharSequence text) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setOngoing(boolean ongoing) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setOnlyAlertOnce(boolean onlyAlertOnce) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setProgress(int max, int progress, boolean indeterminate) { throw new RuntimeException("Stub!"); }
        public Notification.Builder setContentIntent(PendingIntent intent) { throw new RuntimeException("Stub!"); }
        public Notification.Builder addAction(int icon, CharSequence title, PendingIntent intent) { throw new RuntimeException("Stub!"); }
        public Notification build() { throw new RuntimeException("Stub!"); }
    }
}
