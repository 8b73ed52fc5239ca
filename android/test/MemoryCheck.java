import com.edgekv.demo.Artifact;

import java.io.File;

/**
 * The app's memory check (Artifact.memoryRefusal, which Jobs runs with ActivityManager.MemoryInfo
 * before opening a model) on a desktop JVM, for phones given as free-memory figures:
 *
 *   java MemoryCheck ARTIFACT AVAIL_BYTES THRESHOLD_BYTES [AVAIL_BYTES THRESHOLD_BYTES ...]
 *
 * Only ARTIFACT/manifest.json is read. Prints one JSON object: what the app shows of the artifact,
 * its plan, what it needs, and for each phone the refusal the app would show (null: it loads).
 */
public final class MemoryCheck {
    public static void main(String[] args) throws Exception {
        Artifact a = Artifact.read(new File(args[0]));
        StringBuilder out = new StringBuilder();
        out.append("{\"describe\": ").append(quote(a.describe())).append(", \"plan_bytes\": ").append(a.planBytes)
                .append(", \"needed_bytes\": ").append(a.memoryNeeded()).append(", \"verdicts\": [");
        for (int i = 1; i + 1 < args.length; i += 2) {
            String refusal = a.memoryRefusal(Long.parseLong(args[i]), Long.parseLong(args[i + 1]));
            out.append(i > 1 ? ", " : "").append(refusal == null ? "null" : quote(refusal));
        }
        System.out.println(out.append("]}"));
    }

    private static String quote(String s) {
        return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"") + "\"";
    }
}
