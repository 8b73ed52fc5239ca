/* The manifest's minimal check (manifest_check.c): complete, and agreeing with program.ekv. */
#ifndef EKV_MANIFEST_CHECK_H
#define EKV_MANIFEST_CHECK_H

#include "program.h"
#include "status.h"

ekv_status ekv_manifest_check(ekv_error *err, const char *dir, const ekv_program *prog);

#endif
