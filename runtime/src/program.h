/* program.ekv: parsed and validated once at load (edgekv/artifact/program_file.py writes it and
 * documents the layout byte by byte). After ekv_program_parse succeeds every index, offset and
 * size in it is known to be in range, so the run loop trusts them. */
#ifndef EKV_PROGRAM_H
#define EKV_PROGRAM_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define EKV_PROGRAM_MAJOR 1
#define EKV_MAX_DIMS 8

enum { EKV_BUF_INPUT = 1, EKV_BUF_CACHE = 2, EKV_BUF_WEIGHT = 3, EKV_BUF_CONSTANT = 4, EKV_BUF_ARENA = 5,
       EKV_BUF_VIEW = 6 };
enum { EKV_ARG_BUFFER = 0, EKV_ARG_INT = 1, EKV_ARG_FLOAT = 2 };
enum { EKV_ROLE_STATE = 0, EKV_ROLE_K = 1, EKV_ROLE_V = 2, EKV_ROLE_POSITIONS = 3, EKV_ROLE_FILL = 4 };
enum { EKV_DT_INT = 0, EKV_DT_UINT = 1, EKV_DT_FLOAT = 2 };
/* a device kernel's launch tags and argument kinds (GPU programs; edgekv/compiler/device_kernels.py) */
enum { EKV_TAG_BLOCK_X = 0, EKV_TAG_BLOCK_Y, EKV_TAG_BLOCK_Z, EKV_TAG_THREAD_X, EKV_TAG_THREAD_Y, EKV_TAG_THREAD_Z,
       EKV_TAG_DYN_SHARED, EKV_TAG_COUNT };
enum { EKV_DARG_BUFFER = 0, EKV_DARG_I32, EKV_DARG_I64, EKV_DARG_F32, EKV_DARG_F64, EKV_DARG_U32, EKV_DARG_COUNT };
#define EKV_MAX_TAGS 8

typedef struct {
  const char *name; /* NUL-terminated, owned by the program */
  uint8_t kind, code, bits, ndim;
  int64_t shape[EKV_MAX_DIMS];
  uint64_t a, b;
  uint64_t nbytes;
  uint32_t crc32; /* a WEIGHT's CRC-32 of its bytes (program 1.2, setting weight_crc32s = 1) */
} ekv_buffer_desc;

typedef struct {
  uint32_t kernel, arg_begin, arg_count;
} ekv_call_desc;

typedef struct {
  uint32_t kind;
  uint32_t buffer;
  int64_t i;
  double f;
} ekv_arg_desc;

typedef struct {
  const char *name;
  uint32_t call_begin, call_count, in_begin, in_count, out_begin, out_count;
} ekv_function_desc;

typedef struct {
  const char *name;
  uint32_t role;
  int has_init;
  uint64_t init_offset;
} ekv_field_desc;

/* A kernel a GPU program's host code launches: its arguments, then one extent per launch tag. */
typedef struct {
  const char *name;
  const uint8_t *args; /* n_args kinds (EKV_DARG_*), into the program's copy */
  uint32_t n_args, n_tags;
  uint8_t tags[EKV_MAX_TAGS];
  uint32_t flags; /* EKV_DKERNEL_EVICTION: one of edgekv's eviction kernels (score, select, observe, prepare) */
} ekv_device_kernel;
#define EKV_DKERNEL_EVICTION 1u

typedef struct {
  const char *key;
  uint32_t type; /* 1 int, 2 string, 3 float */
  int64_t i;
  double f;
  const char *s;
} ekv_setting;

typedef struct ekv_program {
  char *strings; /* every name and string setting, NUL-terminated copies */
  ekv_setting *settings;
  uint32_t n_settings;
  const char **kernels;
  uint32_t n_kernels;
  ekv_buffer_desc *buffers;
  uint32_t n_buffers;
  ekv_call_desc *calls;
  uint32_t n_calls;
  ekv_arg_desc *args;
  uint32_t n_args;
  uint32_t *func_buffers;
  uint32_t n_func_buffers;
  ekv_function_desc *functions;
  uint32_t n_functions;
  ekv_field_desc *fields;
  uint32_t n_fields;
  unsigned char *constants; /* 64-byte aligned copy: kernels read tensor constants from it */
  uint64_t constants_size;
  ekv_device_kernel *device_kernels; /* GPU programs: the device kernels (none for a CPU program) */
  uint32_t n_device_kernels;
  uint8_t *device_args;
  /* from the settings, checked */
  int32_t num_layers, vocab_size, block, budget, max_position, pseudo_rows;
  uint64_t arena_bytes;
  uint32_t *cache_buffer; /* [num_layers * n_fields]: the CACHE buffer of (layer, field) */
} ekv_program;

/* Parse and validate the whole program from its bytes (the caller keeps them). On failure the
 * message names the file `what` and the problem; the program is left empty. */
ekv_status ekv_program_parse(ekv_error *err, const char *what, const unsigned char *data, size_t size,
                             ekv_program *out);
void ekv_program_free(ekv_program *prog);

const ekv_setting *ekv_program_setting(const ekv_program *prog, const char *key);
int64_t ekv_program_int(const ekv_program *prog, const char *key, int64_t fallback);
const char *ekv_program_str(const ekv_program *prog, const char *key); /* "" when absent */
/* index of a function by name, -1 when absent */
int ekv_program_function(const ekv_program *prog, const char *name);
/* index of the cache field with a role, -1 when absent */
int ekv_program_field_role(const ekv_program *prog, uint32_t role);

#endif
