/* Build-time shim (freestanding Android build, android/build.sh): the aarch64 glibc headers stand
 * in for bionic's, which only the NDK ships (docs/NATIVE.md, "Android without the NDK"). bionic's
 * errno is *__errno(); glibc's __errno_location is not exported by bionic. */
#include_next <errno.h>
#undef errno
extern int *__errno(void);
#define errno (*__errno())
