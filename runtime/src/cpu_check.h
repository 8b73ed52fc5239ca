/* Does this CPU have what the kernel library was compiled for? Checked before the library is
 * loaded, so a library built for AVX-512 refuses with a message instead of dying on an
 * illegal instruction. */
#ifndef EKV_CPU_CHECK_H
#define EKV_CPU_CHECK_H

#include "status.h"

/* arch: the program's target_arch; features: its comma-separated cpu_features. */
ekv_status ekv_cpu_check(ekv_error *err, const char *arch, const char *features);
/* this runtime's architecture name ("x86_64", "aarch64") */
const char *ekv_host_arch(void);

#endif
