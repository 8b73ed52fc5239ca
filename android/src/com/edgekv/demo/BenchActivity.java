package com.edgekv.demo;

import android.app.Activity;
import android.os.Bundle;
import android.view.View;
import android.widget.Button;
import android.widget.EditText;
import android.widget.LinearLayout;
import android.widget.ProgressBar;
import android.widget.ScrollView;
import android.widget.TextView;

/**
 * The benchmark screen, as llama-bench's pp/tg: prefill P tokens and decode T tokens on the open
 * model, R times each, and show tokens per second (mean ± sd) with the peak RSS next to the
 * model's memory plan, and the memory now while it runs. The run is an AppState job like a
 * question (one at a time, kept alive in the background by the foreground service, cancellable
 * from here or the notification); its report stays in AppState, so it survives a recreation.
 */
public final class BenchActivity extends Activity implements AppState.Screen {
    private static final int ID_PP = 0x0e000101, ID_TG = 0x0e000102, ID_REPS = 0x0e000103;

    private AppState state;
    private Ui ui;
    private EditText pp, tg, reps;
    private Button run, cancel;
    private ProgressBar progress;
    private TextView model, progressText, memory, message, report;

    @Override
    protected void onCreate(Bundle savedInstanceState) {
        super.onCreate(savedInstanceState);
        setTitle("edgekv benchmark");
        state = AppState.get();
        ui = new Ui(this);
        LinearLayout root = ui.column();
        model = ui.mono(root, "");
        ui.label(root, "Lengths (tokens)");
        pp = ui.field(ID_PP, "512", Ui.NUMBER);
        tg = ui.field(ID_TG, "128", Ui.NUMBER);
        reps = ui.field(ID_REPS, "3", Ui.NUMBER);
        ui.row(root, ui.caption("prefill pp"), ui.weighted(pp), ui.caption("decode tg"), ui.weighted(tg),
                ui.caption("reps"), ui.weighted(reps));
        ui.small(root, "pp: prompt tokens read into an empty cache, B at a time; tg: tokens decoded one at a time "
                + "after a one-token prompt (llama-bench's pp/tg). 0 skips a test.");
        run = ui.button("Run", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                int p = parse(pp, 512), t = parse(tg, 128), r = Math.max(1, parse(reps, 3));
                if (!state.start("Benchmark pp" + p + " tg" + t, Jobs.bench(getApplicationContext(), p, t, r))) {
                    state.message("Wait for " + state.jobTitle() + " to finish, or Cancel it.", AppState.Tone.NOTE);
                }
            }
        });
        cancel = ui.button("Cancel", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                state.cancel();
            }
        });
        Button copy = ui.button("Copy", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                ui.copy("edgekv benchmark", state.benchReport() + "\n" + state.message());
            }
        });
        ui.row(root, run, cancel, copy);
        progress = new ProgressBar(this, null, android.R.attr.progressBarStyleHorizontal);
        root.addView(progress, ui.fill());
        progressText = ui.small(root, "");
        memory = ui.small(root, "");
        message = ui.message(root);
        ui.label(root, "Results");
        report = ui.mono(root, "");
        ScrollView scroll = new ScrollView(this);
        scroll.addView(root);
        setContentView(scroll);
    }

    /** A blank field is its hint's default; 0 is kept (it skips the test). */
    private static int parse(EditText e, int otherwise) {
        String s = e.getText().toString().trim();
        if (s.length() == 0) return otherwise;
        try {
            return Math.max(0, Integer.parseInt(s));
        } catch (NumberFormatException x) {
            return otherwise;
        }
    }

    @Override
    protected void onStart() {
        super.onStart();
        state.attach(this);
    }

    @Override
    protected void onStop() {
        state.detach(this);
        super.onStop();
    }

    @Override
    public void render(AppState s) {
        boolean busy = s.busy();
        run.setEnabled(!busy && EdgeKvApp.librariesError == null);
        cancel.setEnabled(busy && !s.cancelling());
        String name = s.openName();
        model.setText(name == null ? "No model open: open one on the main screen."
                : name + (s.closedForMemory() ? " (closed to free memory; Run reopens it)" : "")
                + " · plan " + Artifact.mib(s.planBytes()));
        progress.setMax((int) Math.min(Integer.MAX_VALUE, s.progressMax()));
        progress.setProgress((int) Math.min(Integer.MAX_VALUE, s.progressDone()));
        progressText.setText(s.progressText());
        memory.setText(s.memoryText());
        message.setTextColor(ui.color(s.tone()));
        message.setText(s.message());
        report.setText(s.benchReport());
    }
}
