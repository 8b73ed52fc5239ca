/* tokenizer_unigram.c — HF tokenizers' Unigram encoding (models/unigram/model.rs,
 * encode_optimized then tokenize) over the exporter's sorted piece table.
 *
 * The pieces are sorted bytewise, so the pieces that are prefixes of the text at a position are
 * found by narrowing a range one byte at a time (two binary searches per byte): shortest first,
 * as the trie HF walks yields them, which decides ties (a later equal score does not replace). */
#include "tokenizer_unigram.h"

#include <stdlib.h>
#include <string.h>

#include "reader.h"
#include "tokenizer_internal.h"

#define NO_ID 0xFFFFFFFFu
#define UNK_PENALTY 10.0
#define ENTRY 20u

static uint32_t piece_off(const ekv_unigram *u, size_t i) { return ekv_le32(u->entries + ENTRY * i); }
static uint32_t piece_len(const ekv_unigram *u, size_t i) { return ekv_le32(u->entries + ENTRY * i + 4); }
static int32_t piece_id(const ekv_unigram *u, size_t i) { return (int32_t)ekv_le32(u->entries + ENTRY * i + 8); }
static double piece_score(const ekv_unigram *u, size_t i) {
  uint64_t bits = ekv_le64(u->entries + ENTRY * i + 12);
  double d;
  memcpy(&d, &bits, sizeof d);
  return d;
}

static int compare_pieces(const ekv_unigram *u, size_t a, size_t b) {
  uint32_t la = piece_len(u, a), lb = piece_len(u, b);
  int c = memcmp(u->blob + piece_off(u, a), u->blob + piece_off(u, b), la < lb ? la : lb);
  return c != 0 ? c : (la < lb ? -1 : la > lb ? 1 : 0);
}

const char *ekv_unigram_parse(ekv_unigram *u, const unsigned char *p, size_t size, uint32_t n_ids) {
  memset(u, 0, sizeof *u);
  if (size < 24) return "unigram section truncated in its header";
  u->n = ekv_le32(p);
  u->blob_len = ekv_le32(p + 4);
  uint32_t flags = ekv_le32(p + 8);
  u->unk_id = ekv_le32(p + 12);
  uint64_t bits = ekv_le64(p + 16);
  double min_score;
  memcpy(&min_score, &bits, sizeof min_score);
  if ((flags & ~3u) != 0) return "unigram section has unknown flags";
  u->byte_fallback = (flags & 1u) != 0;
  u->fuse_unk = (flags & 2u) != 0;
  if (u->n == 0 || (uint64_t)24 + (uint64_t)ENTRY * u->n + u->blob_len != size)
    return "unigram section size does not match its counts";
  if (u->unk_id != NO_ID && u->unk_id >= n_ids) return "unigram section: the unknown token is not an id";
  if (!(min_score == min_score)) return "unigram section: the lowest score is not a number";
  u->unk_score = min_score - UNK_PENALTY;
  u->entries = p + 24;
  u->blob = u->entries + (size_t)ENTRY * u->n;
  for (uint32_t i = 0; i < u->n; i++) {
    uint32_t off = piece_off(u, i), len = piece_len(u, i);
    if (len == 0 || off > u->blob_len || len > u->blob_len - off) return "unigram section: a piece lies past its bytes";
    if ((uint32_t)piece_id(u, i) >= n_ids) return "unigram section: a piece's id is not an id";
    double sc = piece_score(u, i);
    if (!(sc == sc)) return "unigram section: a score is not a number";
    if (i > 0 && compare_pieces(u, i - 1, i) >= 0) return "unigram section: pieces are not sorted and unique";
  }
  return NULL;
}

/* first index in [lo, hi) whose piece, at byte d, is >= c (pieces of length d count as below
 * every byte); `above` makes it > c */
static size_t bound(const ekv_unigram *u, size_t lo, size_t hi, size_t d, unsigned c, int above) {
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int v = piece_len(u, mid) > d ? u->blob[piece_off(u, mid) + d] : -1;
    if (above ? v <= (int)c : v < (int)c)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* the piece equal to t[0, n), or -1 */
static int64_t exact_piece(const ekv_unigram *u, const unsigned char *t, size_t n) {
  size_t lo = 0, hi = u->n;
  for (size_t d = 0; d < n && lo < hi; d++) {
    size_t lo2 = bound(u, lo, hi, d, t[d], 0);
    hi = bound(u, lo2, hi, d, t[d], 1);
    lo = lo2;
  }
  return lo < hi && piece_len(u, lo) == n ? (int64_t)lo : -1;
}

static int grow_scratch(ekv_unigram_scratch *s, size_t n) {
  if (n <= s->cap) return 0;
  size_t cap = s->cap * 2 > n ? s->cap * 2 : n;
  double *score = realloc(s->score, cap * sizeof *score);
  if (score == NULL) return -1;
  s->score = score;
  int64_t *start = realloc(s->start, cap * sizeof *start);
  if (start == NULL) return -1;
  s->start = start;
  int32_t *id = realloc(s->id, cap * sizeof *id);
  if (id == NULL) return -1;
  s->id = id;
  size_t *path = realloc(s->path, cap * sizeof *path);
  if (path == NULL) return -1;
  s->path = path;
  s->cap = s->path_cap = cap;
  return 0;
}

static size_t unit_len(const unsigned char *t, size_t p, size_t len) {
  uint32_t cp;
  size_t l;
  if (t[p] < 0x80 || ekv_utf8_next(t + p, len - p, &cp, &l) != EKV_UTF8_CHAR) return 1;
  return l;
}

static void relax(ekv_unigram_scratch *s, size_t at, double score, size_t from, int32_t id) {
  if (s->start[at] < 0 || score > s->score[at]) {
    s->score[at] = score;
    s->start[at] = (int64_t)from;
    s->id[at] = id;
  }
}

/* what tokenize() does with one string of the best path */
static void emit_string(const ekv_unigram *u, const unsigned char *t, size_t a, size_t b, int32_t node_id, int is_unk,
                        const uint32_t byte_id[256], ekv_emit_fn emit, void *ctx) {
  if (!is_unk) {
    emit(ctx, node_id);
    return;
  }
  int64_t piece = exact_piece(u, t + a, b - a);
  if (piece >= 0) {
    emit(ctx, piece_id(u, (size_t)piece));
    return;
  }
  if (u->byte_fallback) {
    size_t k = a;
    while (k < b && byte_id[t[k]] != NO_ID) k++;
    if (k == b) {
      for (k = a; k < b; k++) emit(ctx, (int32_t)byte_id[t[k]]);
      return;
    }
  }
  emit(ctx, (int32_t)u->unk_id);
}

int ekv_unigram_encode(const ekv_unigram *u, ekv_unigram_scratch *s, const unsigned char *t, size_t len,
                       const uint32_t byte_id[256], ekv_emit_fn emit, void *ctx) {
  if (len == 0) return 0;
  if (len >= SIZE_MAX / 2 || grow_scratch(s, len + 1) != 0) return -1;
  for (size_t i = 0; i <= len; i++) s->start[i] = -1;
  s->score[0] = 0.0;
  for (size_t p = 0; p < len;) {
    double here = s->score[p];
    size_t mblen = unit_len(t, p, len);
    int has_single = 0;
    size_t lo = 0, hi = u->n;
    for (size_t d = 0; p + d < len && lo < hi; d++) {
      size_t lo2 = bound(u, lo, hi, d, t[p + d], 0);
      hi = bound(u, lo2, hi, d, t[p + d], 1);
      lo = lo2;
      if (lo < hi && piece_len(u, lo) == d + 1) { /* a piece ends here */
        relax(s, p + d + 1, piece_score(u, lo) + here, p, piece_id(u, lo));
        if (d + 1 == mblen) has_single = 1;
      }
    }
    if (!has_single) relax(s, p + mblen, u->unk_score + here, p, (int32_t)u->unk_id);
    p += mblen;
  }
  /* the best path, back to front, then forward with unknown runs fused */
  size_t n = 0;
  for (size_t end = len; end > 0; end = (size_t)s->start[end]) s->path[n++] = end;
  int unk_known = u->unk_id != NO_ID;
  size_t run_start = 0, run_end = 0;
  int in_run = 0;
  for (size_t k = n; k-- > 0;) {
    size_t end = s->path[k], begin = (size_t)s->start[end];
    int is_unk = unk_known && (uint32_t)s->id[end] == u->unk_id;
    if (is_unk && u->fuse_unk) {
      if (!in_run) run_start = begin;
      run_end = end;
      in_run = 1;
      continue;
    }
    if (in_run) {
      emit_string(u, t, run_start, run_end, 0, 1, byte_id, emit, ctx);
      in_run = 0;
    }
    emit_string(u, t, begin, end, s->id[end], is_unk, byte_id, emit, ctx);
  }
  if (in_run) emit_string(u, t, run_start, run_end, 0, 1, byte_id, emit, ctx);
  return 0;
}

void ekv_unigram_scratch_free(ekv_unigram_scratch *s) {
  free(s->score);
  free(s->start);
  free(s->id);
  free(s->path);
  memset(s, 0, sizeof *s);
}
