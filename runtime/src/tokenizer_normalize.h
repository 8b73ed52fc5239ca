/* Normalizers of tokenizer.ekt (tokenizer.c applies them to the text between added tokens):
 * Unicode NFC over tables the exporter wrote (section NFCT), and SentencePiece's
 * Replace(" ", "\u2581"). Invalid UTF-8 passes through byte for byte, as a unit that neither
 * decomposes nor composes. */
#ifndef EKV_TOKENIZER_NORMALIZE_H
#define EKV_TOKENIZER_NORMALIZE_H

#include <stddef.h>
#include <stdint.h>

typedef struct ekv_nfc_tables {
  const unsigned char *ccc;        /* n_ccc x (u32 first, u32 last, u32 class), sorted, disjoint */
  const unsigned char *decomp;     /* n_decomp x (u32 cp, u32 offset, u32 len), sorted by cp */
  const unsigned char *decomp_cps; /* n_decomp_cps x u32 */
  const unsigned char *comp;       /* n_comp x (u32 first, u32 second, u32 composite), sorted */
  uint32_t n_ccc, n_decomp, n_decomp_cps, n_comp;
} ekv_nfc_tables;

/* Scratch a normalizer grows; owned by the tokenizer handle. */
typedef struct ekv_norm_scratch {
  uint32_t *cps;
  size_t cps_cap;
  unsigned char *out;
  size_t out_cap;
} ekv_norm_scratch;

/* Parse and check the NFCT section body (size bytes). Returns NULL when valid, else a static
 * description of what is wrong. */
const char *ekv_nfc_parse(ekv_nfc_tables *t, const unsigned char *p, size_t size);

/* NFC of text[0, len) into s->out; *out_len its length. Returns 0, or -1 when out of memory. */
int ekv_nfc(const ekv_nfc_tables *t, ekv_norm_scratch *s, const unsigned char *text, size_t len, size_t *out_len);

/* text with every ' ' replaced by U+2581 (3 bytes) into s->out. 0, or -1 when out of memory. */
int ekv_replace_space(ekv_norm_scratch *s, const unsigned char *text, size_t len, size_t *out_len);

void ekv_norm_scratch_free(ekv_norm_scratch *s);

#endif
