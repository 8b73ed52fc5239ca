/* utf8.c — the UTF-8 scanner shared with the tokenizer, and the streaming decoder that turns
 * token bytes into whole characters (ekv_utf8_stream_*).
 *
 * The stream's output for any split of a byte string into pushes, followed by a flush, is
 * exactly Python's bytes.decode("utf-8", errors="replace") of the whole string: one U+FFFD per
 * maximal subpart of an ill-formed sequence (Unicode's "substitution of maximal subparts", which
 * CPython and Rust's from_utf8_lossy follow). A well-formed but incomplete sequence at the end of
 * a push is held (at most 3 bytes) until the next push completes it or shows it ill-formed;
 * flush turns a held one into a single U+FFFD, as Python does for a truncated sequence at the
 * end of its input. */
#include <string.h>

#include "edgekv.h"
#include "tokenizer_internal.h"

static const unsigned char REPLACEMENT[3] = {0xEF, 0xBF, 0xBD}; /* U+FFFD */

/* The sequence length a lead byte starts (0: not a lead byte) and the range its second byte
 * must be in (Table 3-7: E0 A0.., ED ..9F, F0 90.., F4 ..8F exclude overlongs, surrogates and
 * code points above U+10FFFF). */
static int lead_info(unsigned char b, unsigned char *lo, unsigned char *hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b == 0xE0) *lo = 0xA0;
  if (b == 0xED) *hi = 0x9F;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b == 0xF0) *lo = 0x90;
  if (b == 0xF4) *hi = 0x8F;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

ekv_utf8_unit ekv_utf8_next(const unsigned char *s, size_t n, uint32_t *cp, size_t *len) {
  unsigned char lo, hi;
  if (s[0] < 0x80) {
    *cp = s[0];
    *len = 1;
    return EKV_UTF8_CHAR;
  }
  int need = lead_info(s[0], &lo, &hi);
  if (need == 0) {
    *len = 1;
    return EKV_UTF8_INVALID;
  }
  uint32_t value = s[0] & (need == 2 ? 0x1Fu : need == 3 ? 0x0Fu : 0x07u);
  for (int k = 1; k < need; k++) {
    if ((size_t)k >= n) {
      *len = n;
      return EKV_UTF8_INCOMPLETE;
    }
    unsigned char b = s[k];
    if (b < lo || b > hi) {
      *len = (size_t)k;
      return EKV_UTF8_INVALID;
    }
    lo = 0x80;  /* only the second byte has a narrower range */
    hi = 0xBF;
    value = (value << 6) | (b & 0x3Fu);
  }
  *cp = value;
  *len = (size_t)need;
  return EKV_UTF8_CHAR;
}

size_t ekv_utf8_check(const char *text, size_t n) {
  const unsigned char *s = (const unsigned char *)text;
  size_t i = 0, len = 0;
  uint32_t cp;
  while (i < n && ekv_utf8_next(s + i, n - i, &cp, &len) == EKV_UTF8_CHAR) i += len;
  return i;
}

void ekv_utf8_stream_init(ekv_utf8_stream *s) {
  if (s == NULL) return;
  memset(s->pending, 0, sizeof s->pending);
  s->n_pending = 0;
}

/* Where decoded text goes. Output stays whole characters: once one does not fit (a caller
 * below the documented capacity) nothing more is written, rather than overrunning the buffer. */
typedef struct text_sink {
  char *out;
  size_t cap, used;
  int full;
} text_sink;

static void put(text_sink *t, const unsigned char *bytes, size_t n) {
  if (t->full || n > t->cap - t->used) {
    t->full = 1;
    return;
  }
  memcpy(t->out + t->used, bytes, n);
  t->used += n;
}

/* Emits one unit of s[0..n); returns the bytes it consumed, or 0 when s is an incomplete
 * sequence that must wait for more input. */
static size_t emit_unit(const unsigned char *s, size_t n, text_sink *t) {
  uint32_t cp;
  size_t len;
  switch (ekv_utf8_next(s, n, &cp, &len)) {
    case EKV_UTF8_CHAR: put(t, s, len); return len;
    case EKV_UTF8_INVALID: put(t, REPLACEMENT, 3); return len;
    case EKV_UTF8_INCOMPLETE: break;
  }
  return 0;
}

/* Keeps s[0..n) (an incomplete sequence, so n <= 3) for the next push. */
static void hold(ekv_utf8_stream *s, const unsigned char *bytes, size_t n) {
  memmove(s->pending, bytes, n);
  s->n_pending = (int)n;
}

size_t ekv_utf8_stream_push(ekv_utf8_stream *s, const char *in, size_t n, char *out, size_t cap) {
  if (s == NULL || out == NULL || (in == NULL && n > 0)) return 0;
  const unsigned char *src = (const unsigned char *)in;
  text_sink t = {out, cap, 0, 0};
  size_t i = 0;
  if (s->n_pending < 0 || s->n_pending > 3) s->n_pending = 0; /* a struct nobody initialised */
  if (s->n_pending > 0) {
    /* units that start in the held bytes end within the next 4 bytes of input */
    unsigned char head[8];
    size_t held = (size_t)s->n_pending, extra = n < 4 ? n : 4, pos = 0;
    memcpy(head, s->pending, held);
    if (extra > 0) memcpy(head + held, src, extra);
    s->n_pending = 0;
    while (pos < held) {
      size_t took = emit_unit(head + pos, held + extra - pos, &t);
      if (took == 0) { /* incomplete, so fewer than 4 bytes: all of in (extra == n) is held */
        hold(s, head + pos, held + extra - pos);
        return t.used;
      }
      pos += took;
    }
    i = pos - held;
  }
  while (i < n) {
    size_t took = emit_unit(src + i, n - i, &t);
    if (took == 0) {
      hold(s, src + i, n - i);
      break;
    }
    i += took;
  }
  return t.used;
}

size_t ekv_utf8_stream_flush(ekv_utf8_stream *s, char *out, size_t cap) {
  if (s == NULL) return 0;
  text_sink t = {out, cap, 0, 0};
  if (s->n_pending > 0 && out != NULL) put(&t, REPLACEMENT, 3); /* one truncated sequence: one U+FFFD */
  s->n_pending = 0;
  return t.used;
}
