/* Cache snapshots: a document read once, many questions answered from it. The layout is
 * written down in edgekv/artifact/snapshot_file.py (the Python writer/reader of the same file):
 *
 *   header (256 bytes): magic "EKVSNAP\0", u16 major, u16 minor, u32 header_bytes, u32 n_tensors,
 *     u32 strings_bytes, u64 position, u64 tokens, u32 budget, u32 block, u32 engine (2 =
 *     compiled artifact), u32 flags (bit 0: made with a question; bit 1: the document was read
 *     with the chat template), 32 bytes weight sha256,
 *     u32 program crc32, u32 params crc32, u32 question crc32, u32 kv dtype (0 float32, 1 int8 codes with
 *     float16 scales),
 *     (1.1) f64 the document's prefill seconds at 104, reserved,
 *     u32 header crc32 at 248 (of the header, table and strings with itself zero)
 *   tensor table at 256: n × 32 bytes {u32 layer, u32 field, u64 offset, u64 bytes, u32 crc32, 0}
 *   strings: policy name, policy parameters, question, engine state ("" here), (1.1) what the
 *     snapshot was made from (the artifact's absolute path) — each NUL-terminated
 *   data: each tensor 64-byte aligned
 *
 * Saving writes <path>.part, fsyncs it and renames it over <path>: a full disk or a kill
 * leaves no half file. Loading maps the file copy-on-write and points the caches into the
 * mapping (nothing is copied; decode's writes stay in this process). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "model.h"

#define SNAP_MAJOR 1
#define SNAP_MINOR 1
#define HEADER 256u
#define ENTRY 32u
#define ENGINE_COMPILED 2u
static const unsigned char MAGIC[8] = {'E', 'K', 'V', 'S', 'N', 'A', 'P', 0};

static void put16(unsigned char *p, uint16_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int hex_to_bytes(const char *hex, unsigned char out[32]) {
  if (strlen(hex) != 64) return 0;
  for (int i = 0; i < 32; i++) {
    unsigned v = 0;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1) return 0;
    out[i] = (unsigned char)v;
  }
  return 1;
}

static uint32_t str_crc(const char *s) { return ekv_crc32(0, s, strlen(s)); }

static const char *kv_dtype_name(uint32_t code) { return code == 0 ? "float32" : code == 1 ? "int8" : "an unknown format"; }

/* The k-th NUL-terminated string of a strings section whose last byte is NUL (NULL when absent). */
static const char *nth_string(const char *str, size_t bytes, int k) {
  size_t at = 0;
  for (int i = 0; i < k && at < bytes; i++) at += strlen(str + at) + 1;
  return at < bytes ? str + at : NULL;
}

static ekv_status write_snapshot(ekv_session *s, const char *path, const char *question, int chat,
                                 const void *const *src);

static int write_all(int fd, const void *data, size_t n) {
  const unsigned char *p = data;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return 0;
    p += w;
    n -= (size_t)w;
  }
  return 1;
}

/* The cache tensors' bytes in host memory: the buffers themselves on the CPU, one copy read back
 * from a device (freed with release_host_caches). src[k] is cache slot k's bytes. */
static ekv_status host_caches(ekv_session *s, const void **src, unsigned char **copy) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  size_t n = (size_t)p->num_layers * p->n_fields;
  *copy = NULL;
  if (m->device->host_memory) {
    for (size_t k = 0; k < n; k++) src[k] = s->data[p->cache_buffer[k]];
    return EKV_OK;
  }
  *copy = ekv_alloc(m->cache_bytes + 1, EKV_MEM_RUNTIME);
  if (*copy == NULL) return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate a host copy of the caches");
  size_t at = 0;
  for (size_t k = 0; k < n; k++) {
    uint32_t id = p->cache_buffer[k];
    if (m->device->read(m->device, s->data[id], 0, *copy + at, p->buffers[id].nbytes) != EKV_OK) {
      ekv_free(*copy);
      *copy = NULL;
      return ekv_fail(&s->err, EKV_ERR_DEVICE, "cannot read the caches from the device: %s", m->device->err.msg);
    }
    src[k] = *copy + at;
    at += ekv_align_up(p->buffers[id].nbytes, EKV_ALIGN);
  }
  return EKV_OK;
}

ekv_status ekv_session_save(ekv_session *s, const char *path, const char *question, int chat) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  const void **src = ekv_alloc(sizeof(void *) * ((size_t)p->num_layers * p->n_fields + 1), EKV_MEM_RUNTIME);
  unsigned char *copy = NULL;
  if (src == NULL) return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate the snapshot table");
  ekv_status got = host_caches(s, src, &copy);
  if (got != EKV_OK) {
    ekv_free(src);
    return got;
  }
  ekv_status st = write_snapshot(s, path, question, chat, src);
  ekv_free(copy);
  ekv_free(src);
  return st;
}

static ekv_status write_snapshot(ekv_session *s, const char *path, const char *question, int chat,
                                 const void *const *src) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  const char *policy = ekv_program_str(p, "policy"), *params = ekv_program_str(p, "policy_params");
  if (question == NULL) question = "";
  const char *parts[5] = {policy, params, question, "", m->dir};
  size_t n = (size_t)p->num_layers * p->n_fields;
  size_t strings = 0;
  for (int i = 0; i < 5; i++) strings += strlen(parts[i]) + 1;
  size_t head = ekv_align_up(HEADER + ENTRY * n + strings, EKV_ALIGN);
  unsigned char *h = ekv_alloc(head, EKV_MEM_RUNTIME);
  if (h == NULL) return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate the snapshot header");
  memcpy(h, MAGIC, 8);
  put16(h + 8, SNAP_MAJOR);
  put16(h + 10, SNAP_MINOR);
  put32(h + 12, (uint32_t)head);
  put32(h + 16, (uint32_t)n);
  put32(h + 20, (uint32_t)strings);
  put64(h + 24, s->position);
  put64(h + 32, s->stats.prefill_tokens);
  put32(h + 40, (uint32_t)p->budget);
  put32(h + 44, (uint32_t)p->block);
  put32(h + 48, ENGINE_COMPILED);
  put32(h + 52, (uint32_t)(question[0] != '\0') | (chat ? 2u : 0u));
  if (!hex_to_bytes(ekv_program_str(p, "weight_hash"), h + 56)) memset(h + 56, 0, 32);
  put32(h + 88, m->program_crc);
  put32(h + 92, str_crc(params));
  put32(h + 96, str_crc(question));
  put32(h + 100, m->kv_dtype);
  uint64_t seconds_bits;
  memcpy(&seconds_bits, &s->stats.prefill_seconds, sizeof seconds_bits);
  put64(h + 104, seconds_bits);
  uint64_t offset = head;
  for (size_t k = 0; k < n; k++) {
    uint32_t id = p->cache_buffer[k];
    const ekv_buffer_desc *b = &p->buffers[id];
    unsigned char *e = h + HEADER + ENTRY * k;
    put32(e, (uint32_t)(k / p->n_fields));
    put32(e + 4, (uint32_t)(k % p->n_fields));
    put64(e + 8, offset);
    put64(e + 16, b->nbytes);
    put32(e + 24, ekv_crc32(0, src[k], b->nbytes));
    offset = ekv_align_up(offset + b->nbytes, EKV_ALIGN);
  }
  char *str = (char *)h + HEADER + ENTRY * n;
  for (int i = 0; i < 5; i++) {
    memcpy(str, parts[i], strlen(parts[i]) + 1);
    str += strlen(parts[i]) + 1;
  }
  put32(h + 248, ekv_crc32(0, h, head));

  char tmp[4096];
  if (snprintf(tmp, sizeof tmp, "%s.part", path) >= (int)sizeof tmp) {
    ekv_free(h);
    return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "snapshot path too long: %s", path);
  }
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    ekv_free(h);
    return ekv_fail(&s->err, EKV_ERR_IO, "cannot write the snapshot %s: %s", path, strerror(errno));
  }
  static const unsigned char zeros[EKV_ALIGN];
  int ok = write_all(fd, h, head);
  uint64_t at = head;
  for (size_t k = 0; ok && k < n; k++) {
    const ekv_buffer_desc *b = &p->buffers[p->cache_buffer[k]];
    ok = write_all(fd, src[k], b->nbytes);
    at += b->nbytes;
    size_t pad = ekv_align_up(at, EKV_ALIGN) - at;
    ok = ok && write_all(fd, zeros, pad);
    at += pad;
  }
  int e = errno;
  ok = ok && fsync(fd) == 0;
  ok = close(fd) == 0 && ok;
  ekv_free(h);
  if (!ok || rename(tmp, path) != 0) {
    if (!ok) errno = e;
    int err = errno;
    unlink(tmp);
    return ekv_fail(&s->err, EKV_ERR_IO, "cannot write the snapshot %s: %s (nothing was written)", path,
                    strerror(err));
  }
  return EKV_OK;
}

void ekv_snapshot_release(ekv_session *s) {
  if (s->snapshot.data == NULL) return;
  ekv_session_bind_caches(s, NULL);
  ekv_unmap_file(&s->snapshot);
}

static ekv_status refuse(ekv_session *s, ekv_mapped_file *f, ekv_status st, const char *path, const char *why) {
  ekv_unmap_file(f);
  return ekv_fail(&s->err, st, "%s: %s", path, why);
}

/* The header of a snapshot mapped copy-on-write (its crc field is zeroed in place to check it)
 * against the artifact `m`: format, checksum, engine, weights, policy, N, B, K/V format, program.
 * Needs only m's program (read_program), not its weights: ekv_snapshot_check runs it before
 * anything loads. The file stays mapped; `strings` points at its strings table. */
static ekv_status check_header(ekv_error *err, const ekv_model *m, const ekv_mapped_file *f, const char *path,
                               const char **strings_out) {
  const ekv_program *p = &m->prog;
  const unsigned char *d = f->data;
  char why[512];
  if (f->size < HEADER || memcmp(d, MAGIC, 8) != 0)
    return ekv_fail(err, EKV_ERR_FORMAT, "%s: not an edgekv cache snapshot (bad magic or truncated)", path);
  if (ekv_le16(d + 8) != SNAP_MAJOR)
    return ekv_fail(err, EKV_ERR_FORMAT, "%s: snapshot format %u.%u, this runtime reads %u.x: make it again with "
                    "this edgekv", path, ekv_le16(d + 8), ekv_le16(d + 10), SNAP_MAJOR);
  uint32_t head = ekv_le32(d + 12), n = ekv_le32(d + 16), strings = ekv_le32(d + 20);
  if (head > f->size || (uint64_t)HEADER + (uint64_t)ENTRY * n + strings > head)
    return ekv_fail(err, EKV_ERR_FORMAT, "%s: the header is truncated or corrupt", path);
  unsigned char *hd = (unsigned char *)f->data; /* private mapping: zero the crc field to check it */
  uint32_t stored = ekv_le32(hd + 248);
  put32(hd + 248, 0);
  uint32_t computed = ekv_crc32(0, hd, head);
  put32(hd + 248, stored);
  if (stored != computed) return ekv_fail(err, EKV_ERR_FORMAT, "%s: the header fails its checksum (corrupt)", path);
  const char *str = (const char *)d + HEADER + (size_t)ENTRY * n;
  if (strings < 3 || str[strings - 1] != '\0') return ekv_fail(err, EKV_ERR_FORMAT, "%s: corrupt strings", path);
  const char *policy = str, *params = nth_string(str, strings, 1), *question = nth_string(str, strings, 2);
  if (params == NULL || question == NULL) return ekv_fail(err, EKV_ERR_FORMAT, "%s: corrupt strings", path);
  unsigned char weights[32];
  if (ekv_le32(d + 48) != ENGINE_COMPILED)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s: made by the eager engine; load it with `edgekv run` without an "
                    "artifact, or make one with this artifact", path);
  if (!hex_to_bytes(ekv_program_str(p, "weight_hash"), weights) || memcmp(weights, d + 56, 32) != 0)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s: made for other model weights than this artifact's", path);
  if (strcmp(policy, ekv_program_str(p, "policy")) != 0 || strcmp(params, ekv_program_str(p, "policy_params")) != 0) {
    snprintf(why, sizeof why, "made with policy %s %s, this artifact runs %s %s", policy, params,
             ekv_program_str(p, "policy"), ekv_program_str(p, "policy_params"));
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s: %s", path, why);
  }
  if (ekv_le32(d + 40) != (uint32_t)p->budget || ekv_le32(d + 44) != (uint32_t)p->block)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s: made at N = %u, B = %u, this artifact has N = %d, B = %d", path,
                    ekv_le32(d + 40), ekv_le32(d + 44), p->budget, p->block);
  if (ekv_le32(d + 100) != m->kv_dtype)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s: its KV cache is stored as %s, this artifact stores %s; make it again "
                    "with this artifact", path, kv_dtype_name(ekv_le32(d + 100)), kv_dtype_name(m->kv_dtype));
  if (ekv_le32(d + 88) != m->program_crc)
    return ekv_fail(err, EKV_ERR_MISMATCH, "%s: made with another artifact (its program differs); make it again",
                    path);
  if (strings_out != NULL) *strings_out = str;
  return EKV_OK;
}

ekv_status ekv_snapshot_check_header(ekv_error *err, const ekv_model *m, const char *path) {
  ekv_mapped_file f;
  EKV_TRY(ekv_map_file_private(err, path, &f));
  ekv_status st = check_header(err, m, &f, path, NULL);
  ekv_unmap_file(&f);
  return st;
}

ekv_status ekv_session_load(ekv_session *s, const char *path) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  ekv_mapped_file f;
  EKV_TRY(ekv_map_file_private(&s->err, path, &f));
  const unsigned char *d = f.data;
  const char *str = NULL;
  ekv_status hs = check_header(&s->err, m, &f, path, &str);
  if (hs != EKV_OK) {
    ekv_unmap_file(&f);
    return hs;
  }
  uint32_t n = ekv_le32(d + 16), strings = ekv_le32(d + 20);
  const char *question = nth_string(str, strings, 2);
  const char *made_from = ekv_le16(d + 10) >= 1 ? nth_string(str, strings, 4) : NULL;
  size_t slots = (size_t)p->num_layers * p->n_fields;
  if (n != slots) return refuse(s, &f, EKV_ERR_MISMATCH, path, "its cache layout differs from this artifact's");
  void **where = ekv_alloc(sizeof(void *) * (p->n_buffers + 1u), EKV_MEM_RUNTIME);
  if (where == NULL) return refuse(s, &f, EKV_ERR_NO_MEMORY, path, "out of memory");
  for (uint32_t i = 0; i < p->n_buffers; i++) where[i] = s->owned[i];
  for (uint32_t k = 0; k < n; k++) {
    const unsigned char *e = d + HEADER + (size_t)ENTRY * k;
    uint32_t layer = ekv_le32(e), field = ekv_le32(e + 4);
    uint64_t off = ekv_le64(e + 8), bytes = ekv_le64(e + 16);
    uint32_t id = layer < (uint32_t)p->num_layers && field < p->n_fields
                      ? p->cache_buffer[(size_t)layer * p->n_fields + field] : UINT32_MAX;
    const char *bad = NULL;
    ekv_status st = EKV_ERR_FORMAT;
    if (id == UINT32_MAX || bytes != p->buffers[id].nbytes) {
      bad = "its cache layout differs from this artifact's";
      st = EKV_ERR_MISMATCH;
    } else if (!ekv_range_ok(off, bytes, f.size) || off % EKV_ALIGN != 0) {
      bad = "truncated (a tensor runs past the end)";
    } else if (ekv_crc32(0, d + off, bytes) != ekv_le32(e + 24)) {
      bad = "a cache tensor fails its checksum (corrupt)";
    }
    if (bad != NULL) {
      ekv_free(where);
      return refuse(s, &f, st, path, bad);
    }
    where[id] = (unsigned char *)f.data + off;
  }
  ekv_snapshot_release(s);
  if (m->device->host_memory) {
    ekv_session_bind_caches(s, where); /* the CPU device reads the mapping in place */
  } else { /* a device gets a copy of the checked bytes; the mapping stays for the strings */
    for (uint32_t i = 0; i < p->n_buffers; i++) {
      if (p->buffers[i].kind != EKV_BUF_CACHE || where[i] == s->owned[i]) continue;
      if (m->device->write(m->device, s->owned[i], 0, where[i], p->buffers[i].nbytes) != EKV_OK) {
        ekv_free(where);
        ekv_unmap_file(&f);
        ekv_session_reset(s); /* no half-loaded state: an empty sequence */
        return ekv_fail(&s->err, EKV_ERR_DEVICE, "%s: cannot copy the caches to the device: %s", path,
                        m->device->err.msg);
      }
    }
  }
  s->snapshot = f;
  ekv_free(where);
  s->position = ekv_le64(d + 24);
  s->logits = NULL;
  atomic_store(&s->cancel, 0);
  double load = s->stats.load_seconds;
  memset(&s->stats, 0, sizeof s->stats);
  s->stats.load_seconds = load;
  ekv_snapshot_info *info = &s->snapshot_info;
  info->question = question;
  info->made_from = made_from != NULL ? made_from : "";
  info->chat = (ekv_le32(d + 52) & 2u) != 0;
  info->tokens = ekv_le64(d + 32);
  uint64_t seconds_bits = ekv_le16(d + 10) >= 1 ? ekv_le64(d + 104) : 0;
  memcpy(&info->document_seconds, &seconds_bits, sizeof info->document_seconds);
  if (!(info->document_seconds >= 0.0 && info->document_seconds < 1e9)) info->document_seconds = 0.0; /* NaN, junk */
  return EKV_OK;
}

ekv_status ekv_session_snapshot_info(const ekv_session *s, ekv_snapshot_info *info) {
  if (s->snapshot.data == NULL) return EKV_ERR_INVALID_ARG;
  *info = s->snapshot_info;
  return EKV_OK;
}
