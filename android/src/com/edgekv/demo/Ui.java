package com.edgekv.demo;

import android.app.Activity;
import android.content.ClipData;
import android.content.ClipboardManager;
import android.content.Context;
import android.content.Intent;
import android.content.res.Configuration;
import android.graphics.Typeface;
import android.view.View;
import android.view.ViewGroup;
import android.widget.Button;
import android.widget.EditText;
import android.widget.LinearLayout;
import android.widget.TextView;

/**
 * The screens' building blocks, in code (no layouts, no AndroidX): sizes in dp (scaled by the
 * display's density) and text in sp (TextView.setTextSize scales by the font scale), colours for
 * the light and the dark theme (res/values and res/values-night pick the theme; these pick the
 * message colours to match), selectable text where a person may want to copy it, and a clipboard.
 */
final class Ui {
    private final Activity activity;
    private final float density;
    final boolean night;

    Ui(Activity activity) {
        this.activity = activity;
        density = activity.getResources().getDisplayMetrics().density;
        night = (activity.getResources().getConfiguration().uiMode & Configuration.UI_MODE_NIGHT_MASK)
                == Configuration.UI_MODE_NIGHT_YES;
    }

    int dp(int v) {
        return Math.round(v * density);
    }

    int color(AppState.Tone tone) {
        switch (tone) {
            case ERROR:
                return night ? 0xFFF2B8B5 : 0xFFB3261E;
            case OK:
                return night ? 0xFF81C784 : 0xFF1B5E20;
            default:
                return night ? 0xFFB0B0B0 : 0xFF555555;
        }
    }

    LinearLayout.LayoutParams fill() {
        return new LinearLayout.LayoutParams(ViewGroup.LayoutParams.MATCH_PARENT, ViewGroup.LayoutParams.WRAP_CONTENT, 0);
    }

    View weighted(View v) {
        v.setLayoutParams(new LinearLayout.LayoutParams(0, ViewGroup.LayoutParams.WRAP_CONTENT, 1));
        return v;
    }

    LinearLayout column() {
        LinearLayout root = new LinearLayout(activity);
        root.setOrientation(LinearLayout.VERTICAL);
        root.setPadding(dp(16), dp(16), dp(16), dp(16));
        return root;
    }

    void row(LinearLayout parent, View... views) {
        LinearLayout r = new LinearLayout(activity);
        r.setOrientation(LinearLayout.HORIZONTAL);
        for (View v : views) r.addView(v);
        parent.addView(r, fill());
    }

    Button button(String text, View.OnClickListener l) {
        Button b = new Button(activity);
        b.setText(text);
        b.setOnClickListener(l);
        return b;
    }

    TextView label(LinearLayout parent, String text) {
        TextView t = new TextView(activity);
        t.setText(text);
        t.setTypeface(Typeface.DEFAULT_BOLD);
        t.setTextSize(16);
        t.setPadding(0, dp(16), 0, dp(4));
        parent.addView(t, fill());
        return t;
    }

    TextView small(LinearLayout parent, String text) {
        TextView t = new TextView(activity);
        t.setText(text);
        t.setTextSize(12);
        t.setTextColor(color(AppState.Tone.NOTE));
        parent.addView(t, fill());
        return t;
    }

    TextView mono(LinearLayout parent, String text) {
        TextView t = new TextView(activity);
        t.setText(text);
        t.setTypeface(Typeface.MONOSPACE);
        t.setTextSize(12);
        t.setTextIsSelectable(true);
        parent.addView(t, fill());
        return t;
    }

    /** A message line: selectable, so an error can be copied as it is (and the Copy button copies it whole). */
    TextView message(LinearLayout parent) {
        TextView t = new TextView(activity);
        t.setTextIsSelectable(true);
        t.setTextSize(14);
        parent.addView(t, fill());
        return t;
    }

    /** An input field with a fixed id: the framework saves and restores its text when the Activity is recreated. */
    EditText field(int id, String hint, int inputType) {
        EditText e = new EditText(activity);
        e.setId(id);
        e.setHint(hint);
        e.setSingleLine(true);
        e.setInputType(inputType);
        return e;
    }

    /* android.text.InputType's values (constants there too) */
    static final int TEXT = 0x1, NUMBER = 0x2, DECIMAL = 0x2002;

    TextView caption(String text) {
        TextView t = new TextView(activity);
        t.setText(text);
        t.setTextSize(12);
        return t;
    }

    void copy(String label, CharSequence text) {
        ClipboardManager cm = (ClipboardManager) activity.getSystemService(Context.CLIPBOARD_SERVICE);
        cm.setPrimaryClip(ClipData.newPlainText(label, text));
    }

    /** The clipboard's text, or null when it holds none. */
    String pasted() {
        ClipboardManager cm = (ClipboardManager) activity.getSystemService(Context.CLIPBOARD_SERVICE);
        ClipData clip = cm.getPrimaryClip();
        if (clip == null || clip.getItemCount() == 0) return null;
        CharSequence text = clip.getItemAt(0).coerceToText(activity);
        return text != null ? text.toString() : null;
    }

    /** An explicit intent for one of the app's components (by class name: the stubs declare no Class parameters). */
    static Intent intentFor(Context c, Class<?> component) {
        Intent i = new Intent();
        i.setClassName(c, component.getName());
        return i;
    }

    static int parseInt(String s, int otherwise) {
        try {
            int v = Integer.parseInt(s.trim());
            return v > 0 ? v : otherwise;
        } catch (NumberFormatException e) {
            return otherwise;
        }
    }

    static float parseFloat(String s, float otherwise) {
        try {
            float v = Float.parseFloat(s.trim());
            return v >= 0 ? v : otherwise;
        } catch (NumberFormatException e) {
            return otherwise;
        }
    }
}
