package com.edgekv.demo;

import java.io.BufferedReader;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStreamReader;

/**
 * The process's memory now, from /proc/self/status (Linux and Android): the resident set and its
 * peak (VmRSS, VmHWM; what the runtime's stats call peak RSS). Read while work runs, to show live
 * memory next to the artifact's plan. Pure Java.
 */
public final class MemoryProbe {
    public final long rssBytes, peakRssBytes;

    private MemoryProbe(long rss, long peak) {
        rssBytes = rss;
        peakRssBytes = peak;
    }

    /** The figures now; zeros where /proc cannot be read. */
    public static MemoryProbe now() {
        long rss = 0, peak = 0;
        try {
            BufferedReader r = new BufferedReader(new InputStreamReader(new FileInputStream("/proc/self/status"), "UTF-8"));
            try {
                for (String line; (line = r.readLine()) != null;) {
                    if (line.startsWith("VmRSS:")) rss = kib(line);
                    else if (line.startsWith("VmHWM:")) peak = kib(line);
                }
            } finally {
                r.close();
            }
        } catch (IOException e) {
            return new MemoryProbe(0, 0);
        }
        return new MemoryProbe(rss, peak);
    }

    private static long kib(String line) { /* "VmRSS:	  123456 kB" */
        String[] parts = line.trim().split("\\s+");
        try {
            return parts.length >= 2 ? Long.parseLong(parts[1]) * 1024 : 0;
        } catch (NumberFormatException e) {
            return 0;
        }
    }

    /** "RSS 512.3 MiB (peak 530.0 MiB) · plan 565.0 MiB (0.94x)"; without the plan when it is 0. */
    public String describe(long planBytes) {
        String s = "RSS " + Artifact.mib(rssBytes) + " (peak " + Artifact.mib(peakRssBytes) + ")";
        if (planBytes > 0) {
            s += String.format(java.util.Locale.US, " · plan %s (%.2fx)", Artifact.mib(planBytes),
                    (double) peakRssBytes / planBytes);
        }
        return s;
    }
}
