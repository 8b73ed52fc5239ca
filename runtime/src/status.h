/* Status codes and per-handle error messages. */
#ifndef EKV_STATUS_H
#define EKV_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#include "edgekv.h"

#define EKV_ERR_LEN 512

/* A per-handle error message. Every handle embeds one; nothing global. */
typedef struct ekv_error {
  char msg[EKV_ERR_LEN];
} ekv_error;

/* Sets err's message (printf format) and returns status, so a failure reads
 * `return ekv_fail(&h->err, EKV_ERR_FORMAT, "...", ...);` */
ekv_status ekv_fail(ekv_error *err, ekv_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void ekv_error_clear(ekv_error *err);

/* Propagate a failed status unchanged (its message is already set). */
#define EKV_TRY(expr)                   \
  do {                                  \
    ekv_status ekv_try_s_ = (expr);     \
    if (ekv_try_s_ != EKV_OK) return ekv_try_s_; \
  } while (0)

#endif
