/* The CUDA device: a GPU program's weights, constants, caches and arena in CUDA device memory,
 * its kernels loaded from the artifact's PTX (compiled at compile time by NVRTC,
 * edgekv/compiler/backend/cuda_ptx.py) and JITted by the driver for the GPU at hand, and the
 * launches TVM's host code makes (through the library's __TVMFFIFunctionCall slot) turned into
 * cuLaunchKernel calls with the argument kinds and launch tags the program records
 * (edgekv/compiler/backend/device_kernels.py).
 *
 * The CUDA driver (libcuda.so.1) is found at run time with dlopen, and the few driver API types
 * and functions used are declared here from the driver's public, documented C ABI, so this file
 * builds with no CUDA installed and the runtime starts, and runs CPU and OpenCL artifacts,
 * everywhere; only opening a CUDA artifact needs an NVIDIA GPU and its driver.
 *
 * A buffer handle (what DLTensor.data carries, and what the host code hands back to `call`) is the
 * device address itself, as in TVM's own CUDA runtime: an arena tensor is its arena's address plus
 * its offset (no sub-buffers in CUDA). The device keeps a table of its allocations (address, size,
 * references) so that `drop` of a view — whose address may equal its arena's — releases nothing
 * before the last reference goes, and so that device memory is counted as OpenCL's is. Errors
 * inside a launch go to TVM's error slot (the runtime reports them with the kernel's name); errors
 * of the device's own calls go to its `err`. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "device.h"
#include "device_gpu.h"
#include "reader.h"

/* ---- the CUDA driver API, as its public C ABI defines it (cuda.h, CUDA 11+; 64-bit) ---- */
typedef int CUresult; /* CUDA_SUCCESS = 0 */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef int CUjit_option;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_PTX = 218,
  CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
  CU_JIT_INFO_LOG_BUFFER = 3,
  CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4,
  CU_JIT_ERROR_LOG_BUFFER = 5,
  CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6,
};

typedef struct {
  CUresult (*Init)(unsigned int flags);
  CUresult (*DriverGetVersion)(int *version);
  CUresult (*DeviceGetCount)(int *count);
  CUresult (*DeviceGet)(CUdevice *device, int ordinal);
  CUresult (*DeviceGetName)(char *name, int len, CUdevice device);
  CUresult (*DeviceGetAttribute)(int *value, int attribute, CUdevice device);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice device);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice device);
  CUresult (*CtxSetCurrent)(CUcontext ctx);
  CUresult (*CtxSynchronize)(void);
  CUresult (*MemGetInfo)(size_t *free_bytes, size_t *total_bytes);
  CUresult (*MemAlloc)(CUdeviceptr *ptr, size_t bytes);
  CUresult (*MemFree)(CUdeviceptr ptr);
  CUresult (*MemcpyHtoD)(CUdeviceptr dst, const void *src, size_t bytes);
  CUresult (*MemcpyDtoH)(void *dst, CUdeviceptr src, size_t bytes);
  CUresult (*MemsetD8)(CUdeviceptr dst, unsigned char value, size_t bytes);
  CUresult (*ModuleLoadDataEx)(CUmodule *module, const void *image, unsigned int n_options, CUjit_option *options,
                               void **values);
  CUresult (*ModuleUnload)(CUmodule module);
  CUresult (*ModuleGetFunction)(CUfunction *fn, CUmodule module, const char *name);
  CUresult (*FuncSetAttribute)(CUfunction fn, int attribute, int value);
  CUresult (*LaunchKernel)(CUfunction fn, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                           unsigned int by, unsigned int bz, unsigned int shared_bytes, CUstream stream, void **params,
                           void **extra);
  CUresult (*GetErrorString)(CUresult error, const char **str);
} cu_api;

/* the exported names: the _v2 entry points where the driver has them (64-bit sizes and pointers) */
static const char *CU_NAMES[] = {
    "cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName", "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent", "cuCtxSynchronize",
    "cuMemGetInfo_v2", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemsetD8_v2",
    "cuModuleLoadDataEx", "cuModuleUnload", "cuModuleGetFunction", "cuFuncSetAttribute", "cuLaunchKernel",
    "cuGetErrorString"};
_Static_assert(sizeof(cu_api) == sizeof CU_NAMES / sizeof CU_NAMES[0] * sizeof(void (*)(void)), "one name per entry");

#define KERNEL_MAGIC 0x4543554bu /* "ECUK" */
#define MAX_LAUNCH_ARGS EKV_GPU_MAX_LAUNCH_ARGS
#define JIT_LOG_BYTES 8192

typedef struct cuda_device cuda_device;
typedef struct {
  uint32_t magic;
  cuda_device *dev;
  CUfunction fn;          /* NULL: __tvm_set_device, a no-op here (one device per model) */
  ekv_device_kernel desc; /* the device's own copy: it may outlive the model that opened it */
} cuda_kernel;

typedef struct {
  CUdeviceptr ptr;
  size_t bytes;
  uint32_t refs; /* the allocation itself, plus one per view into it */
} cuda_allocation;

struct cuda_device {
  ekv_device base; /* first: an ekv_device * is a cuda_device * */
  cu_api cu;
  CUdevice device;
  CUcontext context; /* the device's primary context, retained */
  CUmodule module;
  cuda_kernel *kernels;
  uint32_t n_kernels;
  char *names; /* the kernels' names and argument kinds, copied from the program */
  cuda_kernel set_device;
  pthread_mutex_t lock; /* the allocation table: sessions of one model may run on several threads */
  cuda_allocation *allocs;
  size_t n_allocs, cap_allocs;
  int trace; /* EDGEKV_CUDA_TRACE=1: every launch on stderr */
  char label[256];
  ekv_gpu_entry entry; /* one device per artifact in a process (device_gpu.h) */
};
static void *g_libcuda; /* loaded once, never closed: the driver keeps threads that dlclose would pull away */
static cu_api g_cu;

static const char *cu_error(const cu_api *cu, CUresult rc) {
  const char *s = NULL;
  if (cu->GetErrorString == NULL || cu->GetErrorString(rc, &s) != CUDA_SUCCESS || s == NULL) return "unknown CUDA error";
  return s;
}

static ekv_status cu_failed(ekv_error *err, const cu_api *cu, const char *what, CUresult rc) {
  return ekv_fail(err, EKV_ERR_DEVICE, "CUDA %s failed: %s (error %d)", what, cu_error(cu, rc), (int)rc);
}

/* The calling thread's current context: the driver keeps one per thread, and the runtime may be
 * called from any thread (a session per thread). */
static _Thread_local CUcontext t_current;
static int make_current(cuda_device *d) {
  if (t_current == d->context) return 1;
  if (d->cu.CtxSetCurrent(d->context) != CUDA_SUCCESS) return 0;
  t_current = d->context;
  return 1;
}

static ekv_status load_api(ekv_error *err) {
  if (g_libcuda != NULL) return EKV_OK;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL)
    return ekv_fail(err, EKV_ERR_DEVICE, "this artifact needs an NVIDIA GPU with the CUDA driver (libcuda.so.1 not "
                    "found): install the NVIDIA driver (it brings libcuda.so.1), or run an artifact compiled with "
                    "--target host (the CPU) or --target opencl-host");
  cu_api cu;
  for (size_t i = 0; i < sizeof CU_NAMES / sizeof CU_NAMES[0]; i++) {
    void *fn = dlsym(lib, CU_NAMES[i]);
    if (fn == NULL)
      return ekv_fail(err, EKV_ERR_DEVICE, "the CUDA driver (libcuda.so.1) lacks %s: it is older than CUDA 11; "
                      "update the NVIDIA driver", CU_NAMES[i]);
    memcpy((char *)&cu + i * sizeof fn, &fn, sizeof fn); /* the i-th entry, in CU_NAMES' order */
  }
  g_cu = cu;
  g_libcuda = lib;
  return EKV_OK;
}

/* The GPU: EDGEKV_CUDA_DEVICE (an ordinal) or the first; its primary context, made current. */
static ekv_status pick_device(ekv_error *err, cuda_device *d) {
  CUresult rc = d->cu.Init(0);
  if (rc == CUDA_ERROR_NO_DEVICE)
    return ekv_fail(err, EKV_ERR_DEVICE, "this artifact needs an NVIDIA GPU and the CUDA driver finds none (%s): "
                    "run it on a machine with an sm_80 or newer GPU, or compile it with --target host",
                    cu_error(&d->cu, rc));
  if (rc != CUDA_SUCCESS) return cu_failed(err, &d->cu, "cuInit", rc);
  int count = 0, ordinal = 0;
  d->cu.DeviceGetCount(&count);
  const char *want = getenv("EDGEKV_CUDA_DEVICE");
  if (want != NULL && want[0] != '\0') ordinal = atoi(want);
  if (count <= 0)
    return ekv_fail(err, EKV_ERR_DEVICE, "this artifact needs an NVIDIA GPU and the CUDA driver finds none");
  if (ordinal < 0 || ordinal >= count)
    return ekv_fail(err, EKV_ERR_DEVICE, "EDGEKV_CUDA_DEVICE=%s: the driver has GPUs 0 to %d", want, count - 1);
  if ((rc = d->cu.DeviceGet(&d->device, ordinal)) != CUDA_SUCCESS) return cu_failed(err, &d->cu, "cuDeviceGet", rc);
  char name[128] = "";
  int major = 0, minor = 0, driver = 0;
  d->cu.DeviceGetName(name, sizeof name - 1, d->device);
  d->cu.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d->device);
  d->cu.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d->device);
  d->cu.DriverGetVersion(&driver);
  snprintf(d->label, sizeof d->label, "cuda: %s (sm_%d%d, driver %d.%d)", name, major, minor, driver / 1000,
           driver % 1000 / 10);
  if ((rc = d->cu.DevicePrimaryCtxRetain(&d->context, d->device)) != CUDA_SUCCESS) {
    d->context = NULL;
    return cu_failed(err, &d->cu, "cuDevicePrimaryCtxRetain", rc);
  }
  if (!make_current(d)) return ekv_fail(err, EKV_ERR_DEVICE, "CUDA cuCtxSetCurrent failed on %s", d->label);
  return EKV_OK;
}

/* The plan against the GPU before anything is allocated: its generation and its free memory. */
static ekv_status check_device(ekv_error *err, cuda_device *d, const ekv_program *prog, uint64_t plan_bytes) {
  const char *arch = ekv_program_str(prog, "device_arch");
  int major = 0, minor = 0;
  d->cu.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d->device);
  d->cu.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d->device);
  int want = strncmp(arch, "sm_", 3) == 0 ? atoi(arch + 3) : 0;
  if (want > 0 && major * 10 + minor < want)
    return ekv_fail(err, EKV_ERR_MISMATCH, "the artifact's kernels are PTX for %s and newer, and %s is older: "
                    "compile it for this GPU with a cuda-host profile whose arch is sm_%d%d", arch, d->label, major, minor);
  size_t free_bytes = 0, total = 0;
  double mib = 1024.0 * 1024.0;
  if (d->cu.MemGetInfo(&free_bytes, &total) == CUDA_SUCCESS && plan_bytes > free_bytes)
    return ekv_fail(err, EKV_ERR_NO_MEMORY, "the memory plan needs %.1f MiB of device memory and %s has %.1f MiB free "
                    "(of %.1f MiB): compile with a smaller --budget or --block", (double)plan_bytes / mib, d->label,
                    (double)free_bytes / mib, (double)total / mib);
  if (ekv_program_int(prog, "arena_align", 0) % 16 != 0 || ekv_program_int(prog, "arena_align", 0) <= 0)
    return ekv_fail(err, EKV_ERR_MISMATCH, "the artifact's arena alignment (%lld) is not a multiple of 16 bytes, "
                    "which the kernels' vector loads need: recompile it with this edgekv",
                    (long long)ekv_program_int(prog, "arena_align", 0));
  for (uint32_t k = 0; k < prog->n_device_kernels; k++)
    if (prog->device_kernels[k].n_args > MAX_LAUNCH_ARGS)
      return ekv_fail(err, EKV_ERR_MISMATCH, "device kernel %s takes %u arguments, more than the %d this runtime "
                      "launches", prog->device_kernels[k].name, prog->device_kernels[k].n_args, MAX_LAUNCH_ARGS);
  return EKV_OK;
}

/* ---- loading the kernels: the PTX, JITted by the driver for this GPU ---------------------- */


static ekv_status load_module(ekv_error *err, cuda_device *d, const char *ptx_path) {
  size_t size = 0;
  char *ptx = ekv_gpu_read_file(ptx_path, &size);
  if (ptx == NULL) return ekv_fail(err, EKV_ERR_IO, "cannot read the device kernels %s", ptx_path);
  char *log = calloc(1, JIT_LOG_BYTES);
  CUjit_option options[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *values[2] = {log, (void *)(uintptr_t)(log != NULL ? JIT_LOG_BYTES : 0)};
  CUresult rc = d->cu.ModuleLoadDataEx(&d->module, ptx, log != NULL ? 2u : 0u, options, values);
  free(ptx);
  ekv_status st = EKV_OK;
  if (rc != CUDA_SUCCESS) {
    d->module = NULL;
    for (char *c = log; c != NULL && *c; c++)
      if (*c == '\n') *c = ' ';
    const char *hint = rc == CUDA_ERROR_UNSUPPORTED_PTX_VERSION
                           ? " (the PTX was written by an NVRTC newer than this driver: update the NVIDIA driver, or "
                             "compile with an older nvidia-cuda-nvrtc-cu12; the manifest's device.ptx.nvrtc names it)"
                           : "";
    st = ekv_fail(err, EKV_ERR_DEVICE, "the PTX %s does not JIT on %s: %s%s: %.200s", ptx_path, d->label,
                  cu_error(&d->cu, rc), hint, log != NULL && log[0] ? log : "(no JIT log)");
  }
  free(log);
  return st;
}

/* Every device kernel the program names, found at open: a missing one fails the load. */
static ekv_status find_kernels(ekv_error *err, cuda_device *d, const ekv_program *prog) {
  d->n_kernels = prog->n_device_kernels;
  d->kernels = ekv_alloc(sizeof(cuda_kernel) * (d->n_kernels + 1u), EKV_MEM_RUNTIME);
  size_t blob = 1;
  for (uint32_t k = 0; k < d->n_kernels; k++) blob += strlen(prog->device_kernels[k].name) + 1 + prog->device_kernels[k].n_args;
  d->names = ekv_alloc(blob, EKV_MEM_RUNTIME);
  if (d->kernels == NULL || d->names == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate the device kernel table");
  char *at = d->names;
  for (uint32_t k = 0; k < d->n_kernels; k++) {
    cuda_kernel *ck = &d->kernels[k];
    const ekv_device_kernel *src = &prog->device_kernels[k];
    ck->magic = KERNEL_MAGIC;
    ck->dev = d;
    ck->desc = *src;
    ck->desc.name = memcpy(at, src->name, strlen(src->name) + 1);
    at += strlen(src->name) + 1;
    ck->desc.args = memcpy(at, src->args, src->n_args);
    at += src->n_args;
    CUresult rc = d->cu.ModuleGetFunction(&ck->fn, d->module, ck->desc.name);
    if (rc != CUDA_SUCCESS || ck->fn == NULL)
      return ekv_fail(err, EKV_ERR_MISMATCH, "the device PTX has no kernel %s (cuModuleGetFunction: %s): the program "
                      "and the PTX come from different compiles; recompile the artifact", ck->desc.name,
                      cu_error(&d->cu, rc));
  }
  d->set_device = (cuda_kernel){.magic = KERNEL_MAGIC, .dev = d};
  return EKV_OK;
}

/* ---- buffers: device addresses, with a table of the allocations behind them --------------- */

static cuda_allocation *containing(cuda_device *d, CUdeviceptr p) {
  for (size_t i = 0; i < d->n_allocs; i++)
    if (p >= d->allocs[i].ptr && p < d->allocs[i].ptr + (d->allocs[i].bytes ? d->allocs[i].bytes : 1)) return &d->allocs[i];
  return NULL;
}

/* A new device allocation of `bytes` (at least one), recorded and counted; 0 on failure. */
static CUdeviceptr allocate(cuda_device *d, size_t bytes, const char *what) {
  CUdeviceptr p = 0;
  if (!make_current(d)) {
    ekv_fail(&d->base.err, EKV_ERR_DEVICE, "CUDA cuCtxSetCurrent failed on %s", d->label);
    return 0;
  }
  CUresult rc = d->cu.MemAlloc(&p, bytes ? bytes : 1);
  if (rc != CUDA_SUCCESS) {
    cu_failed(&d->base.err, &d->cu, what, rc);
    return 0;
  }
  pthread_mutex_lock(&d->lock);
  if (d->n_allocs == d->cap_allocs) {
    size_t cap = d->cap_allocs ? d->cap_allocs * 2 : 256;
    cuda_allocation *grown = ekv_alloc(sizeof *grown * cap, EKV_MEM_RUNTIME);
    if (grown == NULL) {
      pthread_mutex_unlock(&d->lock);
      d->cu.MemFree(p);
      ekv_fail(&d->base.err, EKV_ERR_NO_MEMORY, "out of host memory");
      return 0;
    }
    if (d->n_allocs) memcpy(grown, d->allocs, sizeof *grown * d->n_allocs);
    ekv_free(d->allocs);
    d->allocs = grown;
    d->cap_allocs = cap;
  }
  d->allocs[d->n_allocs++] = (cuda_allocation){p, bytes, 1};
  d->base.bytes_now += bytes;
  if (d->base.bytes_now > d->base.bytes_peak) d->base.bytes_peak = d->base.bytes_now;
  pthread_mutex_unlock(&d->lock);
  return p;
}

static void *cuda_alloc(ekv_device *base, size_t bytes) {
  cuda_device *d = (cuda_device *)base;
  CUdeviceptr p = allocate(d, bytes, "cuMemAlloc");
  if (p == 0) return NULL;
  CUresult rc = d->cu.MemsetD8(p, 0, bytes ? bytes : 1); /* buffers start zero-filled, as the CPU device's do */
  if (rc != CUDA_SUCCESS) {
    cu_failed(&base->err, &d->cu, "cuMemsetD8", rc);
    base->drop(base, (void *)(uintptr_t)p);
    return NULL;
  }
  return (void *)(uintptr_t)p;
}

static void *cuda_upload(ekv_device *base, const void *host, size_t bytes) {
  cuda_device *d = (cuda_device *)base;
  CUdeviceptr p = allocate(d, bytes, "cuMemAlloc (a weight)");
  if (p == 0) return NULL;
  CUresult rc = d->cu.MemcpyHtoD(p, host, bytes);
  if (rc != CUDA_SUCCESS) {
    cu_failed(&base->err, &d->cu, "cuMemcpyHtoD (a weight)", rc);
    base->drop(base, (void *)(uintptr_t)p);
    return NULL;
  }
  return (void *)(uintptr_t)p;
}

static void *cuda_view(ekv_device *base, void *parent, size_t offset, size_t bytes) {
  cuda_device *d = (cuda_device *)base;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)parent + offset;
  pthread_mutex_lock(&d->lock);
  cuda_allocation *a = containing(d, (CUdeviceptr)(uintptr_t)parent);
  int ok = a != NULL && ekv_range_ok(p - a->ptr, bytes, a->bytes);
  if (ok) a->refs++;
  pthread_mutex_unlock(&d->lock);
  if (!ok) {
    ekv_fail(&base->err, EKV_ERR_INVALID_ARG, "a view of %zu bytes at offset %zu lies outside its device buffer", bytes,
             offset);
    return NULL;
  }
  return (void *)(uintptr_t)p;
}

/* One reference fewer to the allocation holding `handle` (an allocation, an upload or a view);
 * the memory goes with the last. */
static void cuda_release(ekv_device *base, void *handle) {
  cuda_device *d = (cuda_device *)base;
  if (handle == NULL) return;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)handle, freed = 0;
  pthread_mutex_lock(&d->lock);
  cuda_allocation *a = containing(d, p);
  if (a == NULL) abort(); /* not a buffer of this device, or released twice: a runtime bug */
  if (--a->refs == 0) {
    freed = a->ptr;
    d->base.bytes_now -= a->bytes;
    *a = d->allocs[--d->n_allocs];
  }
  pthread_mutex_unlock(&d->lock);
  if (freed != 0 && make_current(d)) d->cu.MemFree(freed);
}

static ekv_status cuda_write(ekv_device *base, void *handle, size_t offset, const void *src, size_t bytes) {
  cuda_device *d = (cuda_device *)base;
  if (!make_current(d)) return ekv_fail(&base->err, EKV_ERR_DEVICE, "CUDA cuCtxSetCurrent failed on %s", d->label);
  CUresult rc = d->cu.MemcpyHtoD((CUdeviceptr)(uintptr_t)handle + offset, src, bytes);
  return rc == CUDA_SUCCESS ? EKV_OK : cu_failed(&base->err, &d->cu, "cuMemcpyHtoD", rc);
}

/* A blocking copy on the default stream: it also waits for every kernel launched before it, and
 * reports their failure. */
static ekv_status cuda_read(ekv_device *base, const void *handle, size_t offset, void *dst, size_t bytes) {
  cuda_device *d = (cuda_device *)base;
  if (!make_current(d)) return ekv_fail(&base->err, EKV_ERR_DEVICE, "CUDA cuCtxSetCurrent failed on %s", d->label);
  CUresult rc = d->cu.MemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)handle + offset, bytes);
  return rc == CUDA_SUCCESS ? EKV_OK : cu_failed(&base->err, &d->cu, "cuMemcpyDtoH (after the program's kernels)", rc);
}

static ekv_status cuda_finish(ekv_device *base) {
  cuda_device *d = (cuda_device *)base;
  if (!make_current(d)) return ekv_fail(&base->err, EKV_ERR_DEVICE, "CUDA cuCtxSetCurrent failed on %s", d->label);
  CUresult rc = d->cu.CtxSynchronize();
  return rc == CUDA_SUCCESS ? EKV_OK : cu_failed(&base->err, &d->cu, "cuCtxSynchronize (the program's kernels)", rc);
}

/* ---- what the library's host code calls ------------------------------------------------------ */

static int cuda_lookup(void *library_ctx, const char *name, void **out) {
  cuda_device *d = library_ctx;
  int i = ekv_gpu_find_kernel(name, d->kernels, d->n_kernels, sizeof *d->kernels, offsetof(cuda_kernel, desc));
  if (i == EKV_GPU_NO_KERNEL) return -1;
  *out = i == EKV_GPU_SET_DEVICE ? &d->set_device : &d->kernels[i];
  return 0;
}

static int launch_error(const cuda_kernel *k, const char *what, CUresult rc) {
  char msg[320];
  snprintf(msg, sizeof msg, "device kernel %s: %s%s%s", k->desc.name, what, rc != CUDA_SUCCESS ? ": " : "",
           rc != CUDA_SUCCESS ? cu_error(&k->dev->cu, rc) : "");
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", msg);
  return -1;
}

static int cuda_call(void *handle, const TVMFFIAny *args, int32_t num_args, TVMFFIAny *result) {
  (void)result;
  const cuda_kernel *k = handle;
  if (k == NULL || k->magic != KERNEL_MAGIC) {
    TVMFFIErrorSetRaisedFromCStr("RuntimeError", "the library called a function this runtime does not provide");
    return -1;
  }
  if (k->fn == NULL) return 0; /* __tvm_set_device */
  cuda_device *d = k->dev;
  const ekv_device_kernel *desc = &k->desc;
  ekv_gpu_value values[EKV_GPU_MAX_LAUNCH_ARGS];
  void *params[EKV_GPU_MAX_LAUNCH_ARGS];
  const char *bad = ekv_gpu_launch_args(desc, args, num_args, values);
  for (uint32_t i = 0; bad == NULL && i < desc->n_args; i++)
    params[i] = &values[i]; /* the driver reads each argument's size from the kernel's signature; a buffer's handle
                               is its device address (a pointer's bytes, as CUdeviceptr is on 64-bit hosts) */
  ekv_gpu_dims dims;
  if (bad == NULL) bad = ekv_gpu_launch_dims(desc, args, &dims);
  if (bad != NULL) return launch_error(k, bad, 0);
  unsigned int *grid = dims.grid, *block = dims.block, shared = dims.shared;
  if (!make_current(d)) return launch_error(k, "cuCtxSetCurrent failed", 0);
  if (shared > 48u * 1024u) { /* above the default limit a kernel must opt in */
    CUresult rc = d->cu.FuncSetAttribute(k->fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)shared);
    if (rc != CUDA_SUCCESS) return launch_error(k, "cuFuncSetAttribute (dynamic shared memory)", rc);
  }
  if (d->trace)
    fprintf(stderr, "edgekv cuda: %s grid %ux%ux%u block %ux%ux%u shared %u\n", desc->name, grid[0], grid[1], grid[2],
            block[0], block[1], block[2], shared);
  CUresult rc = d->cu.LaunchKernel(k->fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, NULL, params,
                                   NULL);
  return rc == CUDA_SUCCESS ? 0 : launch_error(k, "cuLaunchKernel", rc);
}

/* ---- lifetime ------------------------------------------------------------------------------- */

static void release(cuda_device *d) {
  if (d == NULL) return;
  if (d->context != NULL && make_current(d)) {
    d->cu.CtxSynchronize();
    for (size_t i = 0; i < d->n_allocs; i++) d->cu.MemFree(d->allocs[i].ptr); /* none left after a clean close */
    if (d->module != NULL) d->cu.ModuleUnload(d->module);
  }
  if (d->context != NULL) {
    d->cu.DevicePrimaryCtxRelease(d->device);
    if (t_current == d->context) t_current = NULL;
  }
  ekv_free(d->allocs);
  ekv_free(d->kernels);
  ekv_free(d->names);
  pthread_mutex_destroy(&d->lock);
  ekv_free(d);
}

static void release_entry(ekv_gpu_entry *e);
static ekv_status open_entry(ekv_error *err, const ekv_program *prog, const char *path, uint64_t plan_bytes,
                             ekv_gpu_entry **out);
static ekv_status check_entry(ekv_error *err, ekv_gpu_entry *e, const ekv_program *prog, uint64_t plan_bytes);
static ekv_gpu_registry g_registry = {PTHREAD_MUTEX_INITIALIZER, NULL, open_entry, check_entry, release_entry};

static cuda_device *of_entry(ekv_gpu_entry *e) {
  return (cuda_device *)(void *)((char *)e - offsetof(cuda_device, entry));
}

static void release_entry(ekv_gpu_entry *e) { release(of_entry(e)); }

static void cuda_close(ekv_device *base) { ekv_gpu_registry_close(&g_registry, &((cuda_device *)base)->entry); }

static ekv_status open_device(ekv_error *err, const ekv_program *prog, const char *ptx_path, uint64_t plan_bytes,
                              cuda_device **out) {
  *out = NULL;
  EKV_TRY(load_api(err));
  cuda_device *d = ekv_alloc(sizeof *d, EKV_MEM_RUNTIME);
  if (d == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "out of memory");
  *out = d;
  d->base = (ekv_device){.name = d->label, .dl = {kDLCUDA, 0}, .host_memory = 0, .alloc = cuda_alloc,
                         .free = cuda_release, .view = cuda_view, .upload = cuda_upload, .drop = cuda_release,
                         .write = cuda_write, .read = cuda_read, .lookup = cuda_lookup, .call = cuda_call,
                         .finish = cuda_finish, .close = cuda_close};
  d->cu = g_cu;
  pthread_mutex_init(&d->lock, NULL);
  snprintf(d->label, sizeof d->label, "cuda");
  d->trace = getenv("EDGEKV_CUDA_TRACE") != NULL && getenv("EDGEKV_CUDA_TRACE")[0] == '1';
  ekv_status st = pick_device(err, d);
  if (st == EKV_OK) st = check_device(err, d, prog, plan_bytes);
  if (st == EKV_OK) st = load_module(err, d, ptx_path);
  if (st == EKV_OK) st = find_kernels(err, d, prog);
  return st;
}

static ekv_status open_entry(ekv_error *err, const ekv_program *prog, const char *path, uint64_t plan_bytes,
                             ekv_gpu_entry **out) {
  cuda_device *d = NULL;
  ekv_status st = open_device(err, prog, path, plan_bytes, &d);
  *out = d != NULL ? &d->entry : NULL;
  return st;
}

static ekv_status check_entry(ekv_error *err, ekv_gpu_entry *e, const ekv_program *prog, uint64_t plan_bytes) {
  return check_device(err, of_entry(e), prog, plan_bytes);
}

ekv_status ekv_device_cuda_open(ekv_error *err, const ekv_program *prog, const char *ptx_path, uint64_t plan_bytes,
                                ekv_device **out) {
  *out = NULL;
  if (prog->n_device_kernels == 0)
    return ekv_fail(err, EKV_ERR_FORMAT, "the program runs on CUDA but lists no device kernels; recompile the artifact");
  ekv_gpu_entry *e = NULL;
  ekv_status st = ekv_gpu_registry_open(&g_registry, err, prog, ptx_path, plan_bytes, &e);
  if (st == EKV_OK) *out = &of_entry(e)->base;
  return st;
}
