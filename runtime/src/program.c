/* program.ekv reader: one validating pass (see program.h and edgekv/artifact/program_file.py). */
#include "program.h"

#include <string.h>

#include "alloc.h"
#include "reader.h"

#define HEADER_BYTES 64u
#define SECTION_ENTRY 32u
#define MAX_SECTIONS 64u
static const unsigned char MAGIC[8] = {'E', 'K', 'V', 'P', 'R', 'O', 'G', 0};

enum { SEC_STRINGS = 1, SEC_SETTINGS, SEC_KERNELS, SEC_BUFFERS, SEC_CONSTANTS, SEC_FUNCTIONS, SEC_CALLS, SEC_ARGS,
       SEC_FUNC_BUFFERS, SEC_CACHE_FIELDS, SEC_DEVICE_KERNELS, SEC_DEVICE_ARGS, SEC_COUNT };
static const uint32_t RECORD_SIZE[SEC_COUNT] = {0, 1, 24, 8, 96, 1, 32, 16, 16, 4, 24, 32, 1};
static const char *SECTION_NAME[SEC_COUNT] = {"?", "strings", "settings", "kernels", "buffers", "constants",
                                              "functions", "calls", "args", "function buffers", "cache fields",
                                              "device kernels", "device arguments"};

typedef struct {
  const unsigned char *data;
  uint64_t size;
  uint32_t count;
} section;

/* Parsing state: the sections, the string table, and the pool the NUL-terminated copies go to. */
typedef struct {
  ekv_error *err;
  const char *what;
  section sec[SEC_COUNT];
  char *pool;
  size_t pool_used, pool_cap;
} parser;

static ekv_status bad(parser *p, const char *fmt_part, uint64_t a, uint64_t b) {
  return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: %s (%llu, %llu); the file is corrupt or truncated: recompile the artifact",
                  p->what, fmt_part, (unsigned long long)a, (unsigned long long)b);
}

/* A (u32 offset, u32 length) string reference → a NUL-terminated copy in the pool. */
static ekv_status string_ref(parser *p, const unsigned char *rec, const char **out) {
  uint32_t off = ekv_le32(rec), len = ekv_le32(rec + 4);
  if (!ekv_range_ok(off, len, p->sec[SEC_STRINGS].size)) return bad(p, "a string runs past the string table", off, len);
  if (p->pool_used + len + 1 > p->pool_cap) return bad(p, "string pool overflow", p->pool_used, len);
  char *dst = p->pool + p->pool_used;
  memcpy(dst, p->sec[SEC_STRINGS].data + off, len);
  dst[len] = '\0';
  if (strlen(dst) != len) return bad(p, "a string holds a NUL byte", off, len);
  p->pool_used += len + 1;
  *out = dst;
  return EKV_OK;
}

static ekv_status read_sections(parser *p, const unsigned char *data, size_t size) {
  if (size < HEADER_BYTES) return bad(p, "shorter than the 64-byte header", size, HEADER_BYTES);
  if (memcmp(data, MAGIC, 8) != 0)
    return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: not an edgekv program file (bad magic); recompile the artifact", p->what);
  uint16_t major = ekv_le16(data + 8), minor = ekv_le16(data + 10);
  if (major != EKV_PROGRAM_MAJOR)
    return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: program format %u.%u, this runtime reads %u.x; recompile the artifact "
                    "with the edgekv that matches this runtime", p->what, major, minor, EKV_PROGRAM_MAJOR);
  uint32_t header_bytes = ekv_le32(data + 12), n = ekv_le32(data + 16);
  if (n > MAX_SECTIONS || header_bytes != HEADER_BYTES + SECTION_ENTRY * n || header_bytes > size)
    return bad(p, "bad section table", header_bytes, n);
  for (uint32_t i = 0; i < n; i++) {
    const unsigned char *e = data + HEADER_BYTES + SECTION_ENTRY * i;
    uint32_t id = ekv_le32(e), rsize = ekv_le32(e + 4), crc = ekv_le32(e + 24), count = ekv_le32(e + 28);
    uint64_t off = ekv_le64(e + 8), len = ekv_le64(e + 16), total;
    if (!ekv_range_ok(off, len, size) || off % EKV_ALIGN != 0) return bad(p, "a section lies outside the file", off, len);
    if (id == 0 || id >= SEC_COUNT) continue; /* a later minor version's section: not ours to read */
    if (p->sec[id].data != NULL) return bad(p, "a section appears twice", id, i);
    if (rsize != RECORD_SIZE[id] || !ekv_mul_ok(rsize, count, &total) || total != len)
      return bad(p, "a section's record size or count does not match its length", id, len);
    if (ekv_crc32(0, data + off, len) != crc)
      return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: the %s section fails its checksum; the file is corrupt: recompile "
                      "the artifact", p->what, SECTION_NAME[id]);
    p->sec[id].data = data + off;
    p->sec[id].size = len;
    p->sec[id].count = count;
  }
  static const unsigned char EMPTY[1] = {0};
  for (int id = 1; id < SEC_COUNT; id++) {
    if (p->sec[id].data != NULL) continue;
    if (id == SEC_STRINGS || id == SEC_SETTINGS || id == SEC_BUFFERS || id == SEC_FUNCTIONS || id == SEC_CACHE_FIELDS)
      return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: the %s section is missing; recompile the artifact", p->what,
                      SECTION_NAME[id]);
    p->sec[id].data = EMPTY; /* absent optional section: zero records */
  }
  return EKV_OK;
}

static void *alloc_array(parser *p, size_t n, size_t elem, ekv_status *st) {
  uint64_t bytes;
  if (!ekv_mul_ok(n, elem, &bytes)) {
    *st = bad(p, "array too large", n, elem);
    return NULL;
  }
  void *a = ekv_alloc((size_t)bytes + 1, EKV_MEM_RUNTIME);
  if (a == NULL) *st = ekv_fail(p->err, EKV_ERR_NO_MEMORY, "%s: cannot allocate %llu bytes", p->what,
                                (unsigned long long)bytes);
  return a;
}

#define ALLOC(ptr, n)                                          \
  do {                                                         \
    ekv_status st_ = EKV_OK;                                   \
    (ptr) = alloc_array(p, (n), sizeof *(ptr), &st_);          \
    if ((ptr) == NULL) return st_;                             \
  } while (0)

static ekv_status read_settings(parser *p, ekv_program *prog) {
  section *s = &p->sec[SEC_SETTINGS];
  prog->n_settings = s->count;
  ALLOC(prog->settings, s->count);
  for (uint32_t i = 0; i < s->count; i++) {
    const unsigned char *r = s->data + 24u * i;
    ekv_setting *set = &prog->settings[i];
    EKV_TRY(string_ref(p, r, &set->key));
    set->type = ekv_le32(r + 8);
    if (set->type == 1) set->i = ekv_le64s(r + 16);
    else if (set->type == 3) set->f = ekv_lef64(r + 16);
    else if (set->type == 2) EKV_TRY(string_ref(p, r + 16, &set->s));
    else return bad(p, "a setting has an unknown type", i, set->type);
  }
  return EKV_OK;
}

static ekv_status require_int(parser *p, ekv_program *prog, const char *key, int64_t lo, int64_t hi, int64_t *out) {
  const ekv_setting *s = ekv_program_setting(prog, key);
  if (s == NULL || s->type != 1)
    return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: the setting '%s' is missing; recompile the artifact", p->what, key);
  if (s->i < lo || s->i > hi)
    return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: the setting '%s' = %lld is outside %lld..%lld", p->what, key,
                    (long long)s->i, (long long)lo, (long long)hi);
  *out = s->i;
  return EKV_OK;
}

static ekv_status read_geometry(parser *p, ekv_program *prog) {
  int64_t v = 0;
  EKV_TRY(require_int(p, prog, "num_layers", 1, 4096, &v));
  prog->num_layers = (int32_t)v;
  EKV_TRY(require_int(p, prog, "vocab_size", 1, 1 << 24, &v));
  prog->vocab_size = (int32_t)v;
  EKV_TRY(require_int(p, prog, "block", 1, 1 << 20, &v));
  prog->block = (int32_t)v;
  EKV_TRY(require_int(p, prog, "budget", 1, 1 << 30, &v));
  prog->budget = (int32_t)v;
  EKV_TRY(require_int(p, prog, "max_position", 1, INT32_MAX, &v));
  prog->max_position = (int32_t)v;
  EKV_TRY(require_int(p, prog, "pseudo_rows", 0, 1 << 20, &v));
  prog->pseudo_rows = (int32_t)v;
  EKV_TRY(require_int(p, prog, "arena_bytes", 0, INT64_MAX, &v));
  prog->arena_bytes = (uint64_t)v;
  return EKV_OK;
}

static int dtype_ok(uint8_t code, uint8_t bits) {
  if (code == EKV_DT_FLOAT) return bits == 16 || bits == 32 || bits == 64;
  return (code == EKV_DT_INT || code == EKV_DT_UINT) && (bits == 8 || bits == 16 || bits == 32 || bits == 64);
}

static ekv_status read_buffers(parser *p, ekv_program *prog) {
  section *s = &p->sec[SEC_BUFFERS];
  prog->n_buffers = s->count;
  ALLOC(prog->buffers, s->count);
  for (uint32_t i = 0; i < s->count; i++) {
    const unsigned char *r = s->data + 96u * i;
    ekv_buffer_desc *b = &prog->buffers[i];
    b->kind = r[0];
    b->code = r[1];
    b->bits = r[2];
    b->ndim = r[3];
    EKV_TRY(string_ref(p, r + 4, &b->name));
    b->crc32 = ekv_le32(r + 12); /* 1.2: a weight's checksum (the setting weight_crc32s says it is set) */
    if (b->kind < EKV_BUF_INPUT || b->kind > EKV_BUF_VIEW) return bad(p, "a buffer has an unknown kind", i, b->kind);
    if (!dtype_ok(b->code, b->bits)) return bad(p, "a buffer has an unknown dtype", b->code, b->bits);
    if (b->ndim > EKV_MAX_DIMS) return bad(p, "a buffer has too many dimensions", i, b->ndim);
    uint64_t elems = 1;
    for (int d = 0; d < EKV_MAX_DIMS; d++) {
      b->shape[d] = ekv_le64s(r + 16 + 8 * d);
      if (d < b->ndim && (b->shape[d] < 0 || !ekv_mul_ok(elems, (uint64_t)b->shape[d], &elems)))
        return bad(p, "a buffer has a bad shape", i, (uint64_t)b->shape[d]);
    }
    if (!ekv_mul_ok(elems, b->bits / 8u, &b->nbytes)) return bad(p, "a buffer is too large", i, elems);
    b->a = ekv_le64(r + 80);
    b->b = ekv_le64(r + 88);
  }
  return EKV_OK;
}

static ekv_status check_buffers(parser *p, ekv_program *prog) {
  uint32_t n_fields = prog->n_fields;
  size_t slots = (size_t)prog->num_layers * n_fields;
  ALLOC(prog->cache_buffer, slots);
  for (size_t k = 0; k < slots; k++) prog->cache_buffer[k] = UINT32_MAX;
  for (uint32_t i = 0; i < prog->n_buffers; i++) {
    ekv_buffer_desc *b = &prog->buffers[i];
    switch (b->kind) {
      case EKV_BUF_CACHE: {
        if (b->a >= (uint64_t)prog->num_layers || b->b >= n_fields) return bad(p, "a cache buffer's layer/field", b->a, b->b);
        uint32_t *slot = &prog->cache_buffer[b->a * n_fields + b->b];
        if (*slot != UINT32_MAX) return bad(p, "two buffers for one cache tensor", b->a, b->b);
        *slot = i;
        const ekv_field_desc *f = &prog->fields[b->b];
        if (f->has_init && !ekv_range_ok(f->init_offset, b->nbytes, prog->constants_size))
          return bad(p, "a cache field's initial contents lie outside the constants", f->init_offset, b->nbytes);
        break;
      }
      case EKV_BUF_CONSTANT:
        if (!ekv_range_ok(b->a, b->nbytes, prog->constants_size) || b->a % EKV_ALIGN != 0)
          return bad(p, "a constant lies outside the constants section", b->a, b->nbytes);
        break;
      case EKV_BUF_ARENA:
        if (!ekv_range_ok(b->a, b->nbytes, prog->arena_bytes) || b->a % EKV_ALIGN != 0)
          return bad(p, "an arena tensor lies outside the arena", b->a, b->nbytes);
        break;
      case EKV_BUF_VIEW:
        if (b->a >= i || b->nbytes > prog->buffers[b->a].nbytes) return bad(p, "a view of a later or smaller buffer", i, b->a);
        break;
      default: /* INPUT: allocated by the session; WEIGHT: checked against the params file at open */
        break;
    }
  }
  for (size_t k = 0; k < slots; k++)
    if (prog->cache_buffer[k] == UINT32_MAX) return bad(p, "a cache tensor has no buffer (layer, field)", k / n_fields, k % n_fields);
  int fill = ekv_program_field_role(prog, EKV_ROLE_FILL), pos = ekv_program_field_role(prog, EKV_ROLE_POSITIONS);
  if (fill < 0 || pos < 0) return bad(p, "the cache has no fill or positions field", (uint64_t)fill, (uint64_t)pos);
  for (int32_t l = 0; l < prog->num_layers; l++) {
    const ekv_buffer_desc *fb = &prog->buffers[prog->cache_buffer[(size_t)l * n_fields + (uint32_t)fill]];
    const ekv_buffer_desc *pb = &prog->buffers[prog->cache_buffer[(size_t)l * n_fields + (uint32_t)pos]];
    if (fb->code != EKV_DT_INT || fb->bits != 32 || fb->nbytes != 4) return bad(p, "a fill tensor is not int32[1]", l, fb->nbytes);
    if (pb->code != EKV_DT_INT || pb->bits != 32 || pb->ndim != 2) return bad(p, "a positions tensor is not int32[H, N]", l, pb->ndim);
  }
  return EKV_OK;
}

static ekv_status read_calls(parser *p, ekv_program *prog) {
  section *k = &p->sec[SEC_KERNELS], *c = &p->sec[SEC_CALLS], *a = &p->sec[SEC_ARGS], *fb = &p->sec[SEC_FUNC_BUFFERS];
  prog->n_kernels = k->count;
  ALLOC(prog->kernels, k->count);
  for (uint32_t i = 0; i < k->count; i++) EKV_TRY(string_ref(p, k->data + 8u * i, &prog->kernels[i]));
  prog->n_args = a->count;
  ALLOC(prog->args, a->count);
  for (uint32_t i = 0; i < a->count; i++) {
    const unsigned char *r = a->data + 16u * i;
    ekv_arg_desc *arg = &prog->args[i];
    arg->kind = ekv_le32(r);
    if (arg->kind == EKV_ARG_BUFFER) {
      uint64_t id = ekv_le64(r + 8);
      if (id >= prog->n_buffers) return bad(p, "an argument names a missing buffer", i, id);
      arg->buffer = (uint32_t)id;
    } else if (arg->kind == EKV_ARG_INT) {
      arg->i = ekv_le64s(r + 8);
    } else if (arg->kind == EKV_ARG_FLOAT) {
      arg->f = ekv_lef64(r + 8);
    } else {
      return bad(p, "an argument has an unknown kind", i, arg->kind);
    }
  }
  prog->n_calls = c->count;
  ALLOC(prog->calls, c->count);
  for (uint32_t i = 0; i < c->count; i++) {
    const unsigned char *r = c->data + 16u * i;
    ekv_call_desc *call = &prog->calls[i];
    call->kernel = ekv_le32(r);
    call->arg_begin = ekv_le32(r + 4);
    call->arg_count = ekv_le32(r + 8);
    if (call->kernel >= prog->n_kernels) return bad(p, "a call names a missing kernel", i, call->kernel);
    if (!ekv_range_ok(call->arg_begin, call->arg_count, prog->n_args)) return bad(p, "a call's arguments", i, call->arg_begin);
  }
  prog->n_func_buffers = fb->count;
  ALLOC(prog->func_buffers, fb->count);
  for (uint32_t i = 0; i < fb->count; i++) {
    prog->func_buffers[i] = ekv_le32(fb->data + 4u * i);
    if (prog->func_buffers[i] >= prog->n_buffers) return bad(p, "a function input/output names a missing buffer", i,
                                                             prog->func_buffers[i]);
  }
  return EKV_OK;
}

static ekv_status read_functions(parser *p, ekv_program *prog) {
  section *s = &p->sec[SEC_FUNCTIONS];
  prog->n_functions = s->count;
  ALLOC(prog->functions, s->count);
  for (uint32_t i = 0; i < s->count; i++) {
    const unsigned char *r = s->data + 32u * i;
    ekv_function_desc *f = &prog->functions[i];
    EKV_TRY(string_ref(p, r, &f->name));
    f->call_begin = ekv_le32(r + 8);
    f->call_count = ekv_le32(r + 12);
    f->in_begin = ekv_le32(r + 16);
    f->in_count = ekv_le32(r + 20);
    f->out_begin = ekv_le32(r + 24);
    f->out_count = ekv_le32(r + 28);
    if (!ekv_range_ok(f->call_begin, f->call_count, prog->n_calls) ||
        !ekv_range_ok(f->in_begin, f->in_count, prog->n_func_buffers) ||
        !ekv_range_ok(f->out_begin, f->out_count, prog->n_func_buffers) || f->out_count == 0)
      return bad(p, "a function's calls, inputs or outputs", i, f->call_count);
    for (uint32_t k = 0; k < f->in_count; k++)
      if (prog->buffers[prog->func_buffers[f->in_begin + k]].kind != EKV_BUF_INPUT)
        return bad(p, "a function input is not an input buffer", i, k);
    const ekv_buffer_desc *logits = &prog->buffers[prog->func_buffers[f->out_begin]];
    if (logits->code != EKV_DT_FLOAT || logits->bits != 32 || logits->nbytes != 4u * (uint64_t)prog->vocab_size)
      return bad(p, "a function's first output is not float32 logits of the vocabulary", i, logits->nbytes);
  }
  if (ekv_program_function(prog, "prefill_block") < 0 || ekv_program_function(prog, "decode") < 0)
    return ekv_fail(p->err, EKV_ERR_FORMAT, "%s: the program has no prefill_block or decode function; recompile the "
                    "artifact", p->what);
  return EKV_OK;
}

/* A GPU program's device kernels: names, argument kinds and launch tags, each checked. */
static ekv_status read_device_kernels(parser *p, ekv_program *prog) {
  section *s = &p->sec[SEC_DEVICE_KERNELS], *a = &p->sec[SEC_DEVICE_ARGS];
  prog->n_device_kernels = s->count;
  if (s->count == 0) return EKV_OK;
  ALLOC(prog->device_kernels, s->count);
  ALLOC(prog->device_args, a->count);
  if (a->count) memcpy(prog->device_args, a->data, a->count);
  for (uint32_t i = 0; i < a->count; i++)
    if (prog->device_args[i] >= EKV_DARG_COUNT) return bad(p, "a device kernel argument has an unknown kind", i, a->data[i]);
  for (uint32_t i = 0; i < s->count; i++) {
    const unsigned char *r = s->data + 32u * i;
    ekv_device_kernel *k = &prog->device_kernels[i];
    EKV_TRY(string_ref(p, r, &k->name));
    uint32_t begin = ekv_le32(r + 8);
    k->n_args = ekv_le32(r + 12);
    k->n_tags = ekv_le32(r + 16);
    if (!ekv_range_ok(begin, k->n_args, a->count) || k->n_args > 1024 || k->n_tags > EKV_MAX_TAGS)
      return bad(p, "a device kernel's arguments or launch tags", i, k->n_args);
    k->args = prog->device_args + begin;
    k->flags = ekv_le32(r + 28);
    for (uint32_t t = 0; t < k->n_tags; t++) {
      k->tags[t] = r[20 + t];
      if (k->tags[t] >= EKV_TAG_COUNT) return bad(p, "a device kernel has an unknown launch tag", i, k->tags[t]);
    }
  }
  return EKV_OK;
}

static ekv_status read_fields(parser *p, ekv_program *prog) {
  section *s = &p->sec[SEC_CACHE_FIELDS];
  prog->n_fields = s->count;
  if (s->count == 0) return bad(p, "the cache has no fields", 0, 0);
  ALLOC(prog->fields, s->count);
  for (uint32_t i = 0; i < s->count; i++) {
    const unsigned char *r = s->data + 24u * i;
    ekv_field_desc *f = &prog->fields[i];
    EKV_TRY(string_ref(p, r, &f->name));
    f->role = ekv_le32(r + 8);
    f->has_init = ekv_le32(r + 12) != 0;
    f->init_offset = ekv_le64(r + 16);
    if (f->role > EKV_ROLE_FILL) return bad(p, "a cache field has an unknown role", i, f->role);
  }
  return EKV_OK;
}

/* Exact bytes of the NUL-terminated copies: the sum of every string reference's length + 1
 * (references are range-checked when copied). */
static uint64_t pool_bytes(const parser *p) {
  static const struct { int sec; uint32_t rsize, at; } REFS[] = {
      {SEC_SETTINGS, 24, 0}, {SEC_KERNELS, 8, 0},       {SEC_BUFFERS, 96, 4},
      {SEC_FUNCTIONS, 32, 0}, {SEC_CACHE_FIELDS, 24, 0}, {SEC_DEVICE_KERNELS, 32, 0}};
  uint64_t total = 1;
  for (size_t k = 0; k < sizeof REFS / sizeof REFS[0]; k++) {
    const section *s = &p->sec[REFS[k].sec];
    for (uint32_t i = 0; i < s->count; i++) total += (uint64_t)ekv_le32(s->data + (uint64_t)REFS[k].rsize * i + REFS[k].at + 4) + 1;
  }
  const section *s = &p->sec[SEC_SETTINGS];
  for (uint32_t i = 0; i < s->count; i++)
    if (ekv_le32(s->data + 24ull * i + 8) == 2) total += (uint64_t)ekv_le32(s->data + 24ull * i + 20) + 1;
  return total;
}

ekv_status ekv_program_parse(ekv_error *err, const char *what, const unsigned char *data, size_t size,
                             ekv_program *out) {
  memset(out, 0, sizeof *out);
  parser p = {.err = err, .what = what};
  ekv_status st = read_sections(&p, data, size);
  if (st != EKV_OK) return st;
  uint64_t pool = pool_bytes(&p);
  if (pool > ((uint64_t)1 << 30)) return bad(&p, "string references add up to more than 1 GiB", pool, 0);
  p.pool_cap = (size_t)pool;
  p.pool = ekv_alloc(p.pool_cap, EKV_MEM_RUNTIME);
  if (p.pool == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "%s: cannot allocate the string pool", what);
  out->strings = p.pool;
  out->constants_size = p.sec[SEC_CONSTANTS].size;
  out->constants = ekv_alloc(out->constants_size + 1, EKV_MEM_RUNTIME);
  if (out->constants == NULL) {
    st = ekv_fail(err, EKV_ERR_NO_MEMORY, "%s: cannot allocate %llu bytes of constants", what,
                  (unsigned long long)out->constants_size);
  } else {
    if (out->constants_size) memcpy(out->constants, p.sec[SEC_CONSTANTS].data, out->constants_size);
    st = read_settings(&p, out);
  }
  if (st == EKV_OK) st = read_geometry(&p, out);
  if (st == EKV_OK) st = read_fields(&p, out);
  if (st == EKV_OK) st = read_buffers(&p, out);
  if (st == EKV_OK) st = check_buffers(&p, out);
  if (st == EKV_OK) st = read_calls(&p, out);
  if (st == EKV_OK) st = read_functions(&p, out);
  if (st == EKV_OK) st = read_device_kernels(&p, out);
  if (st != EKV_OK) ekv_program_free(out);
  return st;
}

void ekv_program_free(ekv_program *prog) {
  if (prog == NULL) return;
  ekv_free(prog->strings);
  ekv_free(prog->settings);
  ekv_free(prog->kernels);
  ekv_free(prog->buffers);
  ekv_free(prog->calls);
  ekv_free(prog->args);
  ekv_free(prog->func_buffers);
  ekv_free(prog->functions);
  ekv_free(prog->fields);
  ekv_free(prog->constants);
  ekv_free(prog->cache_buffer);
  ekv_free(prog->device_kernels);
  ekv_free(prog->device_args);
  memset(prog, 0, sizeof *prog);
}

const ekv_setting *ekv_program_setting(const ekv_program *prog, const char *key) {
  for (uint32_t i = 0; i < prog->n_settings; i++)
    if (strcmp(prog->settings[i].key, key) == 0) return &prog->settings[i];
  return NULL;
}

int64_t ekv_program_int(const ekv_program *prog, const char *key, int64_t fallback) {
  const ekv_setting *s = ekv_program_setting(prog, key);
  return s != NULL && s->type == 1 ? s->i : fallback;
}

const char *ekv_program_str(const ekv_program *prog, const char *key) {
  const ekv_setting *s = ekv_program_setting(prog, key);
  return s != NULL && s->type == 2 ? s->s : "";
}

int ekv_program_function(const ekv_program *prog, const char *name) {
  for (uint32_t i = 0; i < prog->n_functions; i++)
    if (strcmp(prog->functions[i].name, name) == 0) return (int)i;
  return -1;
}

int ekv_program_field_role(const ekv_program *prog, uint32_t role) {
  for (uint32_t i = 0; i < prog->n_fields; i++)
    if (prog->fields[i].role == role) return (int)i;
  return -1;
}
