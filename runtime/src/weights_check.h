/* Weight verification at open (weights_check.c): each weight's CRC-32 against program.ekv, or a
 * stamp of an earlier clean check of the same file. */
#ifndef EKV_WEIGHTS_CHECK_H
#define EKV_WEIGHTS_CHECK_H

#include "model.h"

/* mode: EKV_VERIFY_*; needs m->params mapped, m->program_crc and m->pool set */
ekv_status ekv_weights_verify(ekv_model *m, const char *dir, const char *params_path, int mode);

#endif
