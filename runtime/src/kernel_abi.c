#include "kernel_abi.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"

/* ---- what TVM-generated code imports ---------------------------------------------------- */

/* The signatures of TVM's c_backend_api.h (apache-tvm's include/tvm/runtime/c_backend_api.h):
 * the two types the parallel-launch slot uses, declared here so the runtime needs no header
 * from the 300 MB apache-tvm wheel. */
typedef struct {
  void *sync_handle;
  int32_t num_task;
} tvm_parallel_group_env;
typedef int (*tvm_parallel_lambda)(int task_id, tvm_parallel_group_env *penv, void *cdata);

static _Thread_local char t_error[1024];
static _Thread_local ekv_threadpool *t_pool;
static _Thread_local ekv_device *t_device; /* the device of the kernels this thread runs */
static _Thread_local int t_in_parallel;

/* TVM-FFI: a kernel reports an error (wrong shapes, ...) in parts, then returns -1. */
TVM_FFI_DLL void TVMFFIErrorSetRaisedFromCStrParts(const char *kind, const char **parts, int32_t num_parts) {
  size_t used = 0;
  int n = snprintf(t_error, sizeof t_error, "%s: ", kind != NULL ? kind : "Error");
  used = n > 0 ? (size_t)n : 0;
  for (int32_t i = 0; i < num_parts && used + 1 < sizeof t_error; i++) {
    if (parts[i] == NULL) continue;
    size_t len = strlen(parts[i]);
    if (len > sizeof t_error - 1 - used) len = sizeof t_error - 1 - used;
    memcpy(t_error + used, parts[i], len);
    used += len;
  }
  t_error[used < sizeof t_error ? used : sizeof t_error - 1] = '\0';
}

TVM_FFI_DLL void TVMFFIErrorSetRaisedFromCStr(const char *kind, const char *message) {
  const char *parts[1] = {message};
  TVMFFIErrorSetRaisedFromCStrParts(kind, parts, 1);
}

/* A library built as a "system lib" registers its symbols from a constructor when it loads;
 * this runtime finds kernels with dlsym, so there is nothing to keep. */
TVM_FFI_DLL int TVMFFIEnvModRegisterSystemLibSymbol(const char *name, void *symbol) {
  (void)name;
  (void)symbol;
  return 0;
}

const char *ekv_kernel_error(void) { return t_error; }
void ekv_kernel_error_clear(void) { t_error[0] = '\0'; }
void ekv_set_current(ekv_threadpool *pool, ekv_device *device) {
  t_pool = pool;
  t_device = device;
}

/* Host workspaces: kernels allocate and free small ones on nearly every call (SmolLM2: ~20,000 per
 * 128-token block, ~2 KB each, many inside parallel loops), so each thread keeps the blocks it
 * freed and hands them out again — not zeroed, as TVM's own pool does not zero them either —
 * instead of an allocation each time (that cost 2-5 % of prefill). The calling thread's cache is
 * emptied after each program function (ekv_workspace_release); a worker's when it exits. */
#define WS_SLOTS 16
#define WS_MAX_CACHED ((size_t)1 << 20)
typedef struct {
  void *block[WS_SLOTS];
  int n;
} ws_cache;
static pthread_key_t g_ws_key;
static pthread_once_t g_ws_once = PTHREAD_ONCE_INIT;
static _Thread_local ws_cache *t_ws;

static void ws_destroy(void *p) {
  ws_cache *c = p;
  for (int i = 0; i < c->n; i++) ekv_free(c->block[i]);
  ekv_free(c);
}
static void ws_key_init(void) { pthread_key_create(&g_ws_key, ws_destroy); }

static ws_cache *ws_thread_cache(void) {
  if (t_ws == NULL) {
    pthread_once(&g_ws_once, ws_key_init);
    t_ws = ekv_alloc(sizeof *t_ws, EKV_MEM_RUNTIME);
    if (t_ws != NULL) pthread_setspecific(g_ws_key, t_ws); /* freed when the thread exits */
  }
  return t_ws;
}

static void *host_workspace(size_t bytes) {
  ws_cache *c = ws_thread_cache();
  for (int i = 0; c != NULL && i < c->n; i++) {
    size_t have = ekv_alloc_usable(c->block[i]);
    if (have >= bytes && have <= 2 * bytes + 4096) { /* a close fit: no block hoards a larger one */
      void *p = c->block[i];
      c->block[i] = c->block[--c->n];
      return p;
    }
  }
  return ekv_alloc_uninit(bytes ? bytes : 1, EKV_MEM_WORKSPACE);
}

static void host_workspace_free(void *p) {
  ws_cache *c = t_ws;
  if (c != NULL && c->n < WS_SLOTS && ekv_alloc_usable(p) <= WS_MAX_CACHED) c->block[c->n++] = p;
  else ekv_free(p);
}

void ekv_workspace_release(void) {
  if (t_ws == NULL) return;
  for (int i = 0; i < t_ws->n; i++) ekv_free(t_ws->block[i]);
  t_ws->n = 0;
}

/* A kernel's temporary buffer: host memory, or (a GPU build's host code asking for device
 * memory) a buffer of the device the kernels run on. */
static void *alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code_hint, int bits_hint) {
  if (nbytes > SIZE_MAX / 2) return NULL;
  if (device_type == kDLCPU) return host_workspace((size_t)nbytes);
  if (t_device == NULL || t_device->host_memory || (int)t_device->dl.device_type != device_type) return NULL;
  return t_device->alloc(t_device, nbytes ? (size_t)nbytes : 1);
}

static int free_workspace(int device_type, int device_id, void *ptr) {
  if (device_type == kDLCPU) host_workspace_free(ptr);
  else if (t_device != NULL) t_device->free(t_device, ptr);
  return 0;
}

/* The barrier of one parallel launch (TVMBackendParallelBarrier): sense-reversing, spinning
 * briefly, then yielding. */
typedef struct {
  _Atomic int waiting;
  _Atomic int sense;
  int n_tasks;
} launch_barrier;

typedef struct {
  tvm_parallel_lambda fn;
  void *cdata;
  launch_barrier barrier;
} launch_ctx;

static int parallel_barrier(int task_id, tvm_parallel_group_env *penv) {
  launch_barrier *b = penv->sync_handle;
  if (b == NULL || b->n_tasks <= 1) return 0;
  int sense = atomic_load(&b->sense);
  if (atomic_fetch_add(&b->waiting, 1) == b->n_tasks - 1) {
    atomic_store(&b->waiting, 0);
    atomic_store(&b->sense, !sense);
    return 0;
  }
  for (int i = 0; atomic_load(&b->sense) == sense; i++)
    if (i > 1000) sched_yield();
  return 0;
}

/* Calls into another module (a device's kernels): a CPU library has none; a GPU library needs
 * the device runtime (docs/NATIVE.md). */
static int no_imports(void *library_ctx, const char *func_name, void **out) {
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", "the kernel library calls into another module (a device's kernels); "
                               "this runtime runs CPU artifacts only");
  return -1;
}
static int no_function_call(void *func, TVMFFIAny *args, int32_t num_args, TVMFFIAny *result) {
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", "the kernel library calls a function this runtime does not provide");
  return -1;
}
static int init_once(void **handle_addr, int (*init_func)(void **result)) {
  return *handle_addr != NULL ? 0 : init_func(handle_addr);
}

static int run_lambda(int task_id, int n_tasks, void *p) {
  launch_ctx *ctx = p;
  tvm_parallel_group_env env = {&ctx->barrier, n_tasks};
  t_in_parallel = 1;
  int rc = ctx->fn(task_id, &env, ctx->cdata);
  t_in_parallel = 0;
  return rc;
}

static int parallel_launch(tvm_parallel_lambda fn, void *cdata, int num_task) {
  launch_ctx ctx = {.fn = fn, .cdata = cdata};
  if (t_pool == NULL || t_in_parallel) { /* no pool, or a nested loop: one task here */
    tvm_parallel_group_env env = {NULL, 1};
    return fn(0, &env, cdata) != 0 ? -1 : 0;
  }
  /* one task per thread: a barrier inside the lambda needs every task running at once */
  int n = ekv_threadpool_size(t_pool);
  if (num_task > 0 && num_task < n) n = num_task;
  ctx.barrier.n_tasks = n;
  return ekv_threadpool_run(t_pool, n, run_lambda, &ctx) ? -1 : 0;
}

/* ---- loading the library ------------------------------------------------------------------ */

#if defined(__x86_64__)
#define HOST_MACHINE 62
#define HOST_ARCH "x86_64"
#elif defined(__aarch64__)
#define HOST_MACHINE 183
#define HOST_ARCH "aarch64"
#else
#define HOST_MACHINE 0
#define HOST_ARCH "unknown"
#endif

static const char *machine_name(unsigned m) {
  switch (m) {
    case 62: return "x86_64";
    case 183: return "aarch64";
    case 40: return "arm";
    case 164: return "Qualcomm Hexagon";
    case 243: return "riscv";
    default: return "another architecture";
  }
}

static ekv_status check_elf(ekv_error *err, const char *path) {
  unsigned char head[512];
  FILE *f = fopen(path, "rb");
  if (f == NULL) return ekv_fail(err, EKV_ERR_IO, "cannot open the kernel library %s", path);
  size_t n = fread(head, 1, sizeof head, f);
  fclose(f);
  if ((n >= 262 && memcmp(head + 257, "ustar", 5) == 0) || (n >= 2 && head[0] == 0x1f && head[1] == 0x8b))
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s is a tar of object files for another device; link it for that device "
                    "(python -m edgekv.compiler.backend.finish <artifact>) and run it there", path);
  if (n < 20 || memcmp(head, "\177ELF", 4) != 0)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s is not a shared library (no ELF header); recompile the artifact", path);
  unsigned machine = head[5] == 1 ? (unsigned)(head[18] | (head[19] << 8)) : (unsigned)((head[18] << 8) | head[19]);
  if (machine != HOST_MACHINE)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s holds %s code and this runtime runs on %s: compile the artifact for this "
                    "machine (edgekv compile --target host) or run it on a machine of that kind", path,
                    machine_name(machine), HOST_ARCH);
  return EKV_OK;
}

ekv_status ekv_library_open(ekv_error *err, const char *path, ekv_device *device, ekv_library *lib) {
  lib->handle = NULL;
  EKV_TRY(check_elf(err, path));
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) return ekv_fail(err, EKV_ERR_MISMATCH, "cannot load the kernel library: %s", dlerror());
  /* the function-pointer slots TVM's host code calls through; a library without parallel loops,
   * workspaces or imports lacks some: nothing to fill then */
  static const struct { const char *slot; void (*fn)(void); } SLOTS[] = {
      {"__TVMBackendAllocWorkspace", (void (*)(void))alloc_workspace},
      {"__TVMBackendFreeWorkspace", (void (*)(void))free_workspace},
      {"__TVMBackendParallelLaunch", (void (*)(void))parallel_launch},
      {"__TVMBackendParallelBarrier", (void (*)(void))parallel_barrier},
      {"__TVMFFIErrorSetRaisedFromCStr", (void (*)(void))TVMFFIErrorSetRaisedFromCStr},
      /* an Android model.so defines the function it imports as a forwarder through this slot
       * (edgekv/compiler/backend/finish.py, ERROR_SHIM_SOURCE: an app loads the runtime RTLD_LOCAL) */
      {"__TVMFFIErrorSetRaisedFromCStrParts", (void (*)(void))TVMFFIErrorSetRaisedFromCStrParts},
      {"__TVMFFIEnvModLookupFromImports", (void (*)(void))no_imports},
      {"__TVMFFIFunctionCall", (void (*)(void))no_function_call},
      {"__TVMFFIHandleInitOnce", (void (*)(void))init_once},
  };
  for (size_t i = 0; i < sizeof SLOTS / sizeof SLOTS[0]; i++) {
    void (**slot)(void) = dlsym(h, SLOTS[i].slot);
    if (slot != NULL) *slot = SLOTS[i].fn;
  }
  /* a CPU library may carry these slots unused (the refusing stubs above stay in them); a GPU
   * build's host code reaches its kernels through them, so they go to the device */
  if (device->lookup != NULL) {
    void (**lookup)(void) = dlsym(h, "__TVMFFIEnvModLookupFromImports");
    void (**call)(void) = dlsym(h, "__TVMFFIFunctionCall");
    void **ctx = dlsym(h, "__tvm_ffi__library_ctx");
    if (lookup == NULL || call == NULL || ctx == NULL) {
      dlclose(h);
      return ekv_fail(err, EKV_ERR_MISMATCH, "%s launches no device kernels but the program runs on %s: the library "
                      "and the program come from different compiles; recompile the artifact", path, device->name);
    }
    memcpy(lookup, &device->lookup, sizeof *lookup);
    memcpy(call, &device->call, sizeof *call);
    *ctx = device;
  }
  lib->handle = h;
  return EKV_OK;
}

void ekv_library_close(ekv_library *lib) {
  if (lib->handle != NULL) dlclose(lib->handle);
  lib->handle = NULL;
}

ekv_kernel_fn ekv_library_kernel(const ekv_library *lib, const char *name) {
  char sym[512];
  int n = snprintf(sym, sizeof sym, "__tvm_ffi_%s", name);
  if (n <= 0 || (size_t)n >= sizeof sym) return NULL;
  void *p = dlsym(lib->handle, sym);
  ekv_kernel_fn fn;
  memcpy(&fn, &p, sizeof fn); /* object → function pointer without a cast warning */
  return fn;
}
