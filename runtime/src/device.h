/* The device interface: where a session's buffers live and how bytes cross between the host
 * and them. The CPU device is plain memory (every buffer is host memory the runtime reads and
 * maps in place); the OpenCL device (device_opencl.c) keeps weights, constants, caches and the
 * arena in device buffers, and only the inputs (token ids, positions) go in and the last token's
 * logits come out — so the session touches buffers only through these calls.
 *
 * A buffer handle is what a kernel's DLTensor.data carries: a pointer for the CPU, a buffer
 * descriptor for OpenCL, a device address for CUDA (TVM's host code passes it back to the
 * device's `call` unchanged). */
#ifndef EKV_DEVICE_H
#define EKV_DEVICE_H

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>
#include <tvm/ffi/c_api.h>

#include "program.h"
#include "status.h"

typedef struct ekv_device ekv_device;

struct ekv_device {
  const char *name; /* "cpu", "opencl: ...", "cuda: ..." */
  DLDevice dl;      /* what the kernels' DLTensors carry */
  int host_memory;  /* buffers are host memory: read, write and map them in place */
  ekv_error err;    /* the last failure's message */
  /* a zero-filled buffer (NULL on failure), and its release */
  void *(*alloc)(ekv_device *d, size_t bytes);
  void (*free)(ekv_device *d, void *buffer);
  /* the bytes at [offset, offset + bytes) of `base` as a buffer of their own (an arena tensor);
   * a read-only device copy of host memory (weights, constants); both released with `drop` */
  void *(*view)(ekv_device *d, void *base, size_t offset, size_t bytes);
  void *(*upload)(ekv_device *d, const void *host, size_t bytes);
  void (*drop)(ekv_device *d, void *handle);
  /* host → device / device → host at a byte offset; EKV_OK or a failure in `err` */
  ekv_status (*write)(ekv_device *d, void *buffer, size_t offset, const void *src, size_t bytes);
  ekv_status (*read)(ekv_device *d, const void *buffer, size_t offset, void *dst, size_t bytes);
  /* what a GPU library's host code calls through (__TVMFFIEnvModLookupFromImports /
   * __TVMFFIFunctionCall): a device kernel by name, and its launch. NULL for the CPU. */
  int (*lookup)(void *library_ctx, const char *name, void **out);
  int (*call)(void *handle, const TVMFFIAny *args, int32_t num_args, TVMFFIAny *result);
  /* wait for the device's queued work: a failure in it is reported here */
  ekv_status (*finish)(ekv_device *d);
  void (*close)(ekv_device *d);
  uint64_t bytes_now, bytes_peak; /* device memory this runtime holds (0 for the CPU: see alloc.c) */
};

ekv_device *ekv_device_cpu(void);

/* The OpenCL device for a GPU program: the ICD loader (libOpenCL) found with dlopen, the first
 * GPU device (else the first device of any type: PoCL's CPU device), the program's kernels built
 * from `source` (or from a binary cached beside it, keyed by the device and the source), every
 * device kernel created, and the plan checked against the device's memory before anything is
 * allocated. A runtime built without OpenCL headers refuses, saying how to build one with. */
ekv_status ekv_device_opencl_open(ekv_error *err, const ekv_program *prog, const char *source_path,
                                  uint64_t plan_bytes, ekv_device **out);

/* The CUDA device for a cuda-host program: the driver (libcuda.so.1) found with dlopen, the GPU
 * EDGEKV_CUDA_DEVICE names (else the first) checked against the PTX's generation and the plan,
 * and the program's kernels JITted from the PTX at `ptx_path`. Always built (it needs no CUDA
 * headers); with no driver or no GPU it refuses, saying what the artifact needs. */
ekv_status ekv_device_cuda_open(ekv_error *err, const ekv_program *prog, const char *ptx_path, uint64_t plan_bytes,
                                ekv_device **out);

/* ekv_runtime_devices() lists the CUDA device after OpenCL's where it is built (not on Android) */
#ifdef EDGEKV_WITH_CUDA
#define EKV_CUDA_DEVICE_NAME ",cuda"
#else
#define EKV_CUDA_DEVICE_NAME ""
#endif

#endif
