package com.edgekv.demo;

import android.app.Activity;
import android.content.Intent;
import android.content.pm.ApplicationInfo;
import android.os.Bundle;
import android.util.Log;

import java.util.LinkedHashMap;
import java.util.Map;

/**
 * The entry point for scripts (device_tests/test_android_device.py), separate from the launcher
 * Activity and guarded three ways: it runs only in a debuggable build (ApplicationInfo's
 * FLAG_DEBUGGABLE; a release build refuses and finishes), the manifest lets only callers holding
 * android.permission.DUMP start it (the adb shell holds it; other apps cannot get it), and it takes
 * names, never paths (ScriptRequest: "..", "/" and absolute paths are refused).
 * <pre>
 * adb shell am start -S -W -n com.edgekv.demo/.ScriptActivity --es artifact NAME --es document_file doc.txt \
 *     --esa questions "Q1,Q2" --ei max_new_tokens 16 --es result run.json
 * </pre>
 * runs the steps of the buttons as one AppState job (the main screen shows it) and writes the
 * answers and measurements as JSON to files/results/run.json; a refused request writes its reason
 * there (or to last-run.json when the result name itself is refused) and to logcat.
 */
public final class ScriptActivity extends Activity {
    @Override
    protected void onCreate(Bundle savedInstanceState) {
        super.onCreate(savedInstanceState);
        if ((getApplicationInfo().flags & ApplicationInfo.FLAG_DEBUGGABLE) == 0) {
            Log.w(Jobs.TAG, "scripted runs are refused: this build is not debuggable");
            finish();
            return;
        }
        if (savedInstanceState == null) run(getIntent());
        startActivity(Ui.intentFor(this, MainActivity.class)); /* the run shows there */
        finish();
    }

    private void run(final Intent intent) {
        ScriptRequest request;
        try {
            request = ScriptRequest.parse(new ScriptRequest.Extras() {
                @Override
                public boolean has(String key) {
                    return intent.hasExtra(key);
                }

                @Override
                public String string(String key) {
                    return intent.getStringExtra(key);
                }

                @Override
                public String[] strings(String key) {
                    return intent.getStringArrayExtra(key);
                }

                @Override
                public int integer(String key, int otherwise) {
                    return intent.getIntExtra(key, otherwise);
                }
            });
        } catch (IllegalArgumentException e) {
            refuse(intent, e.getMessage());
            return;
        }
        Log.i(Jobs.TAG, "scripted run: artifact " + request.artifact + ", " + request.questions.size() + " question(s)");
        if (!AppState.get().start("Scripted run", Jobs.script(getApplicationContext(), request))) {
            refuse(intent, "busy: " + AppState.get().jobTitle() + " is running");
        }
    }

    private void refuse(Intent intent, String why) {
        Log.e(Jobs.TAG, "scripted run refused: " + why);
        String name = "last-run.json";
        try {
            if (intent.hasExtra("result")) name = ScriptRequest.name("result", intent.getStringExtra("result"), "");
        } catch (IllegalArgumentException e) {
            name = "last-run.json";
        }
        Map<String, Object> result = new LinkedHashMap<String, Object>();
        result.put("error", why);
        Jobs.writeResult(getApplicationContext(), name, result);
        AppState.get().message("Scripted run refused: " + why, AppState.Tone.ERROR);
    }
}
