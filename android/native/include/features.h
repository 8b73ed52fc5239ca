/* Build-time shim (see errno.h here): under C11 glibc's <stdio.h> renames sscanf/fscanf/scanf to
 * __isoc99_sscanf, ... (its C99-conforming versions), names bionic does not export; bionic's plain
 * sscanf already conforms. Asking for the "deprecated" (unrenamed) declarations keeps the names. */
#include_next <features.h>
#undef __GLIBC_USE_DEPRECATED_SCANF
#define __GLIBC_USE_DEPRECATED_SCANF 1
