/* ekv_model: open an artifact directory, check every part against the program, resolve the
 * kernels, map the weights. Setup in stages so that running is a flat loop later. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "cpu_check.h"
#include "model.h"
#include "manifest_check.h"
#include "weights_check.h"

#define PROGRAM_FILE "program.ekv"
#define MAX_PROGRAM_BYTES ((size_t)1 << 30)

double ekv_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void ekv_model_options_init(ekv_model_options *opts) {
  memset(opts, 0, sizeof *opts);
  opts->verify_weights = EKV_VERIFY_DEFAULT;
}

const char *ekv_model_last_error(const ekv_model *model) {
  return model == NULL ? "out of memory (no model handle)" : model->err.msg;
}

ekv_tokenizer *ekv_model_tokenizer(ekv_model *model) { return model == NULL ? NULL : model->tok; }

static double mib(uint64_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* A file the program names, with its size and CRC-32 as the program recorded them. */
static ekv_status check_file(ekv_model *m, const char *dir, const char *key, int verify_crc, char *path, size_t cap,
                             ekv_mapped_file *map_out) {
  char name_key[64], bytes_key[64], crc_key[64];
  snprintf(name_key, sizeof name_key, "%s_name", key);
  snprintf(bytes_key, sizeof bytes_key, "%s_bytes", key);
  snprintf(crc_key, sizeof crc_key, "%s_crc32", key);
  const char *name = ekv_program_str(&m->prog, name_key);
  if (name[0] == '\0' || name[0] == '/' || strstr(name, "..") != NULL) /* inside the artifact only */
    return ekv_fail(&m->err, EKV_ERR_FORMAT, "%s/%s names no valid %s file; recompile the artifact", dir, PROGRAM_FILE,
                    key);
  if (!ekv_path_join(path, cap, dir, name)) return ekv_fail(&m->err, EKV_ERR_INVALID_ARG, "path too long: %s", dir);
  ekv_mapped_file map;
  EKV_TRY(ekv_map_file(&m->err, path, &map));
  int64_t want = ekv_program_int(&m->prog, bytes_key, -1);
  if ((int64_t)map.size != want) {
    size_t have = map.size; /* before the unmap clears it */
    ekv_unmap_file(&map);
    return ekv_fail(&m->err, EKV_ERR_MISMATCH, "%s is %zu bytes but the program expects %lld: the file is truncated, "
                    "or from another compile; copy the artifact again, or recompile it", path, have, (long long)want);
  }
  if (verify_crc && ekv_crc32(0, map.data, map.size) != (uint32_t)ekv_program_int(&m->prog, crc_key, -1)) {
    ekv_unmap_file(&map);
    return ekv_fail(&m->err, EKV_ERR_MISMATCH, "%s does not match the program's checksum: it is corrupt, or from "
                    "another compile; recompile the artifact", path);
  }
  if (map_out != NULL) *map_out = map;
  else ekv_unmap_file(&map);
  return EKV_OK;
}

static ekv_status read_program(ekv_model *m, const char *dir) {
  char path[PATH_MAX];
  if (!ekv_path_join(path, sizeof path, dir, PROGRAM_FILE))
    return ekv_fail(&m->err, EKV_ERR_INVALID_ARG, "path too long: %s", dir);
  ekv_mapped_file file;
  ekv_status st = ekv_map_file(&m->err, path, &file);
  if (st != EKV_OK) {
    char why[EKV_ERR_LEN];
    snprintf(why, sizeof why, "%s", m->err.msg); /* the message is rewritten below */
    return ekv_fail(&m->err, st, "%s is not an edgekv artifact with a native program (%s); compile it with "
                    "`edgekv compile ... -o %s`", dir, why, dir);
  }
  if (file.size > MAX_PROGRAM_BYTES) {
    ekv_unmap_file(&file);
    return ekv_fail(&m->err, EKV_ERR_FORMAT, "%s is larger than 1 GiB; not a program file", path);
  }
  st = ekv_program_parse(&m->err, path, file.data, file.size, &m->prog);
  m->program_crc = ekv_crc32(0, file.data, file.size);
  ekv_unmap_file(&file);
  if (st != EKV_OK) return st;
  const char *built = ekv_program_str(&m->prog, "edgekv_version");
  if (strcmp(built, EDGEKV_VERSION) != 0)
    return ekv_fail(&m->err, EKV_ERR_MISMATCH, "the artifact was compiled by edgekv %s and this runtime is edgekv %s; "
                    "recompile it with the matching edgekv", built, EDGEKV_VERSION);
  m->f_prefill = ekv_program_function(&m->prog, "prefill_block");
  m->f_decode = ekv_program_function(&m->prog, "decode");
  m->f_prepare = ekv_program_function(&m->prog, "prepare");
  m->fill_field = ekv_program_field_role(&m->prog, EKV_ROLE_FILL);
  m->pos_field = ekv_program_field_role(&m->prog, EKV_ROLE_POSITIONS);
  int k_field = ekv_program_field_role(&m->prog, EKV_ROLE_K);
  const ekv_buffer_desc *k0 = k_field >= 0 && m->prog.num_layers > 0
                                  ? &m->prog.buffers[m->prog.cache_buffer[(uint32_t)k_field]] : NULL;
  m->kv_dtype = k0 != NULL && k0->code == EKV_DT_INT && k0->bits == 8 ? 1u : 0u;
  return EKV_OK;
}

/* The device the program was compiled for: the CPU, OpenCL or CUDA (its kernels built from the
 * artifact's device source — OpenCL C, or PTX — checked against the program's size and CRC first). */
static ekv_status open_device(ekv_model *m, const char *dir) {
  const char *kind = ekv_program_str(&m->prog, "device");
  if (kind[0] == '\0' || strcmp(kind, "cpu") == 0) {
    m->device = ekv_device_cpu();
    return EKV_OK;
  }
  if (strcmp(kind, "opencl") != 0 && strcmp(kind, "cuda") != 0)
    return ekv_fail(&m->err, EKV_ERR_MISMATCH, "the artifact was compiled for a %s device, which this runtime has no "
                    "backend for; compile it with --target host, opencl-host or cuda-host", kind);
  char path[PATH_MAX];
  EKV_TRY(check_file(m, dir, "device_source", 1, path, sizeof path, NULL));
  if (strcmp(kind, "cuda") == 0) return ekv_device_cuda_open(&m->err, &m->prog, path, m->plan_bytes, &m->device);
  return ekv_device_opencl_open(&m->err, &m->prog, path, m->plan_bytes, &m->device);
}

/* Weights and constants where the kernels read them: the mapping and the program's constants
 * themselves on the CPU, one device copy each on a GPU (made once per model, for every session). */
static ekv_status upload_constants(ekv_model *m) {
  ekv_device *dev = m->device;
  m->uploaded = ekv_alloc(sizeof(void *) * (m->prog.n_buffers + 1u), EKV_MEM_RUNTIME);
  if (m->uploaded == NULL) return ekv_fail(&m->err, EKV_ERR_NO_MEMORY, "cannot allocate the weight table");
  for (uint32_t i = 0; i < m->prog.n_buffers; i++) {
    const ekv_buffer_desc *b = &m->prog.buffers[i];
    const unsigned char *host = b->kind == EKV_BUF_WEIGHT ? m->params.data + b->a
                                : b->kind == EKV_BUF_CONSTANT ? m->prog.constants + b->a : NULL;
    if (host == NULL) continue;
    m->uploaded[i] = dev->upload(dev, host, b->nbytes ? b->nbytes : 1);
    if (m->uploaded[i] == NULL)
      return ekv_fail(&m->err, EKV_ERR_DEVICE, "cannot place %s (%llu bytes) on the %s device: %s", b->name,
                      (unsigned long long)b->nbytes, dev->name, dev->err.msg);
  }
  return EKV_OK;
}

static ekv_status load_library(ekv_model *m, const char *dir) {
  char path[PATH_MAX];
  EKV_TRY(ekv_cpu_check(&m->err, ekv_program_str(&m->prog, "target_arch"), ekv_program_str(&m->prog, "cpu_features")));
  EKV_TRY(check_file(m, dir, "library", 1, path, sizeof path, NULL));
  EKV_TRY(ekv_library_open(&m->err, path, m->device, &m->lib));
  m->kernels = ekv_alloc(sizeof(ekv_kernel_fn) * (m->prog.n_kernels + 1u), EKV_MEM_RUNTIME);
  if (m->kernels == NULL) return ekv_fail(&m->err, EKV_ERR_NO_MEMORY, "cannot allocate the kernel table");
  for (uint32_t k = 0; k < m->prog.n_kernels; k++) {
    m->kernels[k] = ekv_library_kernel(&m->lib, m->prog.kernels[k]);
    if (m->kernels[k] == NULL)
      return ekv_fail(&m->err, EKV_ERR_MISMATCH, "the program calls kernel %s, which %s does not export: the library "
                      "and the program come from different compiles; recompile the artifact", m->prog.kernels[k], path);
  }
  return EKV_OK;
}

/* The weights mapped read-only, their size and places checked, then their contents (weights_check.c). */
static ekv_status map_weights(ekv_model *m, const char *dir, int verify) {
  char path[PATH_MAX];
  EKV_TRY(check_file(m, dir, "params", 0, path, sizeof path, &m->params));
  for (uint32_t i = 0; i < m->prog.n_buffers; i++) {
    const ekv_buffer_desc *b = &m->prog.buffers[i];
    if (b->kind != EKV_BUF_WEIGHT) continue;
    if (b->b != b->nbytes || !ekv_range_ok(b->a, b->nbytes, m->params.size) || b->a % EKV_ALIGN != 0)
      return ekv_fail(&m->err, EKV_ERR_FORMAT, "weight %s (%llu bytes at %llu) does not lie aligned inside %s (%zu "
                      "bytes); recompile the artifact", b->name, (unsigned long long)b->nbytes,
                      (unsigned long long)b->a, path, m->params.size);
  }
  return ekv_weights_verify(m, dir, path, verify);
}

static ekv_status open_tokenizer(ekv_model *m, const char *dir) {
  if (ekv_program_str(&m->prog, "tokenizer_file_name")[0] == '\0') return EKV_OK; /* a model without one */
  char path[PATH_MAX];
  EKV_TRY(check_file(m, dir, "tokenizer_file", 1, path, sizeof path, NULL));
  ekv_status st = ekv_tokenizer_open(path, &m->tok);
  if (st != EKV_OK) return ekv_fail(&m->err, st, "%s", ekv_tokenizer_last_error(m->tok));
  return EKV_OK;
}

/* The memory plan: weights (mapped), one session's caches, arena and inputs — refused before
 * anything is allocated when it is above the limit. */
static ekv_status plan_memory(ekv_model *m, uint64_t limit) {
  for (uint32_t i = 0; i < m->prog.n_buffers; i++) {
    const ekv_buffer_desc *b = &m->prog.buffers[i];
    if (b->kind == EKV_BUF_CACHE) m->cache_bytes += ekv_align_up(b->nbytes, EKV_ALIGN);
    if (b->kind == EKV_BUF_INPUT) m->input_bytes += ekv_align_up(b->nbytes, EKV_ALIGN);
  }
  uint64_t weights = (uint64_t)ekv_program_int(&m->prog, "params_bytes", 0);
  m->plan_bytes = weights + m->cache_bytes + m->prog.arena_bytes + m->input_bytes;
  if (limit != 0 && m->plan_bytes > limit)
    return ekv_fail(&m->err, EKV_ERR_NO_MEMORY, "the memory plan needs %.1f MiB (weights %.1f, KV cache %.1f, "
                    "activations %.1f) and the limit is %.1f MiB: raise the limit, or compile with a smaller --budget "
                    "or --block", mib(m->plan_bytes), mib(weights), mib(m->cache_bytes), mib(m->prog.arena_bytes),
                    mib(limit));
  return EKV_OK;
}

/* The absolute path of the artifact, which a snapshot records so that `edgekv ask` finds it. */
static ekv_status remember_dir(ekv_model *m, const char *dir) {
  char abs[PATH_MAX];
  const char *use = realpath(dir, abs) != NULL ? abs : dir;
  m->dir = ekv_alloc(strlen(use) + 1, EKV_MEM_RUNTIME);
  if (m->dir == NULL) return ekv_fail(&m->err, EKV_ERR_NO_MEMORY, "out of memory");
  memcpy(m->dir, use, strlen(use) + 1);
  return EKV_OK;
}

ekv_status ekv_model_open(const char *artifact_dir, const ekv_model_options *opts, ekv_model **out) {
  double t0 = ekv_now();
  ekv_model_options defaults;
  ekv_model_options_init(&defaults);
  if (opts == NULL) opts = &defaults;
  ekv_model *m = ekv_alloc(sizeof *m, EKV_MEM_RUNTIME);
  *out = m;
  if (m == NULL) return EKV_ERR_NO_MEMORY;
  ekv_status st = artifact_dir == NULL ? ekv_fail(&m->err, EKV_ERR_INVALID_ARG, "no artifact directory given")
                                       : read_program(m, artifact_dir);
  if (st == EKV_OK) st = ekv_manifest_check(&m->err, artifact_dir, &m->prog);
  if (st == EKV_OK) st = remember_dir(m, artifact_dir);
  if (st == EKV_OK) st = plan_memory(m, opts->mem_limit_bytes);
  if (st == EKV_OK) st = open_device(m, artifact_dir);
  if (st == EKV_OK) st = load_library(m, artifact_dir);
  if (st == EKV_OK) { /* the weight check uses the pool */
    ekv_choose_threads(opts->threads, &m->threads);
    st = ekv_threadpool_new(&m->err, m->threads.count, &m->pool);
  }
  if (st == EKV_OK) st = map_weights(m, artifact_dir, opts->verify_weights);
  if (st == EKV_OK) st = upload_constants(m);
  if (st == EKV_OK) st = open_tokenizer(m, artifact_dir);
  m->load_seconds = ekv_now() - t0;
  return st;
}

ekv_status ekv_snapshot_check(const char *artifact_dir, const char *path, char *msg, size_t cap) {
  ekv_model *m = ekv_alloc(sizeof *m, EKV_MEM_RUNTIME); /* the program only: no device, library or weights */
  if (m == NULL) {
    if (msg != NULL && cap > 0) snprintf(msg, cap, "out of memory");
    return EKV_ERR_NO_MEMORY;
  }
  ekv_status st = artifact_dir == NULL || path == NULL
                      ? ekv_fail(&m->err, EKV_ERR_INVALID_ARG, "no artifact directory or snapshot given")
                      : read_program(m, artifact_dir);
  if (st == EKV_OK) st = ekv_snapshot_check_header(&m->err, m, path);
  if (msg != NULL && cap > 0) snprintf(msg, cap, "%s", st == EKV_OK ? "" : m->err.msg);
  ekv_program_free(&m->prog);
  ekv_free(m);
  return st;
}

void ekv_model_close(ekv_model *m) {
  if (m == NULL) return;
  /* the weights in reverse order of upload, once the device is done with them; then the device */
  if (m->device != NULL && m->uploaded != NULL && m->device->finish != NULL) m->device->finish(m->device);
  for (uint32_t i = m->prog.n_buffers; m->uploaded != NULL && i-- > 0;)
    if (m->uploaded[i] != NULL) m->device->drop(m->device, m->uploaded[i]);
  ekv_free(m->uploaded);
  if (m->device != NULL) m->device->close(m->device);
  ekv_threadpool_free(m->pool);
  ekv_tokenizer_free(m->tok);
  ekv_unmap_file(&m->params);
  ekv_library_close(&m->lib);
  ekv_free(m->kernels);
  ekv_program_free(&m->prog);
  ekv_free(m->dir);
  ekv_free(m);
}

void ekv_model_get_info(const ekv_model *m, ekv_model_info *info) {
  memset(info, 0, sizeof *info);
  const ekv_program *p = &m->prog;
  info->model_id = ekv_program_str(p, "model_id");
  info->policy = ekv_program_str(p, "policy");
  info->policy_params = ekv_program_str(p, "policy_params");
  info->target_profile = ekv_program_str(p, "target_profile");
  info->target_arch = ekv_program_str(p, "target_arch");
  info->edgekv_version = ekv_program_str(p, "edgekv_version");
  info->weight_hash = ekv_program_str(p, "weight_hash");
  info->num_layers = p->num_layers;
  info->vocab_size = p->vocab_size;
  info->max_position = p->max_position;
  info->budget = p->budget;
  info->block = p->block;
  info->pseudo_rows = p->pseudo_rows;
  info->chat = (int32_t)ekv_program_int(p, "chat", 0);
  info->threads = m->pool != NULL ? ekv_threadpool_size(m->pool) : 0;
  info->weights_bytes = (uint64_t)ekv_program_int(p, "params_bytes", 0);
  info->cache_bytes = m->cache_bytes;
  info->arena_bytes = p->arena_bytes;
  info->plan_bytes = m->plan_bytes;
  info->n_kernels = (int32_t)p->n_kernels;
  info->n_calls_prefill = m->f_prefill >= 0 ? (int32_t)p->functions[m->f_prefill].call_count : 0;
  info->n_calls_decode = m->f_decode >= 0 ? (int32_t)p->functions[m->f_decode].call_count : 0;
  info->device = m->device != NULL ? m->device->name : "none";
  info->weights_check = m->weights_check;
  info->verify_seconds = m->verify_seconds;
  info->threads_cores = m->threads.cores;
  info->threads_busy = m->threads.busy;
}
