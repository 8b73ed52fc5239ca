/* ekv_session: the caches, the arena and the inputs, allocated once; every kernel argument
 * bound once; prefill (the block loop, pseudo rows, per-prompt preparation) and decode. */
#include <string.h>

#include "alloc.h"
#include "model.h"
#include "reconstruct.h"

const char *ekv_session_last_error(const ekv_session *s) {
  return s == NULL ? "out of memory (no session handle)" : s->err.msg;
}

static int dl_code(uint8_t code) { return code == EKV_DT_FLOAT ? kDLFloat : code == EKV_DT_UINT ? kDLUInt : kDLInt; }

static ekv_status device_failed(ekv_session *s, const char *what) {
  return ekv_fail(&s->err, EKV_ERR_DEVICE, "%s: %s", what, s->model->device->err.msg);
}

static ekv_status place_buffers(ekv_session *s) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  ekv_device *dev = m->device;
  s->arena = dev->alloc(dev, p->arena_bytes ? p->arena_bytes : 1);
  if (s->arena == NULL)
    return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate the %llu-byte activation arena on the %s device",
                    (unsigned long long)p->arena_bytes, dev->name);
  s->logits_host = dev->host_memory ? NULL : ekv_alloc(sizeof(float) * (size_t)p->vocab_size, EKV_MEM_RUNTIME);
  if (!dev->host_memory && s->logits_host == NULL) return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate logits");
  for (uint32_t i = 0; i < p->n_buffers; i++) {
    const ekv_buffer_desc *b = &p->buffers[i];
    switch (b->kind) {
      case EKV_BUF_INPUT:
      case EKV_BUF_CACHE:
        s->owned[i] = dev->alloc(dev, b->nbytes ? b->nbytes : 1);
        if (s->owned[i] == NULL)
          return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate %llu bytes for %s on the %s device",
                          (unsigned long long)b->nbytes, b->name, dev->name);
        s->data[i] = s->owned[i];
        /* the host side of an input: the buffer itself on the CPU, a staging copy for a device */
        s->staging[i] = b->kind != EKV_BUF_INPUT || dev->host_memory ? s->data[i]
                                                                      : ekv_alloc(b->nbytes + 1, EKV_MEM_RUNTIME);
        if (s->staging[i] == NULL) return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate %s", b->name);
        break;
      case EKV_BUF_WEIGHT:
      case EKV_BUF_CONSTANT:
        s->data[i] = m->uploaded[i]; /* placed once per model */
        break;
      case EKV_BUF_ARENA:
        s->views[i] = dev->view(dev, s->arena, b->a, b->nbytes ? b->nbytes : 1);
        if (s->views[i] == NULL) return device_failed(s, "cannot place an arena tensor");
        s->data[i] = s->views[i];
        break;
      case EKV_BUF_VIEW:
        s->data[i] = s->data[b->a];
        s->staging[i] = s->staging[b->a];
        break;
    }
    DLTensor *t = &s->tensors[i];
    t->data = s->data[i];
    t->device = dev->dl;
    t->ndim = b->ndim;
    t->dtype.code = (uint8_t)dl_code(b->code);
    t->dtype.bits = b->bits;
    t->dtype.lanes = 1;
    t->shape = (int64_t *)(uintptr_t)b->shape; /* kernels read the shape, never write it */
    t->strides = NULL;
    t->byte_offset = 0;
  }
  return EKV_OK;
}

static void bind_arguments(ekv_session *s) {
  const ekv_program *p = &s->model->prog;
  for (uint32_t i = 0; i < p->n_args; i++) {
    const ekv_arg_desc *a = &p->args[i];
    TVMFFIAny *any = &s->args[i];
    memset(any, 0, sizeof *any);
    if (a->kind == EKV_ARG_BUFFER) {
      any->type_index = kTVMFFIDLTensorPtr;
      any->v_ptr = &s->tensors[a->buffer];
    } else if (a->kind == EKV_ARG_INT) {
      any->type_index = kTVMFFIInt;
      any->v_int64 = a->i;
    } else {
      any->type_index = kTVMFFIFloat;
      any->v_float64 = a->f;
    }
  }
}

ekv_status ekv_session_new(ekv_model *m, ekv_session **out) {
  ekv_session *s = ekv_alloc(sizeof *s, EKV_MEM_RUNTIME);
  *out = s;
  if (s == NULL) return EKV_ERR_NO_MEMORY;
  if (m == NULL || m->pool == NULL) return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "the model is not open");
  s->model = m;
  const ekv_program *p = &m->prog;
  s->data = ekv_alloc(sizeof(void *) * (p->n_buffers + 1u), EKV_MEM_RUNTIME);
  s->owned = ekv_alloc(sizeof(void *) * (p->n_buffers + 1u), EKV_MEM_RUNTIME);
  s->views = ekv_alloc(sizeof(void *) * (p->n_buffers + 1u), EKV_MEM_RUNTIME);
  s->staging = ekv_alloc(sizeof(void *) * (p->n_buffers + 1u), EKV_MEM_RUNTIME);
  s->tensors = ekv_alloc(sizeof(DLTensor) * (p->n_buffers + 1u), EKV_MEM_RUNTIME);
  s->args = ekv_alloc(sizeof(TVMFFIAny) * (p->n_args + 1u), EKV_MEM_RUNTIME);
  if (s->data == NULL || s->owned == NULL || s->views == NULL || s->staging == NULL || s->tensors == NULL ||
      s->args == NULL)
    return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate the session's tables");
  EKV_TRY(place_buffers(s));
  int64_t qrows = ekv_program_int(p, "question_rows", 0);
  if (qrows > 0 && (s->question = ekv_alloc(sizeof(int32_t) * (size_t)qrows, EKV_MEM_RUNTIME)) == NULL)
    return ekv_fail(&s->err, EKV_ERR_NO_MEMORY, "cannot allocate the question rows");
  bind_arguments(s);
  s->n_stop_ids = -1;
  ekv_session_reset(s);
  s->stats.load_seconds = m->load_seconds;
  return EKV_OK;
}

void ekv_session_free(ekv_session *s) {
  if (s == NULL) return;
  if (s->model != NULL) ekv_snapshot_release(s);
  ekv_device *dev = s->model != NULL ? s->model->device : NULL;
  uint32_t n = dev != NULL ? s->model->prog.n_buffers : 0;
  /* device buffers in reverse order of creation, after the device's queue is done with them:
   * the arena's views (sub-buffers), then the caches and inputs, then the arena itself */
  if (dev != NULL && dev->finish != NULL) dev->finish(dev);
  for (uint32_t i = n; s->views != NULL && i-- > 0;)
    if (s->views[i] != NULL) {
      dev->drop(dev, s->views[i]);
      s->views[i] = NULL;
    }
  for (uint32_t i = n; i-- > 0;) {
    if (s->staging != NULL && s->owned != NULL && s->staging[i] != NULL && s->staging[i] != s->owned[i] &&
        s->model->prog.buffers[i].kind == EKV_BUF_INPUT)
      ekv_free(s->staging[i]);
    if (s->owned != NULL && s->owned[i] != NULL) {
      dev->free(dev, s->owned[i]);
      s->owned[i] = NULL;
    }
  }
  if (dev != NULL && s->arena != NULL) dev->free(dev, s->arena);
  s->arena = NULL;
  ekv_free(s->logits_host);
  ekv_free(s->question);
  ekv_free(s->views);
  ekv_free(s->staging);
  ekv_free(s->data);
  ekv_free(s->owned);
  ekv_free(s->tensors);
  ekv_free(s->args);
  ekv_free(s);
}

void ekv_session_bind_caches(ekv_session *s, void *const *cache_data) {
  const ekv_program *p = &s->model->prog;
  for (uint32_t i = 0; i < p->n_buffers; i++) {
    const ekv_buffer_desc *b = &p->buffers[i];
    if (b->kind == EKV_BUF_CACHE) s->data[i] = cache_data != NULL ? cache_data[i] : s->owned[i];
    else if (b->kind == EKV_BUF_VIEW) s->data[i] = s->data[b->a]; /* views follow their base */
    else continue;
    s->tensors[i].data = s->data[i];
  }
}

static void *cache_tensor(const ekv_session *s, int32_t layer, int field) {
  const ekv_program *p = &s->model->prog;
  return s->data[p->cache_buffer[(size_t)layer * p->n_fields + (uint32_t)field]];
}

void ekv_session_reset(ekv_session *s) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  static const int32_t zero = 0;
  ekv_snapshot_release(s); /* back to the session's own caches */
  for (int32_t l = 0; l < p->num_layers; l++) {
    for (uint32_t f = 0; f < p->n_fields; f++) {
      const ekv_field_desc *fd = &p->fields[f];
      uint32_t id = p->cache_buffer[(size_t)l * p->n_fields + f];
      if (fd->has_init) m->device->write(m->device, s->data[id], 0, p->constants + fd->init_offset, p->buffers[id].nbytes);
      else if ((int)f == m->fill_field) m->device->write(m->device, s->data[id], 0, &zero, sizeof zero);
    }
  }
  s->position = 0;
  s->logits = NULL;
  atomic_store(&s->cancel, 0);
  double load = s->stats.load_seconds;
  memset(&s->stats, 0, sizeof s->stats);
  s->stats.load_seconds = load;
}

void ekv_session_cancel(ekv_session *s) {
  if (s != NULL) atomic_store(&s->cancel, 1);
}

size_t ekv_session_position(const ekv_session *s) { return s->position; }
void ekv_session_allow_beyond_context(ekv_session *s, int allow) { s->allow_beyond_context = allow != 0; }

void ekv_session_set_stop_ids(ekv_session *s, const int32_t *ids, size_t n) {
  size_t cap = sizeof s->stop_ids / sizeof s->stop_ids[0];
  s->n_stop_ids = (int)(n < cap ? n : cap);
  for (int i = 0; i < s->n_stop_ids; i++) s->stop_ids[i] = ids[i];
}
const float *ekv_session_logits(const ekv_session *s) { return s->logits; }

ekv_status ekv_run_function(ekv_session *s, int function) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  const ekv_function_desc *f = &p->functions[function];
  ekv_device *dev = m->device;
  if (!dev->host_memory) /* the inputs the caller filled in, onto the device */
    for (uint32_t i = 0; i < f->in_count; i++) {
      uint32_t id = p->func_buffers[f->in_begin + i];
      if (dev->write(dev, s->data[id], 0, s->staging[id], p->buffers[id].nbytes) != EKV_OK)
        return device_failed(s, "cannot copy an input to the device");
    }
  ekv_set_current(m->pool, m->device);
  for (uint32_t c = 0; c < f->call_count; c++) {
    if (atomic_load(&s->cancel)) { /* between kernels: a cancel (SIGINT) ends the work within one kernel */
      ekv_set_current(NULL, NULL);
      ekv_workspace_release();
      return ekv_fail(&s->err, EKV_ERR_CANCELLED, "cancelled inside %s (kernel call %u of %u); reset the session "
                      "before using it again", f->name, c, f->call_count);
    }
    const ekv_call_desc *call = &p->calls[f->call_begin + c];
    TVMFFIAny ret;
    memset(&ret, 0, sizeof ret);
    ekv_kernel_error_clear();
    int rc = m->kernels[call->kernel](NULL, &s->args[call->arg_begin], (int32_t)call->arg_count, &ret);
    if (rc != 0) {
      ekv_set_current(NULL, NULL);
      ekv_workspace_release();
      return ekv_fail(&s->err, EKV_ERR_KERNEL, "kernel %s (call %u of %s) failed: %s", p->kernels[call->kernel], c,
                      f->name, ekv_kernel_error()[0] ? ekv_kernel_error() : "no message");
    }
  }
  ekv_set_current(NULL, NULL);
  ekv_workspace_release();
  const void *logits = s->data[p->func_buffers[f->out_begin]];
  if (dev->host_memory) {
    s->logits = logits;
  } else { /* the one output the host needs; reading it also waits for the queued kernels */
    if (dev->read(dev, logits, 0, s->logits_host, sizeof(float) * (size_t)p->vocab_size) != EKV_OK)
      return device_failed(s, "the device failed running the program");
    s->logits = s->logits_host;
  }
  return EKV_OK;
}

void *ekv_function_input(ekv_session *s, int function, const char *name) {
  const ekv_program *p = &s->model->prog;
  const ekv_function_desc *f = &p->functions[function];
  for (uint32_t i = 0; i < f->in_count; i++) {
    uint32_t id = p->func_buffers[f->in_begin + i];
    if (strcmp(p->buffers[id].name, name) == 0) return s->staging[id];
  }
  return NULL;
}

static int32_t cache_fill(const ekv_session *s, int32_t layer) {
  int32_t fill = -1; /* a device read that fails reads as an impossible fill */
  ekv_device *dev = s->model->device;
  dev->read(dev, cache_tensor(s, layer, s->model->fill_field), 0, &fill, sizeof fill);
  return fill;
}

/* ---- prefill ------------------------------------------------------------------------------ */

/* The inputs of one prefill call: n real tokens at positions start…, padding to B, then the
 * program's extra rows (compiler/passes/pseudo_rows.py): the session's question at the positions after
 * the prompt, else DapQ's pseudo tokens (its "where matters more than what": the first `prefix`
 * and the last w − prefix prompt tokens at positions after the prompt, or after the block), then
 * padding at position −1, which the kernels skip. */
typedef struct {
  const int32_t *prompt;
  size_t prompt_len;
  size_t end; /* the position after the prompt's last token (a continuation starts past 0) */
  int32_t rows, w, prefix, block_positions; /* extra rows; of those, DapQ's pseudo window */
  int reconstruct; /* the extra rows are `--compress reconstruct`'s (reconstruct.c) */
} pseudo_rows;

static ekv_status fill_step_inputs(ekv_session *s, int function, const int32_t *ids, size_t n, size_t start,
                                   const pseudo_rows *pr) {
  const ekv_program *p = &s->model->prog;
  int64_t *tokens = ekv_function_input(s, function, "tokens");
  int64_t *positions = ekv_function_input(s, function, "positions");
  int32_t *n_valid = ekv_function_input(s, function, "n_valid");
  if (tokens == NULL || positions == NULL || n_valid == NULL)
    return ekv_fail(&s->err, EKV_ERR_FORMAT, "the program's %s function lacks tokens/positions/n_valid inputs; "
                    "recompile the artifact", p->functions[function].name);
  size_t B = (size_t)p->block, rows = B + (size_t)pr->rows;
  for (size_t r = 0; r < rows; r++) {
    tokens[r] = r < n ? ids[r] : 0;
    positions[r] = r < B ? (int64_t)(start + r) : -1;
  }
  *n_valid = (int32_t)n;
  int64_t *prompt_len = ekv_function_input(s, function, "prompt_len"); /* the per-prompt function's */
  if (prompt_len != NULL) *prompt_len = (int64_t)pr->prompt_len;
  if (s->question_n > 0) {
    for (size_t r = 0; r < s->question_n; r++) {
      tokens[B + r] = s->question[r];
      positions[B + r] = (int64_t)(pr->end + r);
    }
    return EKV_OK;
  }
  if (pr->reconstruct) {
    /* a document longer than N read from position 0: each block's reconstruction rows; otherwise
     * (a continuation, a short document) every extra row stays padding */
    if (pr->end != pr->prompt_len || pr->prompt_len <= (size_t)p->budget) return EKV_OK;
    size_t at = (size_t)(ids - pr->prompt);
    if (ekv_reconstruct_rows(p, pr->prompt, at, n, tokens + B, positions + B, (size_t)pr->rows) < 0)
      return ekv_fail(&s->err, EKV_ERR_FORMAT, "the program's reconstruction rows do not fit its %d extra rows; "
                      "recompile the artifact", pr->rows);
    return EKV_OK;
  }
  if (pr->w == 0) return EKV_OK;
  size_t L = pr->prompt_len, head = (size_t)pr->prefix < L ? (size_t)pr->prefix : L;
  size_t tail = (size_t)(pr->w - pr->prefix) < L ? (size_t)(pr->w - pr->prefix) : L;
  size_t have = head + tail;
  size_t at = pr->block_positions ? (start + B < pr->end ? start + B : pr->end) : pr->end;
  if (have < (size_t)pr->w) {
    /* a prompt shorter than the window gives fewer pseudo tokens: harmless unless this step
     * evicts (their scores are read only then) */
    if ((size_t)cache_fill(s, 0) + n > (size_t)p->budget)
      return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "the prompt gives only %zu pseudo tokens but this artifact was "
                      "compiled for a window of %d: recompile with --policy-arg window=%zu, or a budget of at least "
                      "%zu", have, pr->w, have, (size_t)cache_fill(s, 0) + n);
    at = start + B;
  }
  for (size_t r = 0; r < (size_t)pr->w; r++) {
    size_t k = have ? r % have : 0;
    int32_t id = have == 0 ? 0 : k < head ? pr->prompt[k] : pr->prompt[L - tail + (k - head)];
    tokens[B + r] = id;
    positions[B + r] = (int64_t)(at + r);
  }
  return EKV_OK;
}

int32_t ekv_model_question_rows(const ekv_model *m) {
  return m == NULL ? 0 : (int32_t)ekv_program_int(&m->prog, "question_rows", 0);
}

ekv_status ekv_session_set_question(ekv_session *s, const int32_t *ids, size_t n) {
  const ekv_program *p = &s->model->prog;
  int32_t rows = ekv_model_question_rows(s->model);
  if (ids == NULL || n == 0) {
    s->question_n = 0;
    return EKV_OK;
  }
  if (rows == 0)
    return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "this '%s' artifact was compiled without question rows, so its "
                    "blocks cannot score with a question; compile it with --question-rows N (N >= the question's "
                    "tokens), or read the document without the question", ekv_program_str(p, "policy"));
  if (n > (size_t)rows)
    return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "the question has %zu tokens and this artifact was compiled for "
                    "questions of at most %d; shorten the question, or compile with --question-rows %zu or more", n,
                    rows, n);
  for (size_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= p->vocab_size)
      return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "token %zu of the question is id %d, outside the vocabulary "
                      "(0..%d)", i, ids[i], p->vocab_size - 1);
  memcpy(s->question, ids, sizeof(int32_t) * n);
  s->question_n = n;
  return EKV_OK;
}

static ekv_status check_prompt(ekv_session *s, const int32_t *ids, size_t n) {
  const ekv_program *p = &s->model->prog;
  if (n == 0) return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "the prompt is empty; give at least one token");
  for (size_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= p->vocab_size)
      return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "token %zu of the prompt is id %d, outside the vocabulary "
                      "(0..%d)", i, ids[i], p->vocab_size - 1);
  if (!ekv_program_int(p, "evicts", 1) && s->position + n > (size_t)p->budget)
    return ekv_fail(&s->err, EKV_ERR_CAPACITY, "policy '%s' never evicts, but the sequence needs %zu cache entries "
                    "and this artifact's budget is %d; compile with --budget %zu or more, or choose an evicting policy",
                    ekv_program_str(p, "policy"), s->position + n, p->budget, s->position + n);
  if (s->position + n > (size_t)p->max_position && !s->allow_beyond_context)
    return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "the sequence reaches %zu tokens, past the model's trained context "
                    "of %d; shorten the prompt, or opt in with --allow-beyond-context", s->position + n,
                    p->max_position);
  return EKV_OK;
}

ekv_status ekv_session_prefill(ekv_session *s, const int32_t *ids, size_t n, ekv_progress_fn progress, void *user) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  EKV_TRY(check_prompt(s, ids, n));
  pseudo_rows pr = {ids, n, s->position + n, p->pseudo_rows,
                    (int32_t)ekv_program_int(p, "pseudo_window", p->pseudo_rows),
                    (int32_t)ekv_program_int(p, "pseudo_prefix", 0),
                    strcmp(ekv_program_str(p, "pseudo_positions"), "block") == 0,
                    strcmp(ekv_program_str(p, "pseudo_positions"), "reconstruct") == 0};
  double t0 = ekv_now();
  size_t B = (size_t)p->block;
  if (m->f_prepare >= 0 && s->position == 0 && (int64_t)n > ekv_program_int(p, "prepare_min_prompt", 0)) {
    /* the program's per-prompt function, before the first block (D2O: the layer budgets) */
    size_t first = n < B ? n : B;
    EKV_TRY(fill_step_inputs(s, m->f_prepare, ids, first, s->position, &pr));
    EKV_TRY(ekv_run_function(s, m->f_prepare));
    s->stats.prepare_seconds += ekv_now() - t0;
  }
  for (size_t done = 0; done < n;) {
    if (atomic_load(&s->cancel)) return ekv_fail(&s->err, EKV_ERR_CANCELLED, "prefill cancelled after %zu of %zu "
                                                 "tokens", done, n);
    size_t nb = n - done < B ? n - done : B;
    double tb = ekv_now();
    EKV_TRY(fill_step_inputs(s, m->f_prefill, ids + done, nb, s->position, &pr));
    EKV_TRY(ekv_run_function(s, m->f_prefill));
    if (s->stats.prefill_blocks == 0) s->stats.first_block_seconds = ekv_now() - tb;
    s->position += nb;
    done += nb;
    s->stats.prefill_blocks++;
    if (progress != NULL && progress(user, done, n) != 0) {
      s->stats.prefill_seconds += ekv_now() - t0;
      return ekv_fail(&s->err, EKV_ERR_CANCELLED, "prefill cancelled after %zu of %zu tokens", done, n);
    }
  }
  s->stats.prefill_seconds += ekv_now() - t0;
  s->stats.prefill_tokens += n;
  return EKV_OK;
}

ekv_status ekv_session_decode(ekv_session *s, int32_t token) {
  ekv_model *m = s->model;
  EKV_TRY(check_prompt(s, &token, 1));
  double t0 = ekv_now();
  int64_t *tokens = ekv_function_input(s, m->f_decode, "tokens");
  int64_t *positions = ekv_function_input(s, m->f_decode, "positions");
  if (tokens == NULL || positions == NULL)
    return ekv_fail(&s->err, EKV_ERR_FORMAT, "the program's decode function lacks tokens/positions inputs");
  tokens[0] = token;
  positions[0] = (int64_t)s->position;
  EKV_TRY(ekv_run_function(s, m->f_decode));
  s->position++;
  s->stats.decode_seconds += ekv_now() - t0;
  s->stats.decode_tokens++;
  return EKV_OK;
}

ekv_status ekv_session_kept_positions(const ekv_session *s, int32_t layer, int32_t *out, size_t cap, int32_t *heads,
                                      int32_t *fill) {
  const ekv_program *p = &s->model->prog;
  if (layer < 0 || layer >= p->num_layers) return EKV_ERR_INVALID_ARG;
  const ekv_buffer_desc *pb = &p->buffers[p->cache_buffer[(size_t)layer * p->n_fields + (uint32_t)s->model->pos_field]];
  int32_t H = (int32_t)pb->shape[0], N = (int32_t)pb->shape[1], f = cache_fill(s, layer);
  if (f < 0 || f > N) return EKV_ERR_KERNEL;
  *heads = H;
  *fill = f;
  if (out == NULL || cap < (size_t)H * (size_t)f) return cap == 0 ? EKV_OK : EKV_ERR_INVALID_ARG;
  const void *pos = cache_tensor(s, layer, s->model->pos_field);
  ekv_device *dev = s->model->device;
  for (int32_t h = 0; h < H; h++)
    if (dev->read(dev, pos, sizeof(int32_t) * (size_t)h * (size_t)N, out + (size_t)h * (size_t)f,
                  sizeof(int32_t) * (size_t)f) != EKV_OK)
      return EKV_ERR_DEVICE;
  return EKV_OK;
}

void ekv_session_get_stats(const ekv_session *s, ekv_stats *st) {
  *st = s->stats;
  st->runtime_bytes_peak = ekv_mem_peak();
  st->workspace_bytes_peak = ekv_mem_kind_peak(EKV_MEM_WORKSPACE);
  st->peak_rss_bytes = ekv_peak_rss();
  st->mapped_bytes = s->model->params.size;
  st->device_bytes_peak = s->model->device->bytes_peak;
}
