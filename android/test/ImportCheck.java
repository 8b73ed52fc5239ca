import com.edgekv.demo.Json;
import com.edgekv.demo.ModelStore;

import java.io.BufferedInputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.InputStream;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Drives the app's ModelStore (the import of an `edgekv pack` package, as MainActivity does with
 * the file picker's stream) on a desktop JVM; tests/test_android_package.py runs it:
 *
 *   java ImportCheck ROOT BUNDLED_LIB|- FREE_BYTES|- CANCEL_AT_BYTES|- import PACKAGE
 *   java ImportCheck ROOT BUNDLED_LIB|- - - open|delete NAME
 *   java ImportCheck ROOT - - - list
 *
 * Prints one JSON object: the model's name or the error, the models then in the store, what else
 * is in ROOT (partial copies would show here), and the progress calls seen.
 */
public final class ImportCheck {
    public static void main(String[] args) throws Exception {
        File root = new File(args[0]);
        File bundled = args[1].equals("-") ? null : new File(args[1]);
        final long free = args[2].equals("-") ? -1 : Long.parseLong(args[2]);
        final long cancelAt = args[3].equals("-") ? -1 : Long.parseLong(args[3]);
        String cmd = args[4];
        Map<String, Object> out = new LinkedHashMap<String, Object>();
        final ModelStore store = new ModelStore(root, bundled, free < 0 ? null : new ModelStore.FreeSpace() {
            @Override
            public long usable(File dir) {
                return free;
            }
        });
        final ModelStore.CancelFlag cancel = new ModelStore.CancelFlag();
        final long[] calls = {0, 0, 0};
        ModelStore.Progress progress = new ModelStore.Progress() {
            @Override
            public void onProgress(String part, long done, long total) {
                calls[0]++;
                calls[1] = done;
                calls[2] = total;
                if (cancelAt >= 0 && done >= cancelAt) cancel.cancel(); /* as the Cancel button would */
            }
        };
        try {
            if (cmd.equals("import")) {
                InputStream in = new BufferedInputStream(new FileInputStream(args[5]));
                try {
                    out.put("name", store.importFrom(in, progress, cancel));
                } finally {
                    in.close();
                }
            } else if (cmd.equals("open")) {
                out.put("dir", store.open(args[5]).getPath());
                out.put("describe", store.describe(args[5]).describe());
            } else if (cmd.equals("delete")) {
                store.delete(args[5]);
            }
        } catch (ModelStore.CancelledException e) {
            out.put("cancelled", e.getMessage());
        } catch (java.io.IOException e) {
            out.put("error", e.getMessage());
        }
        out.put("models", store.list());
        List<String> entries = new ArrayList<String>();
        File[] all = root.listFiles();
        if (all != null) for (File f : all) entries.add(f.getName());
        java.util.Collections.sort(entries);
        out.put("root_entries", entries);
        out.put("progress_calls", calls[0]);
        out.put("progress_done", calls[1]);
        out.put("progress_total", calls[2]);
        System.out.println(Json.write(out));
    }
}
