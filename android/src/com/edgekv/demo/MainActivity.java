package com.edgekv.demo;

import android.app.Activity;
import android.content.Intent;
import android.net.Uri;
import android.os.Build;
import android.os.Bundle;
import android.view.View;
import android.widget.ArrayAdapter;
import android.widget.Button;
import android.widget.EditText;
import android.widget.LinearLayout;
import android.widget.ProgressBar;
import android.widget.ScrollView;
import android.widget.Spinner;
import android.widget.TextView;

import java.io.IOException;
import java.io.InputStream;
import java.util.List;
import java.util.Locale;

/**
 * The main screen: choose and open a model, open or paste a document (kept in a file; the screen
 * shows a preview), ask about it with the sampling settings shown, watch the answer stream in with
 * the prefill and decode progress and the memory used next to the plan; panels show what the model
 * was compiled with and what the run measured. Benchmark… opens the pp/tg screen.
 *
 * The Activity holds no work and no results: AppState (one per process) does, and this screen
 * attaches to it in onStart and renders it. A recreated Activity (dark mode, locale, font scale)
 * shows the running job's progress and keeps its buttons disabled; the question and the settings
 * keep their text (fixed view ids), the chosen model its name (saved state), the document its file.
 * Scripts use ScriptActivity (debuggable builds only), not this one.
 */
public final class MainActivity extends Activity implements AppState.Screen {
    private static final int REQUEST_OPEN_DOCUMENT = 1;
    private static final int REQUEST_IMPORT_MODEL = 2;
    /* fixed view ids: the framework saves and restores these views' state across recreation */
    private static final int ID_QUESTION = 0x0e000001, ID_MAX_TOKENS = 0x0e000002, ID_TEMPERATURE = 0x0e000003,
            ID_TOP_P = 0x0e000004, ID_SEED = 0x0e000005, ID_MODELS = 0x0e000006, ID_SCROLL = 0x0e000007;
    private static final String SAVED_MODEL = "model";

    private AppState state;
    private Ui ui;
    private Spinner models;
    private List<String> modelNames;
    private EditText question, maxTokens, temperature, topP, seed;
    private TextView status, compiled, measured, message, answer, progressText, memory, preview, sampling;
    private ProgressBar progress;
    private Button openButton, askButton, cancelButton, fileButton, pasteButton, clearButton, benchButton;

    @Override
    protected void onCreate(Bundle savedInstanceState) {
        super.onCreate(savedInstanceState);
        setTitle("edgekv demo");
        state = AppState.get();
        ui = new Ui(this);
        buildUi();
        refreshModels(savedInstanceState != null ? savedInstanceState.getString(SAVED_MODEL) : state.openName());
        if (EdgeKvApp.librariesError != null) {
            state.message("The native runtime did not load: " + EdgeKvApp.librariesError, AppState.Tone.ERROR);
        } else {
            status.setText(String.format(Locale.US, "runtime devices: %s · Android %s (API %d) · %s",
                    EdgeKv.runtimeDevices(), Build.VERSION.RELEASE, Build.VERSION.SDK_INT, Build.MODEL));
        }
        if (state.documentPreview().length() == 0) refreshPreview();
    }

    @Override
    protected void onStart() {
        super.onStart();
        state.attach(this); /* renders the current state: a job started by an earlier instance included */
    }

    @Override
    protected void onStop() {
        state.detach(this);
        super.onStop();
    }

    @Override
    protected void onSaveInstanceState(Bundle out) {
        super.onSaveInstanceState(out);
        Object chosen = models.getSelectedItem();
        if (chosen != null) out.putString(SAVED_MODEL, chosen.toString());
    }

    // ---- the screen ------------------------------------------------------------------------------

    private void buildUi() {
        LinearLayout root = ui.column();
        status = ui.small(root, "");

        ui.label(root, "Models");
        models = new Spinner(this);
        models.setId(ID_MODELS);
        openButton = ui.button("Open", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                Object name = models.getSelectedItem();
                if (name != null) start("Opening " + name, Jobs.open(getApplicationContext(), name.toString()));
            }
        });
        Button refresh = ui.button("Refresh", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                Object chosen = models.getSelectedItem();
                refreshModels(chosen != null ? chosen.toString() : null);
            }
        });
        ui.row(root, ui.weighted(models), openButton, refresh);
        Button importButton = ui.button("Import model…", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                startActivityForResult(ModelImport.pickIntent(), REQUEST_IMPORT_MODEL);
            }
        });
        Button deleteButton = ui.button("Delete", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                Object name = models.getSelectedItem();
                if (name != null) start("Deleting " + name, Jobs.deleteModel(getApplicationContext(), name.toString()));
            }
        });
        ui.row(root, importButton, deleteButton);
        ui.small(root, Models.whereFrom(this));
        compiled = ui.mono(root, "");

        ui.label(root, "Document");
        fileButton = ui.button("Open file…", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                Intent pick = new Intent(Intent.ACTION_OPEN_DOCUMENT);
                pick.addCategory(Intent.CATEGORY_OPENABLE);
                pick.setType("text/*");
                startActivityForResult(pick, REQUEST_OPEN_DOCUMENT);
            }
        });
        pasteButton = ui.button("Paste", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                final String text = ui.pasted();
                if (text == null) {
                    state.message("The clipboard holds no text.", AppState.Tone.NOTE);
                    return;
                }
                replaceDocument(new Source() {
                    @Override
                    public void writeTo(DocumentStore store) throws IOException {
                        store.replace(text);
                    }
                }, "the pasted text");
            }
        });
        clearButton = ui.button("Clear", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                replaceDocument(new Source() {
                    @Override
                    public void writeTo(DocumentStore store) {
                        store.clear();
                    }
                }, null);
            }
        });
        ui.row(root, fileButton, pasteButton, clearButton);
        preview = ui.mono(root, "");

        ui.label(root, "Question");
        question = ui.field(ID_QUESTION, "Ask about the document", Ui.TEXT);
        root.addView(question, ui.fill());
        askButton = ui.button("Ask", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                ask();
            }
        });
        cancelButton = ui.button("Cancel", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                state.cancel();
            }
        });
        ui.row(root, askButton, cancelButton);
        maxTokens = ui.field(ID_MAX_TOKENS, "128", Ui.NUMBER);
        temperature = ui.field(ID_TEMPERATURE, "0", Ui.DECIMAL);
        topP = ui.field(ID_TOP_P, "1.0", Ui.DECIMAL);
        seed = ui.field(ID_SEED, "0", Ui.NUMBER);
        ui.row(root, ui.caption("max new"), ui.weighted(maxTokens), ui.caption("temp."), ui.weighted(temperature));
        ui.row(root, ui.caption("top-p"), ui.weighted(topP), ui.caption("seed"), ui.weighted(seed));
        sampling = ui.small(root, "");

        progress = new ProgressBar(this, null, android.R.attr.progressBarStyleHorizontal);
        progress.setMax(1);
        root.addView(progress, ui.fill());
        progressText = ui.small(root, "");
        memory = ui.small(root, "");
        message = ui.message(root);
        Button copy = ui.button("Copy message", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                ui.copy("edgekv message", state.message() + "\n\n" + state.measured());
            }
        });
        ui.row(root, copy);
        answer = new TextView(this);
        answer.setTextIsSelectable(true);
        answer.setTextSize(16);
        root.addView(answer, ui.fill());

        ui.label(root, "Measured");
        measured = ui.mono(root, "");
        benchButton = ui.button("Benchmark…", new View.OnClickListener() {
            @Override
            public void onClick(View v) {
                startActivity(Ui.intentFor(MainActivity.this, BenchActivity.class));
            }
        });
        ui.row(root, benchButton);

        ScrollView scroll = new ScrollView(this);
        scroll.setId(ID_SCROLL); /* keeps its position across recreation */
        scroll.addView(root);
        setContentView(scroll);
    }

    /** AppState.Screen: show the state (UI thread). */
    @Override
    public void render(AppState s) {
        boolean busy = s.busy(), loaded = EdgeKvApp.librariesError == null;
        openButton.setEnabled(!busy && loaded);
        askButton.setEnabled(!busy && loaded);
        benchButton.setEnabled(loaded);
        fileButton.setEnabled(!busy);
        pasteButton.setEnabled(!busy);
        clearButton.setEnabled(!busy);
        cancelButton.setEnabled(busy && !s.cancelling());
        message.setTextColor(ui.color(s.tone()));
        message.setText(s.message());
        compiled.setText(s.compiled());
        measured.setText(s.measured());
        answer.setText(s.answer());
        progress.setMax((int) Math.min(Integer.MAX_VALUE, s.progressMax()));
        progress.setProgress((int) Math.min(Integer.MAX_VALUE, s.progressDone()));
        progressText.setText(s.progressText());
        memory.setText(s.memoryText());
        String p = s.documentPreview();
        preview.setText(p.length() > 0 ? p : "No document: open a text file or paste one (up to 8 MiB).");
        sampling.setText("sampling: " + samplingNow().describe() + (busy ? " · running: " + s.sampling() : ""));
    }

    private void start(String title, AppState.Job job) {
        if (!state.start(title, job)) state.message("Wait for " + state.jobTitle() + " to finish, or Cancel it.",
                AppState.Tone.NOTE);
    }

    private Engine.Sampling samplingNow() {
        float t = Ui.parseFloat(temperature.getText().toString(), 0f);
        float p = Ui.parseFloat(topP.getText().toString(), 1f);
        long s = Ui.parseInt(seed.getText().toString(), 0);
        return new Engine.Sampling(t, p > 0 && p <= 1 ? p : 1f, s);
    }

    private void ask() {
        String q = question.getText().toString();
        int maxNew = Ui.parseInt(maxTokens.getText().toString(), 128);
        start("Answering", Jobs.ask(getApplicationContext(), q, maxNew, samplingNow()));
    }

    private void refreshModels(String select) {
        modelNames = Models.list(this);
        ArrayAdapter<String> adapter = new ArrayAdapter<String>(this, android.R.layout.simple_spinner_item, modelNames);
        adapter.setDropDownViewResource(android.R.layout.simple_spinner_dropdown_item);
        models.setAdapter(adapter);
        if (select != null && modelNames.contains(select)) models.setSelection(modelNames.indexOf(select));
        if (modelNames.isEmpty() && !state.busy()) state.message("No model yet. " + Models.whereFrom(this),
                AppState.Tone.NOTE);
    }

    // ---- the document ----------------------------------------------------------------------------

    /** What replaces the document (on the document thread). */
    private interface Source {
        void writeTo(DocumentStore store) throws IOException;
    }

    /** Writes the new document off the UI thread, then shows its preview; `what` names it in the message. */
    private void replaceDocument(final Source source, final String what) {
        final AppState s = state;
        final DocumentStore store = Jobs.documents(getApplicationContext());
        if (what != null) s.message("Reading " + what + "…", AppState.Tone.NOTE);
        s.io(new Runnable() {
            @Override
            public void run() {
                try {
                    source.writeTo(store);
                    s.setDocumentPreview(store.preview(8, 600));
                    if (what != null) s.message("Document: " + what + ".", AppState.Tone.OK);
                } catch (IOException e) {
                    s.message("Cannot use " + what + ": " + e.getMessage(), AppState.Tone.ERROR);
                }
            }
        });
    }

    private void refreshPreview() {
        replaceDocument(new Source() {
            @Override
            public void writeTo(DocumentStore store) {
            }
        }, null);
    }

    @Override
    protected void onActivityResult(int requestCode, int resultCode, Intent data) {
        super.onActivityResult(requestCode, resultCode, data);
        if (requestCode == REQUEST_IMPORT_MODEL && resultCode == RESULT_OK && data != null && data.getData() != null) {
            start("Importing a model", Jobs.importModel(getApplicationContext(), data.getData()));
            return;
        }
        if (requestCode != REQUEST_OPEN_DOCUMENT || resultCode != RESULT_OK || data == null || data.getData() == null) {
            return;
        }
        final Uri uri = data.getData();
        final android.content.ContentResolver resolver = getApplicationContext().getContentResolver();
        replaceDocument(new Source() {
            @Override
            public void writeTo(DocumentStore store) throws IOException {
                InputStream in = resolver.openInputStream(uri);
                if (in == null) throw new IOException("the file could not be opened");
                try {
                    store.replace(in);
                } finally {
                    in.close();
                }
            }
        }, uri.getLastPathSegment());
    }
}
