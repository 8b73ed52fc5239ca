package com.edgekv.demo;

import android.app.Application;
import android.os.Handler;
import android.os.Looper;

/**
 * The process: loads the native libraries once, installs the AppState that outlives every
 * Activity (with the UI thread's Handler and the foreground service as its Host), and passes the
 * system's memory requests (onTrimMemory) to it.
 */
public final class EdgeKvApp extends Application {
    /** Why the native libraries did not load, or null. */
    static String librariesError;

    static {
        try {
            EdgeKv.loadLibraries();
        } catch (Throwable t) { /* UnsatisfiedLinkError: shown on the screen, not a crash */
            librariesError = t.toString();
        }
    }

    @Override
    public void onCreate() {
        super.onCreate();
        final Application app = this;
        final Handler ui = new Handler(Looper.getMainLooper());
        AppState.install(new AppState.Host() {
            @Override
            public void post(Runnable r) {
                ui.post(r);
            }

            @Override
            public void workStarted(String title) {
                WorkService.begin(app, title);
            }

            @Override
            public void workProgress(String title, String text, long done, long max) {
                WorkService.update(app, title, text, done, max);
            }

            @Override
            public void workFinished() {
                ui.post(new Runnable() {
                    @Override
                    public void run() {
                        WorkService.end();
                    }
                });
            }
        });
    }

    @Override
    public void onTrimMemory(int level) {
        super.onTrimMemory(level);
        AppState.get().trimMemory(level);
    }
}
