/* bionic_shim.c: the few places where bionic's ABI differs from glibc's, so that the APK's own
 * libraries (built for aarch64-linux-android against android/native/bionic-symbols.txt) load and
 * run under qemu-aarch64 on an aarch64 glibc (tests/test_android_package.py). Built three times,
 * as libc.so, libm.so and libdl.so (the DT_NEEDED names of the APK's libraries), each linked to
 * glibc's library of the same role, so every other symbol resolves to glibc's function: the
 * libraries' imports are all functions whose ABI the two share (the tests hold each import to the
 * bionic list). Test-only; never shipped.
 *
 *   __errno   bionic's errno accessor (glibc's is __errno_location)
 *   sysconf   bionic numbers the CPU counts 0x60/0x61 (android/native/include/unistd.h), glibc 83/84
 */
#ifdef SHIM_LIBC
#include <errno.h>

long __sysconf(int name);

int *__errno(void) { return &errno; }

long sysconf(int name) {
  if (name == 0x60) return __sysconf(83); /* _SC_NPROCESSORS_CONF */
  if (name == 0x61) return __sysconf(84); /* _SC_NPROCESSORS_ONLN */
  return __sysconf(name);
}
#else
/* libm.so, libdl.so: only their glibc dependency (libm.so.6; dl* live in libc.so.6) */
int edgekv_bionic_shim_marker;
#endif
