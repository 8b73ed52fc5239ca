/* Build-time shim (see errno.h here): bionic's sysconf numbers for the CPU counts differ from
 * glibc's (84/83). */
#include_next <unistd.h>
#undef _SC_NPROCESSORS_CONF
#undef _SC_NPROCESSORS_ONLN
#define _SC_NPROCESSORS_CONF 0x60
#define _SC_NPROCESSORS_ONLN 0x61
