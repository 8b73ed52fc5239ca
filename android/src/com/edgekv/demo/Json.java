package com.edgekv.demo;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;

/**
 * Just enough JSON for the artifact's manifest.json (read) and the run's result file (written):
 * objects become Maps, arrays Lists, numbers Doubles. Pure Java so the host tests run it too
 * (org.json is Android-only).
 */
public final class Json {
    private final String s;
    private int i;

    private Json(String s) {
        this.s = s;
    }

    public static Object parse(String text) {
        Json p = new Json(text);
        p.space();
        Object v = p.value();
        p.space();
        if (p.i != p.s.length()) throw p.error("text after the JSON value");
        return v;
    }

    private IllegalArgumentException error(String what) {
        return new IllegalArgumentException("bad JSON at character " + i + ": " + what);
    }

    private void space() {
        while (i < s.length() && Character.isWhitespace(s.charAt(i))) i++;
    }

    private Object value() {
        if (i >= s.length()) throw error("unexpected end");
        char c = s.charAt(i);
        if (c == '{') return object();
        if (c == '[') return array();
        if (c == '"') return string();
        if (s.startsWith("true", i)) { i += 4; return Boolean.TRUE; }
        if (s.startsWith("false", i)) { i += 5; return Boolean.FALSE; }
        if (s.startsWith("null", i)) { i += 4; return null; }
        int start = i;
        while (i < s.length() && "+-0123456789.eE".indexOf(s.charAt(i)) >= 0) i++;
        if (start == i) throw error("unexpected '" + c + "'");
        try {
            return Double.valueOf(s.substring(start, i));
        } catch (NumberFormatException e) {
            throw error("bad number");
        }
    }

    private Map<String, Object> object() {
        Map<String, Object> m = new LinkedHashMap<String, Object>();
        i++;
        space();
        if (i < s.length() && s.charAt(i) == '}') { i++; return m; }
        while (true) {
            space();
            if (i >= s.length() || s.charAt(i) != '"') throw error("expected a key");
            String k = string();
            space();
            if (i >= s.length() || s.charAt(i) != ':') throw error("expected ':'");
            i++;
            space();
            m.put(k, value());
            space();
            if (i < s.length() && s.charAt(i) == ',') { i++; continue; }
            if (i < s.length() && s.charAt(i) == '}') { i++; return m; }
            throw error("expected ',' or '}'");
        }
    }

    private List<Object> array() {
        List<Object> a = new ArrayList<Object>();
        i++;
        space();
        if (i < s.length() && s.charAt(i) == ']') { i++; return a; }
        while (true) {
            space();
            a.add(value());
            space();
            if (i < s.length() && s.charAt(i) == ',') { i++; continue; }
            if (i < s.length() && s.charAt(i) == ']') { i++; return a; }
            throw error("expected ',' or ']'");
        }
    }

    private String string() {
        StringBuilder b = new StringBuilder();
        i++;
        while (i < s.length()) {
            char c = s.charAt(i++);
            if (c == '"') return b.toString();
            if (c != '\\') { b.append(c); continue; }
            if (i >= s.length()) break;
            char e = s.charAt(i++);
            switch (e) {
                case 'n': b.append('\n'); break;
                case 't': b.append('\t'); break;
                case 'r': b.append('\r'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'u':
                    if (i + 4 > s.length()) throw error("bad \\u escape");
                    b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
                    i += 4;
                    break;
                default: b.append(e);
            }
        }
        throw error("unterminated string");
    }

    /** A path of keys into nested objects, or null where it is missing. */
    public static Object at(Object root, String... keys) {
        Object v = root;
        for (String k : keys) {
            if (!(v instanceof Map)) return null;
            v = ((Map<?, ?>) v).get(k);
        }
        return v;
    }

    public static String str(Object root, String... keys) {
        Object v = at(root, keys);
        return v == null ? null : v instanceof Double ? number((Double) v) : v.toString();
    }

    public static long num(Object root, long otherwise, String... keys) {
        Object v = at(root, keys);
        return v instanceof Double ? ((Double) v).longValue() : otherwise;
    }

    private static String number(Double d) {
        return d == Math.rint(d) && Math.abs(d) < 1e15 ? Long.toString(d.longValue()) : d.toString();
    }

    /** JSON text of a value (Map, List, String, Number, Boolean, int[] or null). */
    public static String write(Object v) {
        StringBuilder b = new StringBuilder();
        write(b, v);
        return b.toString();
    }

    private static void write(StringBuilder b, Object v) {
        if (v == null) {
            b.append("null");
        } else if (v instanceof String) {
            quote(b, (String) v);
        } else if (v instanceof Double || v instanceof Float) {
            double d = ((Number) v).doubleValue();
            b.append(Double.isNaN(d) || Double.isInfinite(d) ? "null" : String.format(Locale.US, "%.6g", d));
        } else if (v instanceof Number || v instanceof Boolean) {
            b.append(v.toString());
        } else if (v instanceof int[]) {
            int[] a = (int[]) v;
            b.append('[');
            for (int k = 0; k < a.length; k++) b.append(k > 0 ? "," : "").append(a[k]);
            b.append(']');
        } else if (v instanceof Map) {
            b.append('{');
            boolean first = true;
            for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
                if (!first) b.append(',');
                first = false;
                quote(b, String.valueOf(e.getKey()));
                b.append(':');
                write(b, e.getValue());
            }
            b.append('}');
        } else if (v instanceof List) {
            b.append('[');
            boolean first = true;
            for (Object o : (List<?>) v) {
                if (!first) b.append(',');
                first = false;
                write(b, o);
            }
            b.append(']');
        } else {
            quote(b, v.toString());
        }
    }

    private static void quote(StringBuilder b, String s) {
        b.append('"');
        for (int k = 0; k < s.length(); k++) {
            char c = s.charAt(k);
            if (c == '"' || c == '\\') b.append('\\').append(c);
            else if (c == '\n') b.append("\\n");
            else if (c == '\r') b.append("\\r");
            else if (c == '\t') b.append("\\t");
            else if (c < 0x20) b.append(String.format(Locale.US, "\\u%04x", (int) c));
            else b.append(c);
        }
        b.append('"');
    }
}
