/* The TVM-generated kernel library (model.so): TVM-FFI's packed C calling convention and the
 * few functions such a library imports from its runtime — provided here, so neither
 * libtvm_runtime nor libtvm_ffi is needed (docs/NATIVE.md says why and what was measured).
 *
 *   exported by model.so    __tvm_ffi_<kernel>(self, const TVMFFIAny *args, int n, TVMFFIAny *ret)
 *   slots model.so exports  __TVMBackendAllocWorkspace, __TVMBackendFreeWorkspace,
 *   and we fill             __TVMBackendParallelLaunch (function pointers)
 *   imported by model.so    TVMFFIErrorSetRaisedFromCStrParts (defined in kernel_abi.c) */
#ifndef EKV_KERNEL_ABI_H
#define EKV_KERNEL_ABI_H

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

#include "device.h"
#include "status.h"
#include "threadpool.h"

typedef int (*ekv_kernel_fn)(void *self, const TVMFFIAny *args, int32_t num_args, TVMFFIAny *result);

typedef struct ekv_library {
  void *handle;
} ekv_library;

/* Check that `path` is a shared library for this machine's architecture (ELF header read
 * before dlopen: an aarch64 library, or a .tar of device objects, is refused with what it is),
 * dlopen it and fill its runtime slots — for a GPU build, the device's kernel lookup and launch. */
ekv_status ekv_library_open(ekv_error *err, const char *path, ekv_device *device, ekv_library *lib);
void ekv_library_close(ekv_library *lib);
/* __tvm_ffi_<name>, or NULL */
ekv_kernel_fn ekv_library_kernel(const ekv_library *lib, const char *name);

/* The pool TVM's parallel loops run on and the device device workspaces come from, while the
 * calling thread executes kernels (thread-local: each session's runner sets its model's). */
void ekv_set_current(ekv_threadpool *pool, ekv_device *device);
/* Free the kernel workspaces this thread keeps for reuse (after a program function). */
void ekv_workspace_release(void);
/* The message the last failing kernel left on this thread ("" when none); cleared by reading. */
const char *ekv_kernel_error(void);
void ekv_kernel_error_clear(void);

#endif
