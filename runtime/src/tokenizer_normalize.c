/* tokenizer_normalize.c — NFC (Unicode canonical decomposition, canonical ordering, canonical
 * composition) over tables measured by the exporter on HF tokenizers' own NFC, and SentencePiece's
 * space replacement. Hangul syllables are composed and decomposed arithmetically (Unicode 3.12),
 * so the tables leave them out. */
#include "tokenizer_normalize.h"

#include <stdlib.h>
#include <string.h>

#include "reader.h"
#include "tokenizer_internal.h"

#define INVALID_UNIT 0x80000000u /* | byte: an ill-formed byte kept as it is */
#define SBASE 0xAC00u
#define LBASE 0x1100u
#define VBASE 0x1161u
#define TBASE 0x11A7u
#define LCOUNT 19u
#define VCOUNT 21u
#define TCOUNT 28u
#define NCOUNT (VCOUNT * TCOUNT)
#define SCOUNT (LCOUNT * NCOUNT)

const char *ekv_nfc_parse(ekv_nfc_tables *t, const unsigned char *p, size_t size) {
  memset(t, 0, sizeof *t);
  if (size < 16) return "normalization tables section truncated in its counts";
  t->n_ccc = ekv_le32(p);
  t->n_decomp = ekv_le32(p + 4);
  t->n_decomp_cps = ekv_le32(p + 8);
  t->n_comp = ekv_le32(p + 12);
  uint64_t need = 16 + 12ull * t->n_ccc + 12ull * t->n_decomp + 4ull * t->n_decomp_cps + 12ull * t->n_comp;
  if (need != size) return "normalization tables section size does not match its counts";
  t->ccc = p + 16;
  t->decomp = t->ccc + 12ull * t->n_ccc;
  t->decomp_cps = t->decomp + 12ull * t->n_decomp;
  t->comp = t->decomp_cps + 4ull * t->n_decomp_cps;
  uint32_t prev_last = 0;
  for (uint32_t i = 0; i < t->n_ccc; i++) {
    uint32_t first = ekv_le32(t->ccc + 12ull * i), last = ekv_le32(t->ccc + 12ull * i + 4);
    uint32_t cls = ekv_le32(t->ccc + 12ull * i + 8);
    if (first > last || last > 0x10FFFFu || cls == 0 || cls > 255 || (i > 0 && first <= prev_last))
      return "normalization tables: combining classes out of order";
    prev_last = last;
  }
  for (uint32_t i = 0; i < t->n_decomp; i++) {
    const unsigned char *e = t->decomp + 12ull * i;
    uint32_t cp = ekv_le32(e), off = ekv_le32(e + 4), len = ekv_le32(e + 8);
    if ((i > 0 && cp <= ekv_le32(e - 12)) || len == 0 || len > 18 || off > t->n_decomp_cps ||
        len > t->n_decomp_cps - off)
      return "normalization tables: decompositions out of order or past their code points";
    for (uint32_t k = 0; k < len; k++)
      if (ekv_le32(t->decomp_cps + 4ull * (off + k)) > 0x10FFFFu) return "normalization tables: bad code point";
  }
  for (uint32_t i = 1; i < t->n_comp; i++) {
    const unsigned char *e = t->comp + 12ull * i;
    uint64_t key = (uint64_t)ekv_le32(e) << 32 | ekv_le32(e + 4);
    uint64_t prev = (uint64_t)ekv_le32(e - 12) << 32 | ekv_le32(e - 8);
    if (key <= prev) return "normalization tables: compositions out of order";
  }
  return NULL;
}

static uint32_t ccc_of(const ekv_nfc_tables *t, uint32_t cp) {
  if (cp < 0x300 || (cp & INVALID_UNIT)) return 0;
  size_t lo = 0, hi = t->n_ccc;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const unsigned char *e = t->ccc + 12 * mid;
    if (cp < ekv_le32(e))
      hi = mid;
    else if (cp > ekv_le32(e + 4))
      lo = mid + 1;
    else
      return ekv_le32(e + 8);
  }
  return 0;
}

/* the full canonical decomposition of cp (not Hangul), or NULL */
static const unsigned char *decomposition(const ekv_nfc_tables *t, uint32_t cp, uint32_t *len) {
  size_t lo = 0, hi = t->n_decomp;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const unsigned char *e = t->decomp + 12 * mid;
    uint32_t c = ekv_le32(e);
    if (cp < c)
      hi = mid;
    else if (cp > c)
      lo = mid + 1;
    else {
      *len = ekv_le32(e + 8);
      return t->decomp_cps + 4ull * ekv_le32(e + 4);
    }
  }
  return NULL;
}

/* the primary composite of (a, b), or 0 */
static uint32_t compose(const ekv_nfc_tables *t, uint32_t a, uint32_t b) {
  if ((a | b) & INVALID_UNIT) return 0;
  if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
    return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
  if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE && b < TBASE + TCOUNT)
    return a + (b - TBASE);
  uint64_t key = (uint64_t)a << 32 | b;
  size_t lo = 0, hi = t->n_comp;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const unsigned char *e = t->comp + 12 * mid;
    uint64_t k = (uint64_t)ekv_le32(e) << 32 | ekv_le32(e + 4);
    if (key < k)
      hi = mid;
    else if (key > k)
      lo = mid + 1;
    else
      return ekv_le32(e + 8);
  }
  return 0;
}

static int grow(void **buf, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t cap2 = *cap * 2 > need ? *cap * 2 : need;
  if (cap2 < 256) cap2 = 256;
  if (cap2 > SIZE_MAX / elem) return -1;
  void *p = realloc(*buf, cap2 * elem);
  if (p == NULL) return -1;
  *buf = p;
  *cap = cap2;
  return 0;
}

static size_t put_utf8(unsigned char *o, uint32_t cp) {
  if (cp & INVALID_UNIT) {
    o[0] = (unsigned char)(cp & 0xFF);
    return 1;
  }
  if (cp < 0x80) {
    o[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (unsigned char)(0xC0 | cp >> 6);
    o[1] = (unsigned char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (unsigned char)(0xE0 | cp >> 12);
    o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (unsigned char)(0xF0 | cp >> 18);
  o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (unsigned char)(0x80 | (cp & 0x3F));
  return 4;
}

int ekv_nfc(const ekv_nfc_tables *t, ekv_norm_scratch *s, const unsigned char *text, size_t len, size_t *out_len) {
  /* 1. decompose: at most 18 code points per input byte-unit (the longest canonical
   * decomposition), so grow as we go */
  size_t n = 0;
  for (size_t p = 0; p < len;) {
    uint32_t cp;
    size_t l;
    if (text[p] < 0x80) {
      cp = text[p];
      l = 1;
    } else if (ekv_utf8_next(text + p, len - p, &cp, &l) != EKV_UTF8_CHAR) {
      cp = INVALID_UNIT | text[p];
      l = 1;
    }
    p += l;
    if (grow((void **)&s->cps, &s->cps_cap, n + 18, sizeof(uint32_t)) != 0) return -1;
    uint32_t dlen;
    const unsigned char *d;
    if (cp >= SBASE && cp < SBASE + SCOUNT) {
      uint32_t si = cp - SBASE;
      s->cps[n++] = LBASE + si / NCOUNT;
      s->cps[n++] = VBASE + (si % NCOUNT) / TCOUNT;
      if (si % TCOUNT) s->cps[n++] = TBASE + si % TCOUNT;
    } else if (cp >= 0xC0 && !(cp & INVALID_UNIT) && (d = decomposition(t, cp, &dlen)) != NULL) {
      for (uint32_t k = 0; k < dlen; k++) s->cps[n++] = ekv_le32(d + 4ull * k);
    } else {
      s->cps[n++] = cp;
    }
  }
  /* 2. canonical ordering: a stable insertion sort of each run of non-starters by class */
  for (size_t i = 1; i < n; i++) {
    uint32_t c = s->cps[i], cc = ccc_of(t, c);
    if (cc == 0) continue;
    size_t j = i;
    while (j > 0) {
      uint32_t pc = ccc_of(t, s->cps[j - 1]);
      if (pc <= cc) break; /* a starter (0) or a class not above: stop */
      s->cps[j] = s->cps[j - 1];
      j--;
    }
    s->cps[j] = c;
  }
  /* 3. canonical composition (UAX #15's algorithm) */
  size_t m = 0;
  if (n > 0) {
    size_t starter = 0;
    uint32_t last_class = ccc_of(t, s->cps[0]);
    int have_starter = last_class == 0;
    if (!have_starter) last_class = 256;
    m = 1;
    for (size_t i = 1; i < n; i++) {
      uint32_t c = s->cps[i], cc = ccc_of(t, c);
      uint32_t comp = have_starter ? compose(t, s->cps[starter], c) : 0;
      if (comp != 0 && (last_class < cc || last_class == 0)) {
        s->cps[starter] = comp;
        continue;
      }
      if (cc == 0) {
        starter = m;
        have_starter = 1;
      }
      last_class = cc;
      s->cps[m++] = c;
    }
  }
  if (grow((void **)&s->out, &s->out_cap, m * 4 + 1, 1) != 0) return -1;
  size_t o = 0;
  for (size_t i = 0; i < m; i++) o += put_utf8(s->out + o, s->cps[i]);
  *out_len = o;
  return 0;
}

int ekv_replace_space(ekv_norm_scratch *s, const unsigned char *text, size_t len, size_t *out_len) {
  if (len > (SIZE_MAX - 1) / 3 || grow((void **)&s->out, &s->out_cap, len * 3 + 1, 1) != 0) return -1;
  size_t o = 0;
  for (size_t p = 0; p < len; p++) {
    if (text[p] == ' ') {
      s->out[o++] = 0xE2;
      s->out[o++] = 0x96;
      s->out[o++] = 0x81;
    } else {
      s->out[o++] = text[p];
    }
  }
  *out_len = o;
  return 0;
}

void ekv_norm_scratch_free(ekv_norm_scratch *s) {
  free(s->cps);
  free(s->out);
  s->cps = NULL;
  s->out = NULL;
  s->cps_cap = s->out_cap = 0;
}
