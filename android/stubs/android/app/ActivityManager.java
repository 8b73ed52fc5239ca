package android.app;

public class ActivityManager {
    ActivityManager() { throw new RuntimeException("Stub!"); }
    public void getMemoryInfo(MemoryInfo outInfo) { throw new RuntimeException("Stub!"); }
    public static class MemoryInfo {
        public long availMem;
        public long threshold;
        public long totalMem;
        public boolean lowMemory;
        public MemoryInfo() { throw new RuntimeException("Stub!"); }
    }
}
