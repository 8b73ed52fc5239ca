/* The Unigram model of tokenizer.ekt (section UNIG): SentencePiece pieces with scores, encoded
 * by HF tokenizers' Viterbi search (best total score; a character no piece starts with is the
 * unknown token at min_score - 10; runs of unknowns fused; an unknown run that is no piece
 * falls back to its bytes' <0xXX> tokens). Gemma 3's tokenizer, as transformers builds it from
 * the GGUF. */
#ifndef EKV_TOKENIZER_UNIGRAM_H
#define EKV_TOKENIZER_UNIGRAM_H

#include <stddef.h>
#include <stdint.h>

typedef struct ekv_unigram {
  const unsigned char *entries; /* n x (u32 offset, u32 len, u32 id, u64 score bits), sorted by text */
  const unsigned char *blob;
  uint32_t n, blob_len, unk_id;
  int byte_fallback, fuse_unk;
  double unk_score;
} ekv_unigram;

typedef struct ekv_unigram_scratch {
  double *score;
  int64_t *start; /* -1: no path ends here yet */
  int32_t *id;
  size_t cap;
  size_t *path; /* node ends, back to front */
  size_t path_cap;
} ekv_unigram_scratch;

typedef void (*ekv_emit_fn)(void *ctx, int32_t id);

/* NULL when the section is valid (ids are checked against n_ids), else what is wrong. */
const char *ekv_unigram_parse(ekv_unigram *u, const unsigned char *p, size_t size, uint32_t n_ids);
/* Encode text[0, len); byte_id: the <0xXX> token of each byte (0xFFFFFFFF: none).
 * 0, or -1 when out of memory. */
int ekv_unigram_encode(const ekv_unigram *u, ekv_unigram_scratch *s, const unsigned char *text, size_t len,
                       const uint32_t byte_id[256], ekv_emit_fn emit, void *ctx);
void ekv_unigram_scratch_free(ekv_unigram_scratch *s);

#endif
