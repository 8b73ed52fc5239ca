package android;

/* Framework resource ids the app uses; each value is checked against framework-res.apk by
 * tests/test_android_app.py (javac inlines these constants into the app's code). */
public final class R {
    public static final class attr {
        public static final int progressBarStyleHorizontal = 0x01010078;
    }
    public static final class drawable {
        public static final int ic_menu_close_clear_cancel = 0x01080038;
        public static final int stat_sys_download = 0x01080081;
    }
    public static final class layout {
        public static final int simple_spinner_item = 0x01090008;
        public static final int simple_spinner_dropdown_item = 0x01090009;
    }
}
