#include "status.h"

#include <stdio.h>
#include <string.h>

const char *ekv_status_string(ekv_status status) {
  switch (status) {
    case EKV_OK: return "ok";
    case EKV_ERR_IO: return "i/o error";
    case EKV_ERR_FORMAT: return "corrupt or unsupported file";
    case EKV_ERR_MISMATCH: return "mismatched artifact";
    case EKV_ERR_INVALID_ARG: return "invalid input";
    case EKV_ERR_NO_MEMORY: return "out of memory";
    case EKV_ERR_KERNEL: return "kernel error";
    case EKV_ERR_CANCELLED: return "cancelled";
    case EKV_ERR_CAPACITY: return "cache full";
    case EKV_ERR_DEVICE: return "device error";
  }
  return "unknown status";
}

ekv_status ekv_fail(ekv_error *err, ekv_status status, const char *fmt, ...) {
  if (err != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return status;
}

void ekv_error_clear(ekv_error *err) {
  if (err != NULL) err->msg[0] = '\0';
}
