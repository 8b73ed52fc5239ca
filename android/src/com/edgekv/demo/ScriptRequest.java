package com.edgekv.demo;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

/**
 * A scripted run's input (ScriptActivity's intent extras), checked before anything runs. Scripts
 * name things; they never pass paths: `artifact` is a directory name under files/artifacts,
 * `document_file` a file name under files/, `result` a file name under files/results. A name with
 * a separator, "..", a leading dot or another character outside [A-Za-z0-9._-] is refused, so
 * a caller cannot make the app read or write outside its own directories.
 * Pure Java: tests/test_android_ui.py checks the refusals on a desktop JVM (UiCheck).
 */
public final class ScriptRequest {
    /** The extras, read through the platform's Intent (ScriptActivity) or a map (the host test). */
    public interface Extras {
        boolean has(String key);

        String string(String key);

        /** null when the extra is not a string array */
        String[] strings(String key);

        int integer(String key, int otherwise);
    }

    static final int MAX_NAME = 100;

    public final String artifact;
    public final String documentFile;  /* a name under files/, or null */
    public final String documentText;  /* inline text, or null */
    public final List<String> questions;
    public final int maxNewTokens;
    public final String result;

    private ScriptRequest(String artifact, String documentFile, String documentText, List<String> questions,
                          int maxNewTokens, String result) {
        this.artifact = artifact;
        this.documentFile = documentFile;
        this.documentText = documentText;
        this.questions = questions;
        this.maxNewTokens = maxNewTokens;
        this.result = result;
    }

    /** The request, or IllegalArgumentException naming the extra and what to pass instead. */
    public static ScriptRequest parse(Extras e) {
        String artifact = name("artifact", e.string("artifact"), "a directory under files/artifacts");
        String docFile = e.has("document_file")
                ? name("document_file", e.string("document_file"), "a file under files/") : null;
        String result = e.has("result") ? name("result", e.string("result"), "a file under files/results")
                : "last-run.json";
        List<String> questions = new ArrayList<String>();
        String[] many = e.strings("questions"); /* null when passed as a plain string */
        if (many != null) questions.addAll(Arrays.asList(many));
        else if (e.string("questions") != null) questions.add(e.string("questions"));
        if (e.string("question") != null) questions.add(e.string("question"));
        int maxNew = e.integer("max_new_tokens", 128);
        if (maxNew <= 0) throw new IllegalArgumentException("max_new_tokens " + maxNew + ": pass a positive count");
        return new ScriptRequest(artifact, docFile, e.string("document"), questions, maxNew, result);
    }

    /**
     * `value` when it is a plain file name; otherwise IllegalArgumentException saying what was
     * refused and what to pass.
     */
    public static String name(String extra, String value, String where) {
        if (value == null || value.length() == 0) {
            throw new IllegalArgumentException("--es " + extra + " NAME is missing: pass " + where + " by its name");
        }
        String why = null;
        if (value.startsWith("/")) why = "an absolute path";
        else if (value.equals("..") || value.startsWith("../") || value.endsWith("/..") || value.contains("/../")) {
            why = "a path out of the app's directory (..)";
        } else if (value.indexOf('/') >= 0 || value.indexOf('\\') >= 0) why = "a path";
        else if (value.startsWith(".")) why = "a hidden name";
        else if (value.length() > MAX_NAME) why = "longer than " + MAX_NAME + " characters";
        else {
            for (int i = 0; i < value.length(); i++) {
                char c = value.charAt(i);
                boolean ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.'
                        || c == '_' || c == '-';
                if (!ok) {
                    why = "a name with the character U+" + String.format("%04X", (int) c);
                    break;
                }
            }
        }
        if (why != null) {
            throw new IllegalArgumentException(extra + " \"" + printable(value) + "\" refused: it is " + why
                    + "; pass " + where + " by its name (letters, digits, . _ -)");
        }
        return value;
    }

    private static String printable(String s) {
        StringBuilder b = new StringBuilder();
        for (int i = 0; i < s.length() && i < MAX_NAME; i++) {
            char c = s.charAt(i);
            b.append(c < 0x20 || c == 0x7f ? '?' : c);
        }
        return s.length() > MAX_NAME ? b + "…" : b.toString();
    }
}
