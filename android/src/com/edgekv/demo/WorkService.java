package com.edgekv.demo;

import android.app.Notification;
import android.app.NotificationChannel;
import android.app.NotificationManager;
import android.app.PendingIntent;
import android.app.Service;
import android.content.Context;
import android.content.Intent;
import android.os.Build;
import android.os.IBinder;

/**
 * Keeps a long job (a prefill of a long document, a benchmark, a scripted run) alive while the app
 * is in the background: a foreground service of type dataSync (android:foregroundServiceType in
 * the manifest, with the FOREGROUND_SERVICE permission), whose notification shows the job's
 * progress and has a Cancel action. It holds no work itself: the job runs on AppState's worker;
 * the service only marks the process as one the user is waiting for. It starts with each job and
 * stops when the job ends (if the job ended before the service started, it stops at once after
 * calling startForeground, as Android 8+ requires of a service started with startForegroundService).
 */
public final class WorkService extends Service {
    static final String ACTION_CANCEL = "com.edgekv.demo.action.CANCEL";
    static final String CHANNEL = "work";
    static final int NOTIFICATION = 1;

    private static volatile WorkService running; /* set and cleared on the UI thread */
    private static volatile String title = "edgekv";
    private static volatile long lastUpdate;

    static void begin(Context c, String jobTitle) {
        title = jobTitle;
        Intent i = Ui.intentFor(c, WorkService.class);
        if (Build.VERSION.SDK_INT >= 26) c.startForegroundService(i);
        else c.startService(i);
    }

    /** The notification follows the job's progress (at most twice a second). Any thread. */
    static void update(Context c, String jobTitle, String text, long done, long max) {
        long now = System.nanoTime();
        if (running == null || now - lastUpdate < 500000000L) return;
        lastUpdate = now;
        title = jobTitle;
        NotificationManager nm = (NotificationManager) c.getSystemService(Context.NOTIFICATION_SERVICE);
        nm.notify(NOTIFICATION, notification(c, jobTitle, text, done, max));
    }

    /** The job ended. UI thread. (Another job may have started since: then the service stays.) */
    static void end() {
        if (running != null && !AppState.get().busy()) {
            running.stopForeground(true);
            running.stopSelf();
            running = null;
        }
    }

    @Override
    public int onStartCommand(Intent intent, int flags, int startId) {
        if (intent != null && ACTION_CANCEL.equals(intent.getAction())) {
            AppState.get().cancel();
            return START_NOT_STICKY;
        }
        running = this;
        startForeground(NOTIFICATION, notification(this, title, "", 0, 1));
        if (!AppState.get().busy()) end(); /* the job was over before the service started */
        return START_NOT_STICKY;
    }

    @Override
    public void onDestroy() {
        if (running == this) running = null;
        super.onDestroy();
    }

    @Override
    public IBinder onBind(Intent intent) {
        return null;
    }

    static Notification notification(Context c, String jobTitle, String text, long done, long max) {
        Notification.Builder b;
        if (Build.VERSION.SDK_INT >= 26) {
            NotificationManager nm = (NotificationManager) c.getSystemService(Context.NOTIFICATION_SERVICE);
            nm.createNotificationChannel(new NotificationChannel(CHANNEL, "Running work",
                    NotificationManager.IMPORTANCE_LOW));
            b = new Notification.Builder(c, CHANNEL);
        } else {
            b = new Notification.Builder(c);
        }
        int flags = PendingIntent.FLAG_IMMUTABLE | PendingIntent.FLAG_UPDATE_CURRENT;
        Intent cancel = Ui.intentFor(c, WorkService.class);
        cancel.setAction(ACTION_CANCEL);
        return b.setSmallIcon(android.R.drawable.stat_sys_download)
                .setContentTitle(jobTitle)
                .setContentText(text)
                .setOngoing(true)
                .setOnlyAlertOnce(true)
                .setProgress((int) Math.min(Integer.MAX_VALUE, max), (int) Math.min(Integer.MAX_VALUE, done),
                        done == 0)
                .setContentIntent(PendingIntent.getActivity(c, 0, Ui.intentFor(c, MainActivity.class), flags))
                .addAction(android.R.drawable.ic_menu_close_clear_cancel, "Cancel",
                        PendingIntent.getService(c, 1, cancel, flags))
                .build();
    }
}
