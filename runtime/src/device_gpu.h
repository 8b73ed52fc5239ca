/* What the GPU devices (device_opencl.c, device_cuda.c) share: the per-process registry of open
 * devices, one per artifact, the lookup of a device kernel by name, and the walk over a kernel's
 * launch arguments.
 *
 * Registry: models of the same artifact share its library, whose host code caches kernel handles
 * on first use — so they share one device too. A device embeds an `ekv_gpu_entry` and hands the
 * registry three callbacks: open a new device, check an open one against another model's plan,
 * and release one (also a half-opened one, after a failed open). The registry keys entries by the
 * artifact file's real path and counts references; the last close releases.
 *
 * Launch: TVM's host code calls a kernel with its n_args arguments (the kinds the program
 * records: EKV_DARG_*) followed by its launch extents (EKV_TAG_*). `ekv_gpu_launch_args` turns
 * the arguments into typed values, `ekv_gpu_launch_dims` the extents into grid / block / dynamic
 * shared memory; each device then binds them its own way. */
#ifndef EKV_DEVICE_GPU_H
#define EKV_DEVICE_GPU_H

#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <tvm/ffi/c_api.h>

#include "program.h"
#include "status.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

typedef struct ekv_gpu_entry {
  char key[PATH_MAX]; /* the artifact's device source / PTX, as a real path */
  int refs;
  struct ekv_gpu_entry *next;
} ekv_gpu_entry;

typedef struct {
  pthread_mutex_t lock;
  ekv_gpu_entry *head;
  /* a new device for `path` in *out (set, even half-opened, whenever memory was had) */
  ekv_status (*open)(ekv_error *err, const ekv_program *prog, const char *path, uint64_t plan_bytes,
                     ekv_gpu_entry **out);
  /* an open device checked against another model of the same artifact */
  ekv_status (*check)(ekv_error *err, ekv_gpu_entry *entry, const ekv_program *prog, uint64_t plan_bytes);
  void (*release)(ekv_gpu_entry *entry);
} ekv_gpu_registry;

/* The device of `path`: the open one (checked, one reference more) or a new one. */
ekv_status ekv_gpu_registry_open(ekv_gpu_registry *r, ekv_error *err, const ekv_program *prog, const char *path,
                                 uint64_t plan_bytes, ekv_gpu_entry **out);
/* One reference fewer; the last releases the device. */
void ekv_gpu_registry_close(ekv_gpu_registry *r, ekv_gpu_entry *entry);

/* What the library's host code looks up by name: the index of the kernel `name` among `n`
 * kernel records of `stride` bytes, each holding its ekv_device_kernel at `desc_offset`;
 * EKV_GPU_SET_DEVICE for TVM's __tvm_set_device (a no-op: one device per model); EKV_GPU_NO_KERNEL,
 * with TVM's error raised, for a name the program does not list. */
enum { EKV_GPU_SET_DEVICE = -1, EKV_GPU_NO_KERNEL = -2 };
int ekv_gpu_find_kernel(const char *name, const void *kernels, uint32_t n, size_t stride, size_t desc_offset);

/* A whole file (a kernel source, PTX or a cached binary), NUL-terminated, from malloc; NULL if it
 * cannot be read. */
char *ekv_gpu_read_file(const char *path, size_t *size);

#define EKV_GPU_MAX_LAUNCH_ARGS 256

typedef union {
  void *ptr; /* a buffer handle, as DLTensor.data carried it */
  int32_t i32;
  uint32_t u32;
  int64_t i64;
  float f32;
  double f64;
} ekv_gpu_value;

typedef struct {
  unsigned int grid[3], block[3]; /* work-groups, work-items per group */
  unsigned int shared;            /* dynamic shared memory, bytes */
} ekv_gpu_dims;

/* The kernel's arguments as values (values[i] for desc->args[i]); NULL, or what is wrong with the
 * call (the wrong count, a buffer argument that is no pointer). */
const char *ekv_gpu_launch_args(const ekv_device_kernel *desc, const TVMFFIAny *args, int32_t num_args,
                                ekv_gpu_value *values);
/* The launch extents after the arguments; NULL, or what is wrong with them. */
const char *ekv_gpu_launch_dims(const ekv_device_kernel *desc, const TVMFFIAny *args, ekv_gpu_dims *out);

#endif
