/* Prefill, then sample and decode, streaming each token's text at UTF-8 character boundaries. */
#include <string.h>

#include "model.h"

ekv_status ekv_session_generate(ekv_session *s, const int32_t *prompt, size_t n, int32_t max_new,
                                ekv_sampler *sampler, ekv_progress_fn progress, ekv_token_fn on_token, void *user,
                                int32_t *out_ids, size_t cap, size_t *n_out) {
  ekv_model *m = s->model;
  const ekv_program *p = &m->prog;
  *n_out = 0;
  if (max_new < 0) return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "max_new_tokens must be 0 or more");
  if (s->position + n + (size_t)max_new > (size_t)p->max_position && !s->allow_beyond_context)
    return ekv_fail(&s->err, EKV_ERR_INVALID_ARG, "prompt (%zu tokens) + output (%d) = %zu tokens is past the "
                    "model's trained context of %d; shorten the prompt, or opt in with --allow-beyond-context", n,
                    max_new, n + (size_t)max_new, p->max_position);
  EKV_TRY(ekv_session_prefill(s, prompt, n, progress, user));
  int32_t stops[8];
  size_t n_stops = 0;
  if (s->n_stop_ids >= 0) {
    n_stops = (size_t)s->n_stop_ids;
    memcpy(stops, s->stop_ids, sizeof(int32_t) * n_stops);
  } else if (m->tok != NULL) {
    n_stops = ekv_tokenizer_stop_ids(m->tok, stops, 8);
    if (n_stops > 8) n_stops = 8;
  }
  ekv_utf8_stream stream;
  ekv_utf8_stream_init(&stream);
  char text[1024]; /* ekv_utf8_stream_push needs 4 × (piece + 4) bytes */
  for (int32_t i = 0; i < max_new; i++) {
    if (atomic_load(&s->cancel)) return ekv_fail(&s->err, EKV_ERR_CANCELLED, "generation cancelled after %d tokens", i);
    int32_t tok = ekv_sampler_sample(sampler, s->logits, p->vocab_size);
    if (out_ids != NULL && *n_out < cap) out_ids[*n_out] = tok;
    (*n_out)++;
    int stop = 0;
    for (size_t k = 0; k < n_stops; k++) stop |= tok == stops[k];
    int last_token = stop || i == max_new - 1;
    if (on_token != NULL) {
      size_t blen = 0, off = 0;
      const char *bytes = m->tok != NULL && !ekv_tokenizer_is_special(m->tok, tok)
                              ? ekv_tokenizer_token_bytes(m->tok, tok, &blen) : NULL;
      if (bytes == NULL) blen = 0;
      do { /* a token's bytes in pieces of at most 200: its text is held back at character boundaries */
        size_t piece = blen - off < 200 ? blen - off : 200;
        size_t len = piece ? ekv_utf8_stream_push(&stream, bytes + off, piece, text, sizeof text) : 0;
        off += piece;
        int last_piece = off >= blen;
        if (last_piece && last_token) len += ekv_utf8_stream_flush(&stream, text + len, sizeof text - len);
        if ((len > 0 || last_piece) && on_token(user, tok, text, len) != 0) return EKV_OK;
      } while (off < blen);
    }
    if (last_token) break;
    EKV_TRY(ekv_session_decode(s, tok));
  }
  return EKV_OK;
}
