/* The OpenCL device: a GPU program's weights, constants, caches and arena in OpenCL buffers,
 * its kernels built from the artifact's OpenCL C once, and the launches TVM's host code makes
 * (through the library's __TVMFFIFunctionCall slot) turned into clEnqueueNDRangeKernel calls
 * with the argument kinds and launch tags the program records (edgekv/compiler/device_kernels.py).
 *
 * OpenCL itself is found at run time (dlopen of the ICD loader, or a phone vendor's libOpenCL),
 * so a runtime built with this backend still starts, and runs CPU artifacts, on a machine
 * without OpenCL; only opening an OpenCL artifact needs it. The headers (Debian
 * opencl-c-headers) are the only build-time need; without them CMake builds device_opencl_none.c.
 *
 * A buffer handle (what DLTensor.data carries, and what the host code hands back to `call`) is a
 * `cl_buffer`: an OpenCL buffer, or a sub-buffer for a tensor inside the arena. Errors inside a
 * launch go to TVM's error slot (the runtime reports them with the kernel's name); errors of the
 * device's own calls go to its `err`. */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "device.h"
#include "device_gpu.h"
#include "reader.h"

#define CL_FN(name) __typeof__(cl##name) *name
typedef struct {
  CL_FN(GetPlatformIDs);
  CL_FN(GetPlatformInfo);
  CL_FN(GetDeviceIDs);
  CL_FN(GetDeviceInfo);
  CL_FN(CreateContext);
  CL_FN(CreateCommandQueue);
  CL_FN(CreateBuffer);
  CL_FN(CreateSubBuffer);
  CL_FN(ReleaseMemObject);
  CL_FN(EnqueueWriteBuffer);
  CL_FN(EnqueueReadBuffer);
  CL_FN(EnqueueFillBuffer);
  CL_FN(CreateProgramWithSource);
  CL_FN(CreateProgramWithBinary);
  CL_FN(BuildProgram);
  CL_FN(GetProgramBuildInfo);
  CL_FN(GetProgramInfo);
  CL_FN(CreateKernel);
  CL_FN(SetKernelArg);
  CL_FN(EnqueueNDRangeKernel);
  CL_FN(Finish);
  CL_FN(ReleaseKernel);
  CL_FN(ReleaseProgram);
  CL_FN(ReleaseCommandQueue);
  CL_FN(ReleaseContext);
} cl_api;

#define BUFFER_MAGIC 0x45434c42u /* "ECLB" */
#define KERNEL_MAGIC 0x45434c4bu /* "ECLK" */

typedef struct {
  uint32_t magic;
  cl_mem mem;
  cl_mem parent; /* a view: the arena buffer it is a sub-buffer of (released after it), else NULL */
  size_t bytes;
  int counted; /* an allocation or upload (counted in bytes_now), not a view */
} cl_buffer;

typedef struct ocl_device ocl_device;
typedef struct {
  uint32_t magic;
  ocl_device *dev;
  cl_kernel kernel; /* NULL: __tvm_set_device, a no-op here (one device per model) */
  ekv_device_kernel desc; /* the device's own copy: it may outlive the model that opened it */
  cl_mem *bound; /* desc.n_args: the buffer each argument holds now (unbound before that buffer's release) */
  uint64_t launches, ns;   /* EDGEKV_OPENCL_PROFILE=1: launches and their device time (profiling events) */
} ocl_kernel;

/* EDGEKV_OPENCL_PROFILE=1: the queue records profiling events; every launch keeps its event until
 * the next drain (a blocking read, a finish, a full list or the close), which adds END - START to
 * its kernel. The three entry points are looked up only then, so cl_api stays OpenCL 1.2's core. */
#define PROFILE_PENDING 1024
typedef struct {
  CL_FN(GetEventProfilingInfo);
  CL_FN(WaitForEvents);
  CL_FN(ReleaseEvent);
  cl_event events[PROFILE_PENDING];
  ocl_kernel *of[PROFILE_PENDING];
  uint32_t n;
} ocl_profile;

struct ocl_device {
  ekv_device base; /* first: an ekv_device * is an ocl_device * */
  cl_api cl;
  void *lib;
  cl_device_id device;
  cl_context context;
  cl_command_queue queue;
  cl_program program;
  cl_program unoptimised; /* PoCL: the eviction kernels' build (see build_program) */
  ocl_kernel *kernels;
  uint32_t n_kernels;
  char *names; /* the kernels' names and argument kinds, copied from the program */
  cl_mem *bound; /* every kernel's bound buffer arguments (ocl_kernel.bound points into it) */
  ocl_kernel set_device;
  size_t base_align;
  int trace; /* EDGEKV_OPENCL_TRACE=1: every launch on stderr (debugging a device's kernels) */
  int trace_release; /* EDGEKV_OPENCL_TRACE_RELEASE=1: every create and release of an OpenCL object on stderr */
  int queued; /* work was enqueued since the last clFinish: finish before releasing anything */
  ocl_profile *profile; /* EDGEKV_OPENCL_PROFILE=1, else NULL: per-kernel device time, printed at close */
  char options[256]; /* the OpenCL C compiler's options (EDGEKV_OPENCL_OPTIONS) */
  char label[256];
  ekv_gpu_entry entry; /* one device per artifact in a process (device_gpu.h) */
};

static const char *LIBRARIES[] = {"libOpenCL.so.1", "libOpenCL.so", "/vendor/lib64/libOpenCL.so",
                                  "/system/vendor/lib64/libOpenCL.so", "/system/lib64/libOpenCL.so"};

static ekv_status cl_failed(ekv_error *err, const char *what, cl_int code) {
  return ekv_fail(err, EKV_ERR_DEVICE, "OpenCL %s failed (error %d)", what, (int)code);
}

/* EDGEKV_OPENCL_TRACE_RELEASE=1: one line per OpenCL object created or released, with its
 * parent (a sub-buffer's buffer, a kernel's program), so that a crash in a driver shows the last
 * object touched. */
static void trace_object(ocl_device *d, const char *what, const void *handle, const void *parent, size_t bytes) {
  fprintf(stderr, "edgekv opencl: %s %p", what, handle);
  if (parent != NULL) fprintf(stderr, " of %p", parent);
  if (bytes != 0) fprintf(stderr, " (%zu bytes)", bytes);
  fprintf(stderr, " [device %p]\n", (const void *)d);
  fflush(stderr);
}

static ekv_status load_api(ekv_error *err, ocl_device *d) {
  for (size_t i = 0; i < sizeof LIBRARIES / sizeof LIBRARIES[0] && d->lib == NULL; i++)
    d->lib = dlopen(LIBRARIES[i], RTLD_NOW | RTLD_LOCAL);
  if (d->lib == NULL)
    return ekv_fail(err, EKV_ERR_DEVICE, "this artifact runs on OpenCL and no OpenCL library was found (libOpenCL.so.1): "
                    "install a GPU's OpenCL driver, or PoCL to run it on the CPU (apt-get install pocl-opencl-icd), "
                    "or compile the artifact with --target host");
  static const char *NAMES[] = {"clGetPlatformIDs", "clGetPlatformInfo", "clGetDeviceIDs", "clGetDeviceInfo",
                                "clCreateContext", "clCreateCommandQueue", "clCreateBuffer", "clCreateSubBuffer",
                                "clReleaseMemObject", "clEnqueueWriteBuffer", "clEnqueueReadBuffer",
                                "clEnqueueFillBuffer", "clCreateProgramWithSource", "clCreateProgramWithBinary",
                                "clBuildProgram", "clGetProgramBuildInfo", "clGetProgramInfo", "clCreateKernel",
                                "clSetKernelArg", "clEnqueueNDRangeKernel", "clFinish", "clReleaseKernel",
                                "clReleaseProgram", "clReleaseCommandQueue", "clReleaseContext"};
  _Static_assert(sizeof(cl_api) == sizeof NAMES / sizeof NAMES[0] * sizeof(void (*)(void)), "one name per entry");
  for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++) {
    void *fn = dlsym(d->lib, NAMES[i]);
    if (fn == NULL)
      return ekv_fail(err, EKV_ERR_DEVICE, "the OpenCL library lacks %s (OpenCL 1.2 is needed)", NAMES[i]);
    memcpy((char *)&d->cl + i * sizeof fn, &fn, sizeof fn); /* the i-th entry, in NAMES' order */
  }
  return EKV_OK;
}

/* The first GPU of any platform, else the first device of any type (PoCL's CPU device);
 * EDGEKV_OPENCL_DEVICE picks the first device whose "platform / device" name contains it. */
static ekv_status pick_device(ekv_error *err, ocl_device *d) {
  cl_platform_id platforms[16];
  cl_uint n_platforms = 0;
  cl_int rc = d->cl.GetPlatformIDs(16, platforms, &n_platforms);
  if (rc != CL_SUCCESS || n_platforms == 0)
    return ekv_fail(err, EKV_ERR_DEVICE, "no OpenCL platform is installed (clGetPlatformIDs: %d): install a GPU's "
                    "OpenCL driver, or PoCL to run on the CPU (apt-get install pocl-opencl-icd)", (int)rc);
  const char *want = getenv("EDGEKV_OPENCL_DEVICE");
  for (int pass = 0; pass < 2; pass++) {
    for (cl_uint p = 0; p < n_platforms && p < 16; p++) {
      cl_device_id devices[16];
      cl_uint n = 0;
      if (d->cl.GetDeviceIDs(platforms[p], pass == 0 ? CL_DEVICE_TYPE_GPU : CL_DEVICE_TYPE_ALL, 16, devices, &n) !=
          CL_SUCCESS)
        continue;
      for (cl_uint i = 0; i < n && i < 16; i++) {
        char pname[96] = "", dname[128] = "";
        d->cl.GetPlatformInfo(platforms[p], CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL);
        d->cl.GetDeviceInfo(devices[i], CL_DEVICE_NAME, sizeof dname - 1, dname, NULL);
        snprintf(d->label, sizeof d->label, "opencl: %s / %s", pname, dname);
        if (want != NULL && want[0] != '\0' && strstr(d->label, want) == NULL) continue;
        d->device = devices[i];
        return EKV_OK;
      }
    }
  }
  return ekv_fail(err, EKV_ERR_DEVICE, "no OpenCL device%s%s%s was found", want ? " matching EDGEKV_OPENCL_DEVICE='" : "",
                  want ? want : "", want ? "'" : "");
}

static cl_ulong device_ulong(ocl_device *d, cl_device_info what) {
  cl_ulong v = 0;
  d->cl.GetDeviceInfo(d->device, what, sizeof v, &v, NULL);
  return v;
}

/* The plan against the device before anything is allocated: its memory, its largest single
 * buffer, and the alignment sub-buffers (arena tensors) need. */
static ekv_status check_device(ekv_error *err, ocl_device *d, const ekv_program *prog, uint64_t plan_bytes) {
  double mib = 1024.0 * 1024.0;
  cl_ulong global = device_ulong(d, CL_DEVICE_GLOBAL_MEM_SIZE), max_alloc = device_ulong(d, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
  cl_uint align_bits = 0;
  d->cl.GetDeviceInfo(d->device, CL_DEVICE_MEM_BASE_ADDR_ALIGN, sizeof align_bits, &align_bits, NULL);
  d->base_align = align_bits / 8u ? align_bits / 8u : 1;
  if (global != 0 && plan_bytes > global)
    return ekv_fail(err, EKV_ERR_NO_MEMORY, "the memory plan needs %.1f MiB of device memory and %s has %.1f MiB: compile "
                    "with a smaller --budget or --block", (double)plan_bytes / mib, d->label, (double)global / mib);
  uint64_t largest = prog->arena_bytes;
  for (uint32_t i = 0; i < prog->n_buffers; i++)
    if (prog->buffers[i].kind != EKV_BUF_VIEW && prog->buffers[i].kind != EKV_BUF_ARENA && prog->buffers[i].nbytes > largest)
      largest = prog->buffers[i].nbytes;
  if (max_alloc != 0 && largest > max_alloc)
    return ekv_fail(err, EKV_ERR_NO_MEMORY, "the artifact needs a %.1f MiB device buffer and %s allocates at most "
                    "%.1f MiB at once: compile with a smaller --budget or --block", (double)largest / mib, d->label,
                    (double)max_alloc / mib);
  int64_t arena_align = ekv_program_int(prog, "arena_align", 0);
  if (arena_align <= 0 || (size_t)arena_align % d->base_align != 0)
    return ekv_fail(err, EKV_ERR_MISMATCH, "the artifact's arena is aligned to %lld bytes and %s needs %zu for "
                    "sub-buffers: recompile it with this edgekv", (long long)arena_align, d->label, d->base_align);
  for (uint32_t k = 0; k < prog->n_device_kernels; k++)
    for (uint32_t t = 0; t < prog->device_kernels[k].n_tags; t++)
      if (prog->device_kernels[k].tags[t] == EKV_TAG_DYN_SHARED)
        return ekv_fail(err, EKV_ERR_MISMATCH, "device kernel %s uses dynamic shared memory, which this runtime does "
                        "not launch", prog->device_kernels[k].name);
  return EKV_OK;
}

/* ---- building the kernels: from a binary cached beside the source, else from the source ---- */


/* <source>.<crc of device, driver, options and source>.bin: only the driver that made a binary reuses it */
static void cache_path(ocl_device *d, const char *source_path, uint32_t source_crc, const char *options, char *out,
                       size_t cap) {
  char key[1024] = "";
  char driver[128] = "";
  d->cl.GetDeviceInfo(d->device, CL_DRIVER_VERSION, sizeof driver - 1, driver, NULL);
  snprintf(key, sizeof key, "%s|%s|%s|%08x", d->label, driver, options, source_crc);
  snprintf(out, cap, "%s.%08x.bin", source_path, ekv_crc32(0, key, strlen(key)));
}

static int build(ocl_device *d, cl_program program, const char *options) {
  return d->cl.BuildProgram(program, 1, &d->device, options, NULL, NULL) == CL_SUCCESS;
}

static cl_program build_from_cache(ocl_device *d, const char *cached, const char *options) {
  size_t size = 0;
  unsigned char *bin = (unsigned char *)ekv_gpu_read_file(cached, &size);
  if (bin == NULL) return NULL;
  cl_int status = 0, rc = 0;
  const unsigned char *bins[1] = {bin};
  cl_program p = d->cl.CreateProgramWithBinary(d->context, 1, &d->device, &size, bins, &status, &rc);
  free(bin);
  if (p == NULL || rc != CL_SUCCESS || status != CL_SUCCESS || !build(d, p, options)) {
    if (p != NULL) d->cl.ReleaseProgram(p);
    return NULL;
  }
  return p;
}

/* Keep the built binary for the next open; a read-only artifact simply builds again. */
static void save_binary(ocl_device *d, cl_program program, const char *cached) {
  size_t size = 0;
  if (d->cl.GetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof size, &size, NULL) != CL_SUCCESS || size == 0)
    return;
  unsigned char *bin = malloc(size);
  unsigned char *bins[1] = {bin};
  char tmp[4200];
  if (bin != NULL && d->cl.GetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof bins, bins, NULL) == CL_SUCCESS &&
      snprintf(tmp, sizeof tmp, "%s.%ld.part", cached, (long)getpid()) < (int)sizeof tmp) {
    FILE *f = fopen(tmp, "wb");
    int ok = f != NULL && fwrite(bin, 1, size, f) == size;
    if (f != NULL) ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, cached) != 0) remove(tmp);
  }
  free(bin);
}

/* A build that failed: the driver's whole log on stderr (it can be long: the size is asked for
 * first), and in the error the log from its first "error" on, as much as the message holds. */
static ekv_status build_failed(ekv_error *err, ocl_device *d, cl_program program, const char *source_path,
                               const char *options) {
  size_t size = 0;
  char *log = NULL;
  if (d->cl.GetProgramBuildInfo(program, d->device, CL_PROGRAM_BUILD_LOG, 0, NULL, &size) == CL_SUCCESS && size > 1 &&
      (log = malloc(size + 1)) != NULL &&
      d->cl.GetProgramBuildInfo(program, d->device, CL_PROGRAM_BUILD_LOG, size, log, NULL) != CL_SUCCESS) {
    free(log);
    log = NULL;
  }
  if (log != NULL) {
    log[size] = '\0';
    fprintf(stderr, "edgekv opencl: build log of %s on %s (options '%s'):\n%s\n", source_path, d->label, options, log);
  }
  const char *from = log != NULL && strstr(log, "error") != NULL ? strstr(log, "error") : log;
  if (from != NULL)
    for (char *c = (char *)from; *c; c++)
      if (*c == '\n' || *c == '\r') *c = ' ';
  ekv_status st = ekv_fail(err, EKV_ERR_DEVICE, "%s does not build on %s%s%s%s: %s", source_path, d->label,
                           options[0] ? " (options '" : "", options, options[0] ? "')" : "",
                           from != NULL && from[0] ? from : "the driver gave no build log");
  free(log);
  return st;
}

/* One build of the device source with `options`: from a binary cached beside the source, else
 * from the source (and the binary kept). */
static ekv_status build_one(ekv_error *err, ocl_device *d, const ekv_program *prog, const char *source_path,
                            const char *options, cl_program *out) {
  char cached[4096];
  cache_path(d, source_path, (uint32_t)ekv_program_int(prog, "device_source_crc32", 0), options, cached, sizeof cached);
  if ((*out = build_from_cache(d, cached, options)) != NULL) {
    if (d->trace_release) trace_object(d, "create program (cached binary)", *out, d->context, 0);
    return EKV_OK;
  }
  size_t size = 0;
  char *source = ekv_gpu_read_file(source_path, &size);
  if (source == NULL) return ekv_fail(err, EKV_ERR_IO, "cannot read the device kernels %s", source_path);
  cl_int rc = 0;
  const char *sources[1] = {source};
  *out = d->cl.CreateProgramWithSource(d->context, 1, sources, &size, &rc);
  free(source);
  if (*out == NULL || rc != CL_SUCCESS) return cl_failed(err, "clCreateProgramWithSource", rc);
  if (d->trace_release) trace_object(d, "create program", *out, d->context, 0);
  if (!build(d, *out, options)) return build_failed(err, d, *out, source_path, options);
  save_binary(d, *out, cached);
  return EKV_OK;
}

/* The program's kernels, built with the device's options. On PoCL, edgekv's eviction kernels come
 * from a second, unoptimised build: PoCL 3.1's optimiser miscompiles the barrier loops of the
 * select and observe kernels (wrong kept sets; each is exact with -cl-opt-disable, shown kernel by
 * kernel by tools/experiments/check_gpu_kernels_pocl.py and end to end by tests/test_opencl.py), while the
 * model's kernels need the optimiser (8x the prefill speed) and are correct with it. */
static ekv_status build_program(ekv_error *err, ocl_device *d, const ekv_program *prog, const char *source_path) {
  EKV_TRY(build_one(err, d, prog, source_path, d->options, &d->program));
  int flagged = 0;
  for (uint32_t k = 0; k < prog->n_device_kernels; k++) flagged |= (prog->device_kernels[k].flags & EKV_DKERNEL_EVICTION) != 0;
  if (flagged && strstr(d->label, "Portable Computing Language") != NULL && getenv("EDGEKV_OPENCL_OPTIONS") == NULL)
    EKV_TRY(build_one(err, d, prog, source_path, "-cl-opt-disable", &d->unoptimised));
  return EKV_OK;
}

/* Every device kernel the program names, created at open: a missing one fails the load. */
static ekv_status create_kernels(ekv_error *err, ocl_device *d, const ekv_program *prog) {
  d->n_kernels = prog->n_device_kernels;
  d->kernels = ekv_alloc(sizeof(ocl_kernel) * (d->n_kernels + 1u), EKV_MEM_RUNTIME);
  size_t blob = 1, n_args = 1;
  for (uint32_t k = 0; k < d->n_kernels; k++) {
    blob += strlen(prog->device_kernels[k].name) + 1 + prog->device_kernels[k].n_args;
    n_args += prog->device_kernels[k].n_args;
  }
  d->names = ekv_alloc(blob, EKV_MEM_RUNTIME);
  d->bound = ekv_alloc(sizeof(cl_mem) * n_args, EKV_MEM_RUNTIME); /* zero-filled: nothing bound */
  if (d->kernels == NULL || d->names == NULL || d->bound == NULL)
    return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate the device kernel table");
  char *at = d->names;
  cl_mem *bound = d->bound;
  for (uint32_t k = 0; k < d->n_kernels; k++) {
    cl_int rc = 0;
    ocl_kernel *ok = &d->kernels[k];
    const ekv_device_kernel *src = &prog->device_kernels[k];
    ok->magic = KERNEL_MAGIC;
    ok->dev = d;
    ok->desc = *src;
    ok->desc.name = memcpy(at, src->name, strlen(src->name) + 1);
    at += strlen(src->name) + 1;
    ok->desc.args = memcpy(at, src->args, src->n_args);
    at += src->n_args;
    ok->bound = bound;
    bound += src->n_args;
    cl_program from = d->unoptimised != NULL && (src->flags & EKV_DKERNEL_EVICTION) ? d->unoptimised : d->program;
    ok->kernel = d->cl.CreateKernel(from, ok->desc.name, &rc);
    if (d->trace_release) trace_object(d, "create kernel", ok->kernel, from, 0);
    if (ok->kernel == NULL || rc != CL_SUCCESS)
      return ekv_fail(err, EKV_ERR_MISMATCH, "the device source has no kernel %s (clCreateKernel: %d): the program "
                      "and the device source come from different compiles; recompile the artifact", ok->desc.name,
                      (int)rc);
  }
  d->set_device = (ocl_kernel){.magic = KERNEL_MAGIC, .dev = d};
  return EKV_OK;
}

/* ---- profiling (EDGEKV_OPENCL_PROFILE=1) ------------------------------------------------------- */

static ekv_status profile_open(ekv_error *err, ocl_device *d) {
  const char *on = getenv("EDGEKV_OPENCL_PROFILE");
  if (on == NULL || on[0] != '1') return EKV_OK;
  d->profile = ekv_alloc(sizeof *d->profile, EKV_MEM_RUNTIME);
  if (d->profile == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate the OpenCL profile");
  memset(d->profile, 0, sizeof *d->profile);
  void *fn[3] = {dlsym(d->lib, "clGetEventProfilingInfo"), dlsym(d->lib, "clWaitForEvents"),
                 dlsym(d->lib, "clReleaseEvent")};
  if (fn[0] == NULL || fn[1] == NULL || fn[2] == NULL)
    return ekv_fail(err, EKV_ERR_DEVICE, "EDGEKV_OPENCL_PROFILE=1: the OpenCL library lacks the event functions");
  memcpy(&d->profile->GetEventProfilingInfo, &fn[0], sizeof fn[0]);
  memcpy(&d->profile->WaitForEvents, &fn[1], sizeof fn[1]);
  memcpy(&d->profile->ReleaseEvent, &fn[2], sizeof fn[2]);
  return EKV_OK;
}

/* Wait for the pending launches and add each one's device time to its kernel. */
static void profile_drain(ocl_device *d) {
  ocl_profile *p = d->profile;
  if (p == NULL || p->n == 0) return;
  p->WaitForEvents(p->n, p->events);
  for (uint32_t i = 0; i < p->n; i++) {
    cl_ulong start = 0, end = 0;
    if (p->GetEventProfilingInfo(p->events[i], CL_PROFILING_COMMAND_START, sizeof start, &start, NULL) == CL_SUCCESS &&
        p->GetEventProfilingInfo(p->events[i], CL_PROFILING_COMMAND_END, sizeof end, &end, NULL) == CL_SUCCESS &&
        end >= start)
      p->of[i]->ns += end - start;
    p->ReleaseEvent(p->events[i]);
  }
  p->n = 0;
}

/* One line per launched kernel, for tools/bench/opencl_launches.py: name, launches, device ns. */
static void profile_report(ocl_device *d) {
  if (d->profile == NULL) return;
  profile_drain(d);
  for (uint32_t k = 0; d->kernels != NULL && k < d->n_kernels; k++)
    if (d->kernels[k].launches > 0)
      fprintf(stderr, "edgekv opencl profile: %s launches %llu ns %llu\n", d->kernels[k].desc.name,
              (unsigned long long)d->kernels[k].launches, (unsigned long long)d->kernels[k].ns);
  ekv_free(d->profile);
  d->profile = NULL;
}

/* ---- buffers -------------------------------------------------------------------------------- */

/* Teardown, the same on every driver: nothing is released while the queue may still use it (the
 * queue is finished first), no kernel keeps a released buffer as an argument, views (sub-buffers)
 * go before the arena they are cut from, and a handle is never used after its release. */
static void drain(ocl_device *d) {
  if (d->queued && d->queue != NULL) d->cl.Finish(d->queue);
  d->queued = 0;
}

/* Kernels are shared by every session of the model; a buffer about to be released leaves the
 * argument slots it was set in (an OpenCL driver may keep, or look at, what a kernel holds). */
static void unbind(ocl_device *d, cl_mem mem) {
  static const cl_mem none = NULL;
  for (uint32_t k = 0; d->kernels != NULL && k < d->n_kernels; k++) {
    ocl_kernel *ok = &d->kernels[k];
    for (uint32_t i = 0; ok->bound != NULL && ok->kernel != NULL && i < ok->desc.n_args; i++)
      if (ok->bound[i] == mem) {
        d->cl.SetKernelArg(ok->kernel, i, sizeof none, &none);
        ok->bound[i] = NULL;
      }
  }
}

static void count(ocl_device *d, size_t bytes, int sign) {
  if (sign > 0) {
    d->base.bytes_now += bytes;
    if (d->base.bytes_now > d->base.bytes_peak) d->base.bytes_peak = d->base.bytes_now;
  } else {
    d->base.bytes_now -= bytes;
  }
}

static cl_buffer *wrap(ocl_device *d, cl_mem mem, cl_mem parent, size_t bytes, int counted) {
  cl_buffer *b = ekv_alloc(sizeof *b, EKV_MEM_RUNTIME);
  if (b == NULL) {
    if (d->trace_release) trace_object(d, "release", mem, parent, bytes);
    d->cl.ReleaseMemObject(mem);
    ekv_fail(&d->base.err, EKV_ERR_NO_MEMORY, "out of host memory");
    return NULL;
  }
  *b = (cl_buffer){BUFFER_MAGIC, mem, parent, bytes, counted};
  if (counted) count(d, bytes, +1);
  return b;
}

static void *ocl_alloc(ekv_device *base, size_t bytes) {
  ocl_device *d = (ocl_device *)base;
  cl_int rc = 0;
  cl_mem mem = d->cl.CreateBuffer(d->context, CL_MEM_READ_WRITE, bytes, NULL, &rc);
  if (mem == NULL || rc != CL_SUCCESS) {
    cl_failed(&base->err, "clCreateBuffer", rc);
    return NULL;
  }
  static const unsigned char zero = 0; /* buffers start zero-filled, as the CPU device's do */
  if (d->trace_release) trace_object(d, "create buffer", mem, NULL, bytes);
  rc = d->cl.EnqueueFillBuffer(d->queue, mem, &zero, 1, 0, bytes, 0, NULL, NULL);
  d->queued = 1;
  if (rc != CL_SUCCESS) {
    drain(d);
    if (d->trace_release) trace_object(d, "release buffer", mem, NULL, bytes);
    d->cl.ReleaseMemObject(mem);
    cl_failed(&base->err, "clEnqueueFillBuffer", rc);
    return NULL;
  }
  return wrap(d, mem, NULL, bytes, 1);
}

static void *ocl_upload(ekv_device *base, const void *host, size_t bytes) {
  ocl_device *d = (ocl_device *)base;
  cl_int rc = 0;
  cl_mem mem = d->cl.CreateBuffer(d->context, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, bytes, (void *)(uintptr_t)host, &rc);
  if (mem == NULL || rc != CL_SUCCESS) {
    cl_failed(&base->err, "clCreateBuffer (a weight)", rc);
    return NULL;
  }
  if (d->trace_release) trace_object(d, "create weight buffer", mem, NULL, bytes);
  return wrap(d, mem, NULL, bytes, 1);
}

static void *ocl_view(ekv_device *base, void *parent, size_t offset, size_t bytes) {
  ocl_device *d = (ocl_device *)base;
  cl_buffer *p = parent;
  if (offset % d->base_align != 0) {
    ekv_fail(&base->err, EKV_ERR_MISMATCH, "an arena tensor at offset %zu is not aligned to the %zu bytes the device "
             "needs; recompile the artifact", offset, d->base_align);
    return NULL;
  }
  cl_buffer_region region = {offset, bytes};
  cl_int rc = 0;
  cl_mem mem = d->cl.CreateSubBuffer(p->mem, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &region, &rc);
  if (mem == NULL || rc != CL_SUCCESS) {
    cl_failed(&base->err, "clCreateSubBuffer", rc);
    return NULL;
  }
  if (d->trace_release) trace_object(d, "create sub-buffer", mem, p->mem, bytes);
  return wrap(d, mem, p->mem, bytes, 0);
}

static void ocl_free(ekv_device *base, void *handle) {
  ocl_device *d = (ocl_device *)base;
  cl_buffer *b = handle;
  if (b == NULL) return;
  if (b->magic != BUFFER_MAGIC) abort(); /* not a buffer of this device (or freed twice): a runtime bug */
  drain(d);
  unbind(d, b->mem);
  if (d->trace_release) trace_object(d, b->parent != NULL ? "release sub-buffer" : "release buffer", b->mem, b->parent, b->bytes);
  d->cl.ReleaseMemObject(b->mem);
  if (b->counted) count(d, b->bytes, -1);
  b->magic = 0;
  ekv_free(b);
}

static ekv_status ocl_write(ekv_device *base, void *handle, size_t offset, const void *src, size_t bytes) {
  ocl_device *d = (ocl_device *)base;
  cl_buffer *b = handle;
  if (!ekv_range_ok(offset, bytes, b->bytes)) return ekv_fail(&base->err, EKV_ERR_INVALID_ARG, "write past a buffer");
  cl_int rc = d->cl.EnqueueWriteBuffer(d->queue, b->mem, CL_TRUE, offset, bytes, src, 0, NULL, NULL);
  return rc == CL_SUCCESS ? EKV_OK : cl_failed(&base->err, "clEnqueueWriteBuffer", rc);
}

/* A blocking read: it also waits for every kernel queued before it, and reports their failure. */
static ekv_status ocl_read(ekv_device *base, const void *handle, size_t offset, void *dst, size_t bytes) {
  ocl_device *d = (ocl_device *)base;
  const cl_buffer *b = handle;
  if (!ekv_range_ok(offset, bytes, b->bytes)) return ekv_fail(&base->err, EKV_ERR_INVALID_ARG, "read past a buffer");
  cl_int rc = d->cl.EnqueueReadBuffer(d->queue, b->mem, CL_TRUE, offset, bytes, dst, 0, NULL, NULL);
  if (rc == CL_SUCCESS) d->queued = 0; /* an in-order queue: everything before the read is done */
  profile_drain(d);
  return rc == CL_SUCCESS ? EKV_OK : cl_failed(&base->err, "clEnqueueReadBuffer (after the program's kernels)", rc);
}

static ekv_status ocl_finish(ekv_device *base) {
  ocl_device *d = (ocl_device *)base;
  cl_int rc = d->cl.Finish(d->queue);
  if (rc == CL_SUCCESS) d->queued = 0;
  profile_drain(d);
  return rc == CL_SUCCESS ? EKV_OK : cl_failed(&base->err, "clFinish", rc);
}

/* ---- what the library's host code calls ------------------------------------------------------ */

static int ocl_lookup(void *library_ctx, const char *name, void **out) {
  ocl_device *d = library_ctx;
  int i = ekv_gpu_find_kernel(name, d->kernels, d->n_kernels, sizeof *d->kernels, offsetof(ocl_kernel, desc));
  if (i == EKV_GPU_NO_KERNEL) return -1;
  *out = i == EKV_GPU_SET_DEVICE ? &d->set_device : &d->kernels[i];
  return 0;
}

static int launch_error(const ocl_kernel *k, const char *what, cl_int rc) {
  char msg[256];
  snprintf(msg, sizeof msg, "device kernel %s: %s (OpenCL error %d)", k->desc.name, what, (int)rc);
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", msg);
  return -1;
}

static int ocl_call(void *handle, const TVMFFIAny *args, int32_t num_args, TVMFFIAny *result) {
  const ocl_kernel *k = handle;
  if (k == NULL || k->magic != KERNEL_MAGIC) {
    TVMFFIErrorSetRaisedFromCStr("RuntimeError", "the library called a function this runtime does not provide");
    return -1;
  }
  if (k->kernel == NULL) return 0; /* __tvm_set_device */
  ocl_device *d = k->dev;
  const ekv_device_kernel *desc = &k->desc;
  ekv_gpu_value values[EKV_GPU_MAX_LAUNCH_ARGS];
  ekv_gpu_dims dims;
  const char *bad = ekv_gpu_launch_args(desc, args, num_args, values);
  if (bad == NULL) bad = ekv_gpu_launch_dims(desc, args, &dims);
  if (bad == NULL && dims.shared != 0) bad = "dynamic shared memory (OpenCL kernels declare theirs)";
  if (bad != NULL) return launch_error(k, bad, 0);
  for (uint32_t i = 0; i < desc->n_args; i++) {
    const ekv_gpu_value *v = &values[i];
    cl_int rc;
    switch (desc->args[i]) {
      case EKV_DARG_BUFFER: {
        const cl_buffer *b = v->ptr;
        if (b->magic != BUFFER_MAGIC) return launch_error(k, "a buffer argument is not a device buffer", 0);
        rc = d->cl.SetKernelArg(k->kernel, i, sizeof(cl_mem), &b->mem);
        k->bound[i] = b->mem;
        break;
      }
      case EKV_DARG_I32: rc = d->cl.SetKernelArg(k->kernel, i, sizeof(cl_int), &v->i32); break;
      case EKV_DARG_U32: rc = d->cl.SetKernelArg(k->kernel, i, sizeof(cl_uint), &v->u32); break;
      case EKV_DARG_I64: rc = d->cl.SetKernelArg(k->kernel, i, sizeof(cl_long), &v->i64); break;
      case EKV_DARG_F32: rc = d->cl.SetKernelArg(k->kernel, i, sizeof(cl_float), &v->f32); break;
      default: rc = d->cl.SetKernelArg(k->kernel, i, sizeof(cl_double), &v->f64); break;
    }
    if (rc != CL_SUCCESS) return launch_error(k, "clSetKernelArg", rc);
  }
  size_t groups[3], local[3], global[3];
  for (int i = 0; i < 3; i++) {
    groups[i] = dims.grid[i];
    local[i] = dims.block[i];
    global[i] = groups[i] * local[i];
  }
  if (d->trace)
    fprintf(stderr, "edgekv opencl: %s groups %zux%zux%zu local %zux%zux%zu\n", desc->name, groups[0], groups[1],
            groups[2], local[0], local[1], local[2]);
  ocl_profile *p = d->profile;
  if (p != NULL && p->n == PROFILE_PENDING) profile_drain(d);
  cl_event *event = p != NULL ? &p->events[p->n] : NULL;
  cl_int rc = d->cl.EnqueueNDRangeKernel(d->queue, k->kernel, 3, NULL, global, local, 0, NULL, event);
  if (rc != CL_SUCCESS) return launch_error(k, "clEnqueueNDRangeKernel", rc);
  d->queued = 1;
  if (p != NULL) {
    p->of[p->n++] = (ocl_kernel *)k; /* the device's own table entry */
    ((ocl_kernel *)k)->launches++;
  }
  return 0;
}

/* ---- lifetime ------------------------------------------------------------------------------- */

const char *ekv_runtime_devices(void) { return "cpu,opencl" EKV_CUDA_DEVICE_NAME; }

/* The device's own objects, in reverse order of creation, once its queue is finished: kernels,
 * then the programs they came from, the queue, the context. Every buffer was released before
 * (sessions and the model drop theirs before closing the device). */
static void release(ocl_device *d) {
  if (d == NULL) return;
  profile_report(d);
  if (d->queue != NULL) d->cl.Finish(d->queue);
  d->queued = 0;
  for (uint32_t k = d->n_kernels; d->kernels != NULL && k-- > 0;)
    if (d->kernels[k].kernel != NULL) {
      if (d->trace_release) trace_object(d, "release kernel", d->kernels[k].kernel, NULL, 0);
      d->cl.ReleaseKernel(d->kernels[k].kernel);
      d->kernels[k].kernel = NULL;
    }
  ekv_free(d->kernels);
  ekv_free(d->names);
  ekv_free(d->bound);
  d->kernels = NULL;
  if (d->unoptimised != NULL) {
    if (d->trace_release) trace_object(d, "release program", d->unoptimised, NULL, 0);
    d->cl.ReleaseProgram(d->unoptimised);
  }
  if (d->program != NULL) {
    if (d->trace_release) trace_object(d, "release program", d->program, NULL, 0);
    d->cl.ReleaseProgram(d->program);
  }
  if (d->queue != NULL) {
    if (d->trace_release) trace_object(d, "release queue", d->queue, NULL, 0);
    d->cl.ReleaseCommandQueue(d->queue);
  }
  if (d->context != NULL) {
    if (d->trace_release) trace_object(d, "release context", d->context, NULL, 0);
    d->cl.ReleaseContext(d->context);
  }
  /* the ICD loader stays loaded: drivers keep threads and handlers that dlclose would pull away */
  ekv_free(d);
}

static void release_entry(ekv_gpu_entry *e);
static ekv_status open_entry(ekv_error *err, const ekv_program *prog, const char *path, uint64_t plan_bytes,
                             ekv_gpu_entry **out);
static ekv_status check_entry(ekv_error *err, ekv_gpu_entry *e, const ekv_program *prog, uint64_t plan_bytes);
static ekv_gpu_registry g_registry = {PTHREAD_MUTEX_INITIALIZER, NULL, open_entry, check_entry, release_entry};

static ocl_device *of_entry(ekv_gpu_entry *e) { return (ocl_device *)(void *)((char *)e - offsetof(ocl_device, entry)); }

static void release_entry(ekv_gpu_entry *e) { release(of_entry(e)); }

static void ocl_close(ekv_device *base) { ekv_gpu_registry_close(&g_registry, &((ocl_device *)base)->entry); }

static ekv_status open_device(ekv_error *err, const ekv_program *prog, const char *source_path,
                              uint64_t plan_bytes, ocl_device **out) {
  ocl_device *d = ekv_alloc(sizeof *d, EKV_MEM_RUNTIME);
  *out = d;
  if (d == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "out of memory");
  d->base = (ekv_device){.name = d->label, .dl = {kDLOpenCL, 0}, .host_memory = 0, .alloc = ocl_alloc,
                         .free = ocl_free, .view = ocl_view, .upload = ocl_upload, .drop = ocl_free,
                         .write = ocl_write, .read = ocl_read, .lookup = ocl_lookup, .call = ocl_call,
                         .finish = ocl_finish, .close = ocl_close};
  snprintf(d->label, sizeof d->label, "opencl");
  d->trace = getenv("EDGEKV_OPENCL_TRACE") != NULL && getenv("EDGEKV_OPENCL_TRACE")[0] == '1';
  d->trace_release = getenv("EDGEKV_OPENCL_TRACE_RELEASE") != NULL && getenv("EDGEKV_OPENCL_TRACE_RELEASE")[0] == '1';

  ekv_status st = load_api(err, d);
  if (st == EKV_OK) st = pick_device(err, d);
  if (st == EKV_OK) st = check_device(err, d, prog, plan_bytes);
  /* EDGEKV_OPENCL_OPTIONS: the OpenCL C compiler's options for every kernel (then no PoCL special case) */
  const char *options = getenv("EDGEKV_OPENCL_OPTIONS");
  snprintf(d->options, sizeof d->options, "%s", options != NULL ? options : "");
  cl_int rc = CL_SUCCESS;
  if (st == EKV_OK) {
    d->context = d->cl.CreateContext(NULL, 1, &d->device, NULL, NULL, &rc);
    if (d->trace_release) trace_object(d, "create context", d->context, NULL, 0);
    if (d->context == NULL || rc != CL_SUCCESS) st = cl_failed(err, "clCreateContext", rc);
  }
  if (st == EKV_OK) st = profile_open(err, d);
  if (st == EKV_OK) {
    cl_command_queue_properties props = d->profile != NULL ? CL_QUEUE_PROFILING_ENABLE : 0;
    d->queue = d->cl.CreateCommandQueue(d->context, d->device, props, &rc);
    if (d->trace_release) trace_object(d, "create queue", d->queue, d->context, 0);
    if (d->queue == NULL || rc != CL_SUCCESS) st = cl_failed(err, "clCreateCommandQueue", rc);
  }
  if (st == EKV_OK) st = build_program(err, d, prog, source_path);
  if (st == EKV_OK) st = create_kernels(err, d, prog);
  return st;
}

static ekv_status open_entry(ekv_error *err, const ekv_program *prog, const char *path, uint64_t plan_bytes,
                             ekv_gpu_entry **out) {
  ocl_device *d = NULL;
  ekv_status st = open_device(err, prog, path, plan_bytes, &d);
  *out = d != NULL ? &d->entry : NULL;
  return st;
}

static ekv_status check_entry(ekv_error *err, ekv_gpu_entry *e, const ekv_program *prog, uint64_t plan_bytes) {
  return check_device(err, of_entry(e), prog, plan_bytes);
}

ekv_status ekv_device_opencl_open(ekv_error *err, const ekv_program *prog, const char *source_path,
                                  uint64_t plan_bytes, ekv_device **out) {
  *out = NULL;
  if (prog->n_device_kernels == 0)
    return ekv_fail(err, EKV_ERR_FORMAT, "the program runs on OpenCL but lists no device kernels; recompile the artifact");
  ekv_gpu_entry *e = NULL;
  ekv_status st = ekv_gpu_registry_open(&g_registry, err, prog, source_path, plan_bytes, &e);
  if (st == EKV_OK) *out = &of_entry(e)->base;
  return st;
}
