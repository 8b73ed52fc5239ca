/* The model and session objects (edgekv.h's ekv_model / ekv_session), shared by model.c,
 * session.c and generate.c. */
#ifndef EKV_MODEL_H
#define EKV_MODEL_H

#include <stdatomic.h>

#include "device.h"
#include "edgekv.h"
#include "kernel_abi.h"
#include "program.h"
#include "reader.h"
#include "status.h"
#include "threadpool.h"

struct ekv_model {
  ekv_error err;
  ekv_program prog;
  ekv_mapped_file params;
  ekv_library lib;
  ekv_kernel_fn *kernels; /* per program kernel, resolved at open */
  ekv_tokenizer *tok;
  ekv_threadpool *pool;
  ekv_device *device;
  void **uploaded; /* per buffer: the device's copy of a weight or constant (the host memory on the CPU) */
  int f_prefill, f_decode, f_prepare;
  int fill_field, pos_field;
  uint32_t kv_dtype; /* how the caches store K and V, as snapshots record it: 0 float32, 1 int8 codes + float16 scales */
  uint64_t cache_bytes, input_bytes, plan_bytes;
  uint32_t program_crc; /* CRC-32 of program.ekv: the artifact a snapshot was made with */
  char *dir;            /* the artifact directory, absolute: recorded in snapshots */
  double load_seconds;
  ekv_thread_choice threads; /* how the pool's size was chosen (threads.c) */
  double verify_seconds; /* checking the weights' checksums at open (0 when a stamp or --no-verify skipped it) */
  int weights_check;     /* EKV_WEIGHTS_UNCHECKED, _CHECKED (this open) or _STAMPED (an earlier open's stamp) */
};

struct ekv_session {
  ekv_error err;
  ekv_model *model;
  void **data;       /* per buffer: where its bytes are */
  DLTensor *tensors; /* per buffer */
  TVMFFIAny *args;   /* per program argument, bound once */
  void *arena;
  void **owned;      /* per buffer: the session's own allocation (caches, inputs), else NULL */
  void **views;      /* per buffer: an arena tensor's device view (released with the session) */
  void **staging;    /* per buffer: the host memory an input is filled in (the buffer itself on the CPU) */
  float *logits_host; /* a device's logits, read back after each step (NULL on the CPU) */
  size_t position;
  const float *logits;
  _Atomic int cancel;
  int allow_beyond_context;
  int32_t stop_ids[8];
  int n_stop_ids; /* -1: the tokenizer's */
  ekv_mapped_file snapshot; /* a loaded cache snapshot the caches point into (copy-on-write) */
  ekv_snapshot_info snapshot_info; /* strings in the mapping */
  ekv_stats stats;
  int32_t *question;  /* a document's question scoring the next prefill's blocks (question_rows ids) */
  size_t question_n;  /* its tokens; 0: none */
};

/* Point the cache buffers at cache_data[buffer id] (NULL: the session's own), views following. */
void ekv_session_bind_caches(ekv_session *s, void *const *cache_data);
/* Unmap a loaded snapshot and point the caches back at the session's own buffers. */
void ekv_snapshot_release(ekv_session *s);
/* A snapshot's header checked against the artifact `m` (only its program is needed: format,
 * checksum, engine, weights, policy, N, B, K/V format, program CRC); the message in `err`. */
ekv_status ekv_snapshot_check_header(ekv_error *err, const ekv_model *m, const char *path);

/* Run one program function: its calls in order, on the model's pool. */
ekv_status ekv_run_function(ekv_session *s, int function);
/* The session buffer of a function's input named `name` (NULL when the function has none). */
void *ekv_function_input(ekv_session *s, int function, const char *name);
double ekv_now(void);

#endif
