/* Weight verification at open: a corrupt params file (flash corruption, a half-finished copy) is
 * refused by the name of the first weight whose bytes no longer match the CRC-32 the exporter
 * recorded in program.ekv, before any kernel reads it. The check reads every page of the file once
 * (they are read by the first prefill anyway); a stamp beside the artifact remembers a clean check
 * of this very file, so that later opens cost a stat. The stamp's line is the contract with the
 * Python host runtime, which writes and trusts the same one (edgekv/artifact/weights_check.py). */
#include "weights_check.h"

#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"

#define STAMP_FILE ".params.verified"
#define STAMP_MAX 256

/* what the stamp vouches for: the file (device, inode, size, mtime, ctime — ctime cannot be set
 * back by a user, so a rewrite that restores the mtime still changes it) and the program it was
 * checked against */
static int stamp_line(const char *params_path, uint32_t program_crc, char *out, size_t cap) {
  struct stat st;
  if (stat(params_path, &st) != 0) return 0;
  int n = snprintf(out, cap, "edgekv-weights-verified 1 program=%08x size=%lld dev=%llu ino=%llu mtime=%lld.%09ld "
                   "ctime=%lld.%09ld\n", program_crc, (long long)st.st_size, (unsigned long long)st.st_dev,
                   (unsigned long long)st.st_ino, (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec,
                   (long long)st.st_ctim.tv_sec, (long)st.st_ctim.tv_nsec);
  return n > 0 && (size_t)n < cap;
}

static int stamp_matches(const char *stamp_path, const char *line) {
  char have[STAMP_MAX + 1];
  FILE *f = fopen(stamp_path, "rb");
  if (f == NULL) return 0;
  size_t n = fread(have, 1, STAMP_MAX, f);
  fclose(f);
  have[n] = '\0';
  return strcmp(have, line) == 0;
}

/* written to a temporary name and renamed: a reader sees the old stamp or the new one, never half */
static void write_stamp(const char *stamp_path, const char *line) {
  char tmp[PATH_MAX];
  if (snprintf(tmp, sizeof tmp, "%s.%ld", stamp_path, (long)getpid()) >= (int)sizeof tmp) return;
  FILE *f = fopen(tmp, "wb");
  if (f == NULL) return; /* a read-only artifact: it is checked at every open instead */
  int ok = fputs(line, f) >= 0;
  ok = fclose(f) == 0 && ok;
  if (!ok || rename(tmp, stamp_path) != 0) unlink(tmp);
}

typedef struct {
  const ekv_program *prog;
  const unsigned char *params;
  uint32_t *weights;       /* buffer ids of the weights */
  uint32_t *crc;           /* per weight */
} crc_job;

static int crc_task(int t, int n, void *ctx) {
  (void)n;
  crc_job *job = ctx;
  const ekv_buffer_desc *b = &job->prog->buffers[job->weights[t]];
  job->crc[t] = ekv_crc32(0, job->params + b->a, b->nbytes);
  return 0;
}

static ekv_status corrupt(ekv_model *m, const char *what, const char *params_path) {
  return ekv_fail(&m->err, EKV_ERR_MISMATCH, "%s in %s fails its checksum: the weights are corrupt (a damaged or "
                  "half-finished copy). Copy the artifact again, or recompile it; --no-verify runs it unchecked",
                  what, params_path);
}

/* Each weight's CRC, the weights spread over the pool's threads; the first mismatch in program
 * order is the one named. A program without per-weight CRCs (older than 1.2) gets the whole file's. */
static ekv_status check_crcs(ekv_model *m, const char *params_path) {
  const ekv_program *p = &m->prog;
  if (ekv_program_int(p, "weight_crc32s", 0) != 1) {
    if (ekv_crc32(0, m->params.data, m->params.size) != (uint32_t)ekv_program_int(p, "params_crc32", -1))
      return corrupt(m, "the params file", params_path);
    return EKV_OK;
  }
  uint32_t n = 0;
  for (uint32_t i = 0; i < p->n_buffers; i++) n += p->buffers[i].kind == EKV_BUF_WEIGHT;
  crc_job job = {p, m->params.data, ekv_alloc(sizeof(uint32_t) * (n + 1u), EKV_MEM_RUNTIME),
                 ekv_alloc(sizeof(uint32_t) * (n + 1u), EKV_MEM_RUNTIME)};
  ekv_status st = EKV_OK;
  if (job.weights == NULL || job.crc == NULL) {
    st = ekv_fail(&m->err, EKV_ERR_NO_MEMORY, "cannot allocate the weight checksum table");
  } else {
    uint32_t k = 0;
    for (uint32_t i = 0; i < p->n_buffers; i++)
      if (p->buffers[i].kind == EKV_BUF_WEIGHT) job.weights[k++] = i;
    if (n > 0) ekv_threadpool_run(m->pool, (int)n, crc_task, &job);
    for (uint32_t t = 0; t < n && st == EKV_OK; t++) {
      const ekv_buffer_desc *b = &p->buffers[job.weights[t]];
      if (job.crc[t] != b->crc32) {
        char what[EKV_ERR_LEN / 2];
        snprintf(what, sizeof what, "weight %s (%llu bytes at offset %llu)", b->name, (unsigned long long)b->nbytes,
                 (unsigned long long)b->a);
        st = corrupt(m, what, params_path);
      }
    }
  }
  ekv_free(job.weights);
  ekv_free(job.crc);
  return st;
}

ekv_status ekv_weights_verify(ekv_model *m, const char *dir, const char *params_path, int mode) {
  m->weights_check = EKV_WEIGHTS_UNCHECKED;
  if (mode == EKV_VERIFY_OFF) return EKV_OK;
  char stamp_path[PATH_MAX], line[STAMP_MAX];
  int have_line = ekv_path_join(stamp_path, sizeof stamp_path, dir, STAMP_FILE) &&
                  stamp_line(params_path, m->program_crc, line, sizeof line);
  if (have_line && mode == EKV_VERIFY_DEFAULT && stamp_matches(stamp_path, line)) {
    m->weights_check = EKV_WEIGHTS_STAMPED;
    return EKV_OK;
  }
  double t0 = ekv_now();
  EKV_TRY(check_crcs(m, params_path));
  m->verify_seconds = ekv_now() - t0;
  m->weights_check = EKV_WEIGHTS_CHECKED;
  if (have_line) write_stamp(stamp_path, line);
  return EKV_OK;
}
