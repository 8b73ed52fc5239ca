package android.os;

public class Build {
    /* None of these is a compile-time constant on the phone: the framework reads them from system
     * properties when the class loads. Blank finals, so that javac compiles a read of the real field
     * (sget) instead of inlining a stub's value (android/test/check_stubs.py refuses that). */
    public static final String MODEL;
    public static final String MANUFACTURER;
    public static final String[] SUPPORTED_ABIS;
    static {
        MODEL = null;
        MANUFACTURER = null;
        SUPPORTED_ABIS = null;
    }
    public static class VERSION {
        public static final int SDK_INT;
        public static final String RELEASE;
        static {
            SDK_INT = 0;
            RELEASE = null;
        }
    }
}
