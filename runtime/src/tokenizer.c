/* tokenizer.c — byte-level BPE over tokenizer.ekt, giving exactly the ids HF `tokenizers`
 * gives for the tokenizers edgekv/compiler/backend/tokenizer_file.py accepts (SmolLM2's and any other
 * byte-level BPE with the GPT-2 split regex, no normalizer, plain added tokens).
 *
 * File layout (written by tokenizer_file.py; all integers little-endian, unsigned):
 *
 *   header, 32 bytes
 *     0   8  magic "EKVTOKN\0"
 *     8   2  major version: 1 (another major is refused)
 *     10  2  minor version: a newer minor only adds sections, whose tags this reader skips
 *     12  4  header_len = 32 + 16 * section_count
 *     16  4  section_count, 1..64
 *     20  4  file_len: the file's size in bytes
 *     24  4  header_crc: CRC-32 (zlib's) of bytes [0, header_len) with these 4 bytes as zero
 *     28  4  reserved, 0
 *   section table at 32, section_count entries of 16 bytes
 *     +0  4  tag, 4 ASCII bytes
 *     +4  4  offset from the start of the file
 *     +8  4  size in bytes
 *     +12 4  CRC-32 of the section's bytes
 *   Sections follow in table order without gaps: the first at header_len, each at the end of
 *   the previous one, the last ending at file_len; so every byte is under a checksum.
 *
 *   CONF  20 bytes: u32 pre_tokenizer (1: the GPT-2 byte-level split regex), u32 normalizer
 *         (0: none), u32 model (1: byte-level BPE), u32 flags (bit 0: fuse_unk), u32 unk_id
 *         (0xFFFFFFFF: none)
 *   VOCB  u32 n_ids, u32 blob_len, u32 offsets[n_ids + 1] (from 0, non-decreasing, ending at
 *         blob_len), u8 flags[n_ids] (bit 0 the id has a token, bit 1 special, bit 2 added
 *         token), blob: id i's bytes are blob[offsets[i] .. offsets[i + 1])
 *   BYTE  u32 id[256]: each byte's token, 0xFFFFFFFF when the vocabulary has none (the byte
 *         becomes the unknown token, or nothing when there is none)
 *   MERG  u32 count, count x (u32 left, u32 right, u32 merged); the index is the rank
 *   ADDT  u32 count, then per token: u32 id, u32 flags (bit 0 special, bit 1 normalized),
 *         u32 len, len bytes of text to match
 *   UCLS  u32 n_letter, u32 n_number, u32 n_space, then that many (u32 first, u32 last)
 *         code-point ranges for \p{L}, \p{N}, \s, each list sorted, all disjoint
 *   CHAT  u32 has_chat, u32 prefix_len, prefix, u32 suffix_len, suffix
 *   STOP  u32 count, count x u32 id
 *   1.1 (the qwen2 and unigram kinds, tokenizer_kinds.py) adds CONF values and three sections
 *   that only those values need: pre_tokenizer 2 (Qwen2's regex, piece_end_qwen2) or 0 (none),
 *   normalizer 1 (NFC, section NFCT, tokenizer_normalize.c) or 2 (" " -> U+2581), model 2
 *   (Unigram, section UNIG, tokenizer_unigram.c); CONT lists the contractions Qwen2's
 *   case-insensitive alternative matches. The exporter's docstring has their byte layouts.
 *   1.2 (the sentencepiece_bpe kind: Gemma 3's GGUF tokenizer as edgekv rebuilds it) adds model 3,
 *   BPE over characters with byte fallback, and CHRS: u32 count, count x (u32 code point, u32 id),
 *   sorted by code point — the single-character pieces a span's characters start as; a character
 *   without one becomes its bytes' <0xXX> tokens (BYTE), or the unknown token. No pre-tokenizer:
 *   each span between added tokens is one word, merged as above. BOSP (u32 id), when present: a
 *   plain whole prompt (ekv_tokenizer_encode_part, EKV_PART_WHOLE, not chat) starts with that token,
 *   as HF's post-processor puts Gemma's <bos> first; the chat prefix carries its own.
 *
 * Open validates everything once (bounds with overflow-safe arithmetic before any byte is read,
 * checksums, counts against the bytes present, every id against n_ids, merged tokens equal to
 * their parts), so encoding trusts the tables. A handle is one thread's: encode reuses scratch
 * buffers kept in it.
 *
 * Encoding, as HF does it: (1) added tokens are cut out of the text, leftmost-longest, first
 * the non-normalized ones, then the normalized ones in what is left (the normalizer is none);
 * (2) each remaining span is split by the GPT-2 regex
 *     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * implemented by hand over UTF-8 code points with the file's class tables; (3) each piece's
 * bytes become their byte tokens and BPE merges them, lowest rank first and leftmost among
 * equal ranks, through a heap (O(n log n) on a 100 KB word, where rescanning would be O(n^2)).
 *
 * Invalid UTF-8 in the input (HF never sees any: Python strings are valid) never fails: each
 * byte that is not part of a well-formed character is a unit of class "other" (as U+FFFD would
 * be) but keeps its own byte, so it is tokenized as that byte, not as EF BF BD. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reader.h"
#include "status.h"
#include "tokenizer_internal.h"
#include "tokenizer_normalize.h"
#include "tokenizer_unigram.h"

#define FORMAT_MAJOR 1
#define HEADER_BYTES 32u
#define SECTION_ENTRY_BYTES 16u
#define MAX_SECTIONS 64u
#define NO_ID 0xFFFFFFFFu
#define MAX_FILE_BYTES (1u << 30)

#define VOCAB_PRESENT 1u
#define VOCAB_SPECIAL 2u
#define ADDED_NORMALIZED 2u
#define CONF_FUSE_UNK 1u

enum { CLASS_OTHER = 0, CLASS_LETTER = 1, CLASS_NUMBER = 2, CLASS_SPACE = 3 };
/* added-token passes: non-normalized tokens on the raw text, then normalized ones */
enum { PASS_RAW = 0, PASS_NORMALIZED = 1, PASS_SPLIT = 2 };

/* CONF values (1.0 has only GPT-2 / none / BPE; 1.1 adds the others) */
enum { PRE_NONE = 0, PRE_GPT2 = 1, PRE_QWEN2 = 2 };
enum { NORM_NONE = 0, NORM_NFC = 1, NORM_SPACE_TO_U2581 = 2 };
enum { MODEL_BPE = 1, MODEL_UNIGRAM = 2, MODEL_SP_BPE = 3 };

/* the last three sections (1.1) are needed only by the settings that use them */
enum { SEC_CONF, SEC_VOCB, SEC_BYTE, SEC_MERG, SEC_ADDT, SEC_UCLS, SEC_CHAT, SEC_STOP, SEC_NFCT, SEC_CONT, SEC_UNIG,
       SEC_CHRS, SEC_BOSP, N_SECTIONS };
#define N_REQUIRED_SECTIONS SEC_NFCT
static const struct {
  char tag[5];
  const char *name;
} SECTIONS[N_SECTIONS] = {
    {"CONF", "settings"},      {"VOCB", "vocabulary"},        {"BYTE", "byte table"},    {"MERG", "merges"},
    {"ADDT", "added tokens"},  {"UCLS", "character classes"}, {"CHAT", "chat template"}, {"STOP", "stop ids"},
    {"NFCT", "normalization tables"}, {"CONT", "contractions"}, {"UNIG", "unigram pieces"},
    {"CHRS", "single-character pieces"}, {"BOSP", "prompt start token"},
};

typedef struct merge_slot {
  uint64_t pair; /* left << 32 | right; EMPTY_PAIR when free */
  uint32_t rank;
  int32_t merged;
} merge_slot;
#define EMPTY_PAIR UINT64_MAX

typedef struct added_token {
  int32_t id;
  uint32_t len;
  const unsigned char *text;
} added_token;

typedef struct class_range {
  uint32_t first, last;
  uint8_t cls;
} class_range;

struct ekv_tokenizer {
  ekv_error err;
  int ready; /* opened and validated */
  char name[160];
  unsigned char *file;
  size_t file_len;

  uint32_t n_ids;
  const unsigned char *vocab_offsets; /* u32 x (n_ids + 1) */
  const unsigned char *vocab_flags;
  const unsigned char *vocab_blob;
  uint32_t byte_id[256];
  uint32_t unk_id;
  int fuse_unk;

  merge_slot *merges;
  size_t merge_mask;

  added_token *added[2]; /* per pass, longest first */
  uint32_t n_added[2];
  uint8_t added_starts[2][256]; /* some token of the pass starts with this byte */

  class_range *classes;
  size_t n_classes;
  uint8_t ascii_class[128];

  int has_chat;
  const unsigned char *chat_prefix, *chat_suffix;
  uint32_t chat_prefix_len, chat_suffix_len;

  int32_t *stop_ids;
  uint32_t n_stop;

  uint32_t pre_tokenizer, normalizer, model;
  ekv_nfc_tables nfc;
  ekv_unigram unigram;
  const unsigned char *chars; /* CHRS: (u32 code point, u32 id) x n_chars, sorted by code point */
  uint32_t n_chars;
  uint32_t bos_id; /* BOSP: the token a plain whole prompt starts with; NO_ID: none */
  /* the contractions the split regex matches at an apostrophe (Qwen2's is case-insensitive) */
  const unsigned char *contraction_text[32];
  uint32_t contraction_len[32], n_contractions;
  ekv_norm_scratch norm;
  ekv_unigram_scratch unigram_scratch;

  /* encode scratch, grown on demand: symbols of the word being merged and the merge heap */
  int32_t *sym_id, *sym_prev, *sym_next;
  uint64_t *heap;
  size_t scratch_cap;
  char *chat_text;
  size_t chat_cap;
};

/* ------------------------------------------------------------------------------------------
 * Little helpers
 * ------------------------------------------------------------------------------------------ */
#define le32 ekv_le32
#define le16 ekv_le16

/* CRC-32 of p[0, n) with the `skip_len` bytes at `skip_from` read as zeros (the header's own
 * checksum field) */
static uint32_t crc32_of(const unsigned char *p, size_t n, uint32_t skip_from, uint32_t skip_len) {
  static const unsigned char zeros[16];
  if (skip_len == 0 || skip_from >= n) return ekv_crc32(0, p, n);
  uint32_t end = skip_from + skip_len < n ? skip_from + skip_len : (uint32_t)n;
  uint32_t crc = ekv_crc32(0, p, skip_from);
  crc = ekv_crc32(crc, zeros, end - skip_from <= sizeof zeros ? end - skip_from : sizeof zeros);
  return ekv_crc32(crc, p + end, n - end);
}

static ekv_status corrupt(ekv_tokenizer *tok, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static ekv_status corrupt(ekv_tokenizer *tok, const char *fmt, ...) {
  char detail[EKV_ERR_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  return ekv_fail(&tok->err, EKV_ERR_FORMAT, "%s: %s; recompile the artifact", tok->name, detail);
}

static ekv_status no_memory(ekv_tokenizer *tok, const char *what, size_t bytes) {
  return ekv_fail(&tok->err, EKV_ERR_NO_MEMORY, "%s: out of memory for %s (%zu bytes)", tok->name, what, bytes);
}

/* malloc(count * size) refusing a product that overflows */
static void *alloc_array(size_t count, size_t size) {
  if (size != 0 && count > SIZE_MAX / size) return NULL;
  size_t bytes = count * size;
  return malloc(bytes > 0 ? bytes : 1);
}

/* ------------------------------------------------------------------------------------------
 * Reading a section: a cursor that checks every length against what is left
 * ------------------------------------------------------------------------------------------ */
typedef struct cursor {
  ekv_tokenizer *tok;
  const char *section;
  const unsigned char *p;
  size_t size, pos;
} cursor;

static cursor section_cursor(ekv_tokenizer *tok, int sec, const unsigned char *p, size_t size) {
  cursor c = {tok, SECTIONS[sec].name, p, size, 0};
  return c;
}

/* n bytes of `what` must be left */
static ekv_status need(cursor *c, size_t n, const char *what) {
  if (n > c->size - c->pos)
    return corrupt(c->tok, "%s section truncated at %s (need %zu bytes at offset %zu, the section has %zu)",
                   c->section, what, n, c->pos, c->size);
  return EKV_OK;
}

/* count records of `record` bytes must be left (without overflowing count * record) */
static ekv_status need_records(cursor *c, uint32_t count, size_t record, const char *what) {
  if ((size_t)count > (c->size - c->pos) / record)
    return corrupt(c->tok, "%s section truncated: %u %s of %zu bytes at offset %zu do not fit in its %zu bytes",
                   c->section, count, what, record, c->pos, c->size);
  return EKV_OK;
}

static ekv_status take_u32(cursor *c, const char *what, uint32_t *v) {
  EKV_TRY(need(c, 4, what));
  *v = le32(c->p + c->pos);
  c->pos += 4;
  return EKV_OK;
}

static ekv_status take_bytes(cursor *c, size_t n, const char *what, const unsigned char **p) {
  EKV_TRY(need(c, n, what));
  *p = c->p + c->pos;
  c->pos += n;
  return EKV_OK;
}

static ekv_status expect_end(cursor *c) {
  if (c->pos != c->size)
    return corrupt(c->tok, "%s section has %zu bytes after its end (size %zu)", c->section, c->size - c->pos,
                   c->size);
  return EKV_OK;
}

static ekv_status check_id(ekv_tokenizer *tok, const char *section, const char *what, uint32_t id) {
  if (id >= tok->n_ids || !(tok->vocab_flags[id] & VOCAB_PRESENT))
    return corrupt(tok, "%s section: %s id %u is not a token (the vocabulary has %u ids)", section, what, id,
                   tok->n_ids);
  return EKV_OK;
}

static const unsigned char *id_bytes(const ekv_tokenizer *tok, uint32_t id, size_t *len) {
  uint32_t a = le32(tok->vocab_offsets + 4 * (size_t)id), b = le32(tok->vocab_offsets + 4 * (size_t)id + 4);
  *len = b - a;
  return tok->vocab_blob + a;
}

/* ------------------------------------------------------------------------------------------
 * Header and section table
 * ------------------------------------------------------------------------------------------ */
typedef struct section_view {
  const unsigned char *p;
  size_t size;
} section_view;

static ekv_status read_header(ekv_tokenizer *tok, uint32_t *header_len, uint32_t *count) {
  const unsigned char *f = tok->file;
  if (tok->file_len < HEADER_BYTES)
    return corrupt(tok, "%zu bytes is too short for a tokenizer file (the header alone is %u)", tok->file_len,
                   HEADER_BYTES);
  if (memcmp(f, "EKVTOKN\0", 8) != 0) return corrupt(tok, "not an edgekv tokenizer file (bad magic)");
  uint16_t major = le16(f + 8), minor = le16(f + 10);
  if (major != FORMAT_MAJOR)
    return corrupt(tok, "tokenizer format %u.%u is not readable by this runtime (it reads %d.x)", major, minor,
                   FORMAT_MAJOR);
  *header_len = le32(f + 12);
  *count = le32(f + 16);
  if (*count == 0 || *count > MAX_SECTIONS || *header_len != HEADER_BYTES + SECTION_ENTRY_BYTES * *count)
    return corrupt(tok, "bad header (%u sections, header length %u)", *count, *header_len);
  if (*header_len > tok->file_len)
    return corrupt(tok, "file truncated in its section table (need %u bytes, file has %zu)", *header_len,
                   tok->file_len);
  uint32_t stored = le32(f + 24), computed = crc32_of(f, *header_len, 24, 4);
  if (stored != computed)
    return corrupt(tok, "header checksum mismatch (stored %08x, computed %08x): the file is damaged", stored,
                   computed);
  if (le32(f + 28) != 0) return corrupt(tok, "reserved header field is not zero");
  return EKV_OK;
}

static int known_section(const unsigned char *tag) {
  for (int s = 0; s < N_SECTIONS; s++)
    if (memcmp(tag, SECTIONS[s].tag, 4) == 0) return s;
  return -1;
}

/* Bounds, contiguity and checksum of every section; the known ones land in views. */
static ekv_status read_sections(ekv_tokenizer *tok, section_view views[N_SECTIONS]) {
  uint32_t header_len = 0, count = 0;
  EKV_TRY(read_header(tok, &header_len, &count));
  size_t expect_offset = header_len;
  for (uint32_t i = 0; i < count; i++) {
    const unsigned char *e = tok->file + HEADER_BYTES + (size_t)i * SECTION_ENTRY_BYTES;
    uint32_t offset = le32(e + 4), size = le32(e + 8), crc = le32(e + 12);
    int s = known_section(e);
    const char *name = s >= 0 ? SECTIONS[s].name : "unknown";
    if (offset > tok->file_len || size > tok->file_len - offset)
      return corrupt(tok, "%s section truncated (need %u bytes at offset %u, file has %zu)", name, size, offset,
                     tok->file_len);
    if (offset != expect_offset)
      return corrupt(tok, "%s section at offset %u, expected %zu (sections are contiguous)", name, offset,
                     expect_offset);
    expect_offset = (size_t)offset + size;
    uint32_t computed = crc32_of(tok->file + offset, size, 0, 0);
    if (computed != crc)
      return corrupt(tok, "%s section checksum mismatch (stored %08x, computed %08x): the file is damaged", name,
                     crc, computed);
    if (s < 0) continue; /* a later minor version's section */
    if (views[s].p != NULL) return corrupt(tok, "%s section appears twice", name);
    views[s].p = tok->file + offset;
    views[s].size = size;
  }
  uint32_t file_len = le32(tok->file + 20);
  if (expect_offset != tok->file_len || file_len != tok->file_len)
    return corrupt(tok, "file is %zu bytes, its header says %u and its sections end at %zu", tok->file_len,
                   file_len, expect_offset);
  for (int s = 0; s < N_REQUIRED_SECTIONS; s++)
    if (views[s].p == NULL) return corrupt(tok, "%s section (%s) is missing", SECTIONS[s].name, SECTIONS[s].tag);
  return EKV_OK;
}

/* ------------------------------------------------------------------------------------------
 * Sections
 * ------------------------------------------------------------------------------------------ */
static ekv_status parse_conf(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_CONF, v.p, v.size);
  uint32_t pre, norm, model, flags, unk;
  EKV_TRY(take_u32(&c, "pre-tokenizer", &pre));
  EKV_TRY(take_u32(&c, "normalizer", &norm));
  EKV_TRY(take_u32(&c, "model", &model));
  EKV_TRY(take_u32(&c, "flags", &flags));
  EKV_TRY(take_u32(&c, "unknown token", &unk));
  EKV_TRY(expect_end(&c));
  int known = (model == MODEL_BPE && (pre == PRE_GPT2 || pre == PRE_QWEN2) && norm <= NORM_NFC) ||
              ((model == MODEL_UNIGRAM || model == MODEL_SP_BPE) && pre == PRE_NONE && norm == NORM_SPACE_TO_U2581);
  tok->pre_tokenizer = pre;
  tok->normalizer = norm;
  tok->model = model;
  if (!known || (flags & ~CONF_FUSE_UNK) != 0)
    return corrupt(tok, "settings (pre-tokenizer %u, normalizer %u, model %u, flags 0x%x) are not ones this runtime "
                        "implements", pre, norm, model, flags);
  tok->fuse_unk = (flags & CONF_FUSE_UNK) != 0;
  tok->unk_id = unk; /* checked against the vocabulary once it is read */
  return EKV_OK;
}

static ekv_status parse_vocab(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_VOCB, v.p, v.size);
  uint32_t n, blob_len;
  EKV_TRY(take_u32(&c, "id count", &n));
  EKV_TRY(take_u32(&c, "byte count", &blob_len));
  if (n == 0 || n > INT32_MAX) return corrupt(tok, "vocabulary section: %u ids", n);
  EKV_TRY(need_records(&c, n, 5, "ids (offset and flags)")); /* n * 5 fits, so (n + 1) * 4 + n does too */
  EKV_TRY(take_bytes(&c, (size_t)(n + 1) * 4, "offsets", &tok->vocab_offsets));
  EKV_TRY(take_bytes(&c, n, "flags", &tok->vocab_flags));
  EKV_TRY(take_bytes(&c, blob_len, "token bytes", &tok->vocab_blob));
  EKV_TRY(expect_end(&c));
  tok->n_ids = n;
  uint32_t prev = 0;
  for (uint32_t i = 0; i <= n; i++) {
    uint32_t off = le32(tok->vocab_offsets + 4 * (size_t)i);
    if ((i == 0 && off != 0) || off < prev || off > blob_len || (i == n && off != blob_len))
      return corrupt(tok, "vocabulary section: offset %u of id %u is out of order or past the %u bytes", off, i,
                     blob_len);
    if (i > 0) {
      int present = (tok->vocab_flags[i - 1] & VOCAB_PRESENT) != 0;
      if (present != (off > prev) || tok->vocab_flags[i - 1] > 7)
        return corrupt(tok, "vocabulary section: id %u has flags 0x%x and %u bytes", i - 1, tok->vocab_flags[i - 1],
                       off - prev);
    }
    prev = off;
  }
  return EKV_OK;
}

static ekv_status parse_bytes(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_BYTE, v.p, v.size);
  int any_unknown = 0;
  for (int b = 0; b < 256; b++) {
    EKV_TRY(take_u32(&c, "byte id", &tok->byte_id[b]));
    if (tok->byte_id[b] == NO_ID) {
      any_unknown = 1;
      continue;
    }
    EKV_TRY(check_id(tok, "byte table", "byte", tok->byte_id[b]));
    size_t len;
    const unsigned char *bytes = id_bytes(tok, tok->byte_id[b], &len);
    if (len != 1 || bytes[0] != b)
      return corrupt(tok, "byte table: the token of byte 0x%02x (id %u) is not that byte", b, tok->byte_id[b]);
  }
  EKV_TRY(expect_end(&c));
  if (any_unknown && tok->unk_id != NO_ID) EKV_TRY(check_id(tok, "settings", "unknown token", tok->unk_id));
  return EKV_OK;
}

static size_t merge_slot_of(const ekv_tokenizer *tok, uint64_t pair) {
  return (size_t)((pair * 0x9E3779B97F4A7C15ull) >> 32) & tok->merge_mask;
}

static const merge_slot *find_merge(const ekv_tokenizer *tok, int32_t left, int32_t right) {
  uint64_t pair = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
  for (size_t i = merge_slot_of(tok, pair);; i = (i + 1) & tok->merge_mask) {
    const merge_slot *s = &tok->merges[i];
    if (s->pair == pair) return s;
    if (s->pair == EMPTY_PAIR) return NULL;
  }
}

/* the merged token's bytes must be its parts' bytes: then any merge the table holds is one HF
 * would do, and a damaged id cannot pass */
static ekv_status check_merge(ekv_tokenizer *tok, uint32_t rank, uint32_t l, uint32_t r, uint32_t m) {
  EKV_TRY(check_id(tok, "merges", "merge part", l));
  EKV_TRY(check_id(tok, "merges", "merge part", r));
  EKV_TRY(check_id(tok, "merges", "merged token", m));
  size_t ll, rl, ml;
  const unsigned char *lb = id_bytes(tok, l, &ll), *rb = id_bytes(tok, r, &rl), *mb = id_bytes(tok, m, &ml);
  if (ml != ll + rl || memcmp(mb, lb, ll) != 0 || memcmp(mb + ll, rb, rl) != 0)
    return corrupt(tok, "merges section: merge %u (%u + %u -> %u) does not join its parts", rank, l, r, m);
  return EKV_OK;
}

static ekv_status parse_merges(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_MERG, v.p, v.size);
  uint32_t n;
  EKV_TRY(take_u32(&c, "merge count", &n));
  EKV_TRY(need_records(&c, n, 12, "merges"));
  size_t cap = 16;
  while (cap < (size_t)n * 2) cap *= 2; /* load at most 1/2: short probe runs */
  tok->merges = alloc_array(cap, sizeof *tok->merges);
  if (tok->merges == NULL) return no_memory(tok, "the merge table", cap * sizeof *tok->merges);
  for (size_t i = 0; i < cap; i++) tok->merges[i].pair = EMPTY_PAIR;
  tok->merge_mask = cap - 1;
  for (uint32_t rank = 0; rank < n; rank++) {
    const unsigned char *rec = c.p + c.pos + (size_t)rank * 12;
    uint32_t l = le32(rec), r = le32(rec + 4), m = le32(rec + 8);
    EKV_TRY(check_merge(tok, rank, l, r, m));
    uint64_t pair = (uint64_t)l << 32 | r;
    size_t i = merge_slot_of(tok, pair);
    while (tok->merges[i].pair != EMPTY_PAIR) {
      if (tok->merges[i].pair == pair) return corrupt(tok, "merges section: pair %u + %u appears twice", l, r);
      i = (i + 1) & tok->merge_mask;
    }
    tok->merges[i].pair = pair;
    tok->merges[i].rank = rank;
    tok->merges[i].merged = (int32_t)m;
  }
  c.pos += (size_t)n * 12;
  return expect_end(&c);
}

static int longer_first(const void *a, const void *b) {
  uint32_t la = ((const added_token *)a)->len, lb = ((const added_token *)b)->len;
  return la < lb ? 1 : la > lb ? -1 : 0;
}

static ekv_status parse_added(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_ADDT, v.p, v.size);
  uint32_t n;
  EKV_TRY(take_u32(&c, "added token count", &n));
  EKV_TRY(need_records(&c, n, 13, "added tokens")); /* each is at least 12 bytes + 1 of text */
  for (int pass = 0; pass < 2; pass++) {
    tok->added[pass] = alloc_array(n, sizeof(added_token));
    if (tok->added[pass] == NULL) return no_memory(tok, "the added tokens", (size_t)n * sizeof(added_token));
  }
  for (uint32_t i = 0; i < n; i++) {
    uint32_t id, flags, len;
    const unsigned char *text;
    EKV_TRY(take_u32(&c, "added token id", &id));
    EKV_TRY(take_u32(&c, "added token flags", &flags));
    EKV_TRY(take_u32(&c, "added token length", &len));
    EKV_TRY(take_bytes(&c, len, "added token text", &text));
    EKV_TRY(check_id(tok, "added tokens", "added token", id));
    if (len == 0 || flags > 3) return corrupt(tok, "added tokens section: token %u has flags 0x%x, length %u", id, flags, len);
    int pass = (flags & ADDED_NORMALIZED) ? PASS_NORMALIZED : PASS_RAW;
    added_token t = {(int32_t)id, len, text};
    tok->added[pass][tok->n_added[pass]++] = t;
    tok->added_starts[pass][text[0]] = 1;
  }
  EKV_TRY(expect_end(&c));
  /* leftmost-longest: at a position, the longest token that matches wins (stable order among
   * equal lengths cannot matter: equal text of equal length is the same token) */
  for (int pass = 0; pass < 2; pass++)
    if (tok->n_added[pass] > 1) qsort(tok->added[pass], tok->n_added[pass], sizeof(added_token), longer_first);
  return EKV_OK;
}

static int by_first(const void *a, const void *b) {
  uint32_t fa = ((const class_range *)a)->first, fb = ((const class_range *)b)->first;
  return fa < fb ? -1 : fa > fb ? 1 : 0;
}

static uint8_t class_lookup(const ekv_tokenizer *tok, uint32_t cp);

static ekv_status parse_classes(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_UCLS, v.p, v.size);
  uint32_t counts[3];
  static const uint8_t kinds[3] = {CLASS_LETTER, CLASS_NUMBER, CLASS_SPACE};
  for (int k = 0; k < 3; k++) EKV_TRY(take_u32(&c, "range count", &counts[k]));
  size_t total = (size_t)counts[0] + counts[1] + counts[2];
  if (total > (c.size - c.pos) / 8)
    return corrupt(tok, "character classes section truncated: %zu ranges do not fit in its %zu bytes", total, c.size);
  tok->classes = alloc_array(total, sizeof(class_range));
  if (tok->classes == NULL) return no_memory(tok, "the character classes", total * sizeof(class_range));
  for (int k = 0; k < 3; k++) {
    for (uint32_t i = 0; i < counts[k]; i++) {
      class_range r;
      EKV_TRY(take_u32(&c, "range start", &r.first));
      EKV_TRY(take_u32(&c, "range end", &r.last));
      r.cls = kinds[k];
      if (r.first > r.last || r.last > 0x10FFFFu)
        return corrupt(tok, "character classes section: range U+%04X..U+%04X is not valid", r.first, r.last);
      tok->classes[tok->n_classes++] = r;
    }
  }
  EKV_TRY(expect_end(&c));
  qsort(tok->classes, tok->n_classes, sizeof(class_range), by_first);
  for (size_t i = 1; i < tok->n_classes; i++)
    if (tok->classes[i].first <= tok->classes[i - 1].last)
      return corrupt(tok, "character classes section: ranges overlap at U+%04X", tok->classes[i].first);
  for (uint32_t cp = 0; cp < 128; cp++) tok->ascii_class[cp] = class_lookup(tok, cp);
  return EKV_OK;
}

static ekv_status parse_chat(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_CHAT, v.p, v.size);
  uint32_t has;
  EKV_TRY(take_u32(&c, "chat flag", &has));
  EKV_TRY(take_u32(&c, "prefix length", &tok->chat_prefix_len));
  EKV_TRY(take_bytes(&c, tok->chat_prefix_len, "prefix", &tok->chat_prefix));
  EKV_TRY(take_u32(&c, "suffix length", &tok->chat_suffix_len));
  EKV_TRY(take_bytes(&c, tok->chat_suffix_len, "suffix", &tok->chat_suffix));
  EKV_TRY(expect_end(&c));
  if (has > 1 || (!has && (tok->chat_prefix_len || tok->chat_suffix_len)))
    return corrupt(tok, "chat template section: flag %u with %u + %u bytes", has, tok->chat_prefix_len,
                   tok->chat_suffix_len);
  tok->has_chat = (int)has;
  return EKV_OK;
}

static ekv_status parse_stop(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_STOP, v.p, v.size);
  uint32_t n;
  EKV_TRY(take_u32(&c, "stop id count", &n));
  EKV_TRY(need_records(&c, n, 4, "stop ids"));
  tok->stop_ids = alloc_array(n, sizeof(int32_t));
  if (tok->stop_ids == NULL) return no_memory(tok, "the stop ids", (size_t)n * 4);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t id;
    EKV_TRY(take_u32(&c, "stop id", &id));
    EKV_TRY(check_id(tok, "stop ids", "stop", id));
    tok->stop_ids[i] = (int32_t)id;
  }
  tok->n_stop = n;
  return expect_end(&c);
}

static ekv_status needed_section(ekv_tokenizer *tok, section_view v, int sec) {
  if (v.p == NULL)
    return corrupt(tok, "%s section (%s) is missing, and its settings need it", SECTIONS[sec].name, SECTIONS[sec].tag);
  return EKV_OK;
}

static ekv_status parse_contractions(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_CONT, v.p, v.size);
  uint32_t n;
  EKV_TRY(take_u32(&c, "contraction count", &n));
  if (n > 32) return corrupt(tok, "contractions section: %u contractions (at most 32)", n);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t len;
    EKV_TRY(take_u32(&c, "contraction length", &len));
    if (len < 2 || len > 8) return corrupt(tok, "contractions section: a contraction of %u bytes", len);
    EKV_TRY(take_bytes(&c, len, "contraction", &tok->contraction_text[i]));
    if (tok->contraction_text[i][0] != '\'')
      return corrupt(tok, "contractions section: contraction %u does not start with an apostrophe", i);
    tok->contraction_len[i] = len;
  }
  tok->n_contractions = n;
  return expect_end(&c);
}

/* the single-character pieces of the sentencepiece_bpe kind: sorted, each id's bytes its
 * character's UTF-8 (U+2581 decodes to a space) */
static ekv_status parse_chars(ekv_tokenizer *tok, section_view v) {
  cursor c = section_cursor(tok, SEC_CHRS, v.p, v.size);
  uint32_t n;
  EKV_TRY(take_u32(&c, "character count", &n));
  EKV_TRY(need_records(&c, n, 8, "characters"));
  EKV_TRY(take_bytes(&c, (size_t)n * 8, "characters", &tok->chars));
  EKV_TRY(expect_end(&c));
  for (uint32_t i = 0; i < n; i++) {
    uint32_t cp = le32(tok->chars + 8 * (size_t)i), id = le32(tok->chars + 8 * (size_t)i + 4);
    if (i > 0 && cp <= le32(tok->chars + 8 * (size_t)(i - 1)))
      return corrupt(tok, "characters section: code point U+%04X is out of order", cp);
    EKV_TRY(check_id(tok, "characters", "character", id));
    size_t len;
    const unsigned char *b = id_bytes(tok, id, &len);
    uint32_t got = 0;
    size_t used = 0;
    int ok = cp == 0x2581 ? (len == 1 && b[0] == ' ')
                          : (len > 0 && ekv_utf8_next(b, len, &got, &used) == EKV_UTF8_CHAR && used == len && got == cp);
    if (!ok) return corrupt(tok, "characters section: the token of U+%04X (id %u) is not that character", cp, id);
  }
  tok->n_chars = n;
  return EKV_OK;
}

/* the one validating path from bytes to a ready tokenizer */
static ekv_status parse_file(ekv_tokenizer *tok) {
  section_view v[N_SECTIONS];
  memset(v, 0, sizeof v);
  EKV_TRY(read_sections(tok, v));
  EKV_TRY(parse_conf(tok, v[SEC_CONF]));
  EKV_TRY(parse_vocab(tok, v[SEC_VOCB]));
  EKV_TRY(parse_bytes(tok, v[SEC_BYTE]));
  EKV_TRY(parse_merges(tok, v[SEC_MERG]));
  EKV_TRY(parse_added(tok, v[SEC_ADDT]));
  EKV_TRY(parse_classes(tok, v[SEC_UCLS]));
  EKV_TRY(parse_chat(tok, v[SEC_CHAT]));
  EKV_TRY(parse_stop(tok, v[SEC_STOP]));
  if (tok->normalizer == NORM_NFC) {
    EKV_TRY(needed_section(tok, v[SEC_NFCT], SEC_NFCT));
    const char *why = ekv_nfc_parse(&tok->nfc, v[SEC_NFCT].p, v[SEC_NFCT].size);
    if (why != NULL) return corrupt(tok, "%s", why);
  }
  if (tok->pre_tokenizer == PRE_QWEN2) {
    EKV_TRY(needed_section(tok, v[SEC_CONT], SEC_CONT));
    EKV_TRY(parse_contractions(tok, v[SEC_CONT]));
  }
  if (tok->model == MODEL_SP_BPE) {
    EKV_TRY(needed_section(tok, v[SEC_CHRS], SEC_CHRS));
    EKV_TRY(parse_chars(tok, v[SEC_CHRS]));
  }
  tok->bos_id = NO_ID;
  if (v[SEC_BOSP].p != NULL) {
    cursor c = section_cursor(tok, SEC_BOSP, v[SEC_BOSP].p, v[SEC_BOSP].size);
    EKV_TRY(take_u32(&c, "prompt start token", &tok->bos_id));
    EKV_TRY(expect_end(&c));
    EKV_TRY(check_id(tok, "prompt start", "token", tok->bos_id));
  }
  if (tok->model == MODEL_UNIGRAM) {
    EKV_TRY(needed_section(tok, v[SEC_UNIG], SEC_UNIG));
    const char *why = ekv_unigram_parse(&tok->unigram, v[SEC_UNIG].p, v[SEC_UNIG].size, tok->n_ids);
    if (why != NULL) return corrupt(tok, "%s", why);
    if (tok->unigram.unk_id == NO_ID) return corrupt(tok, "unigram section: a unigram model needs an unknown token");
  }
  tok->ready = 1;
  return EKV_OK;
}

/* ------------------------------------------------------------------------------------------
 * Open / free
 * ------------------------------------------------------------------------------------------ */
static ekv_tokenizer *new_handle(const char *name) {
  ekv_tokenizer *tok = calloc(1, sizeof *tok);
  if (tok == NULL) return NULL;
  snprintf(tok->name, sizeof tok->name, "%s", name);
  return tok;
}

ekv_status ekv_tokenizer_open_memory(const void *data, size_t size, ekv_tokenizer **out) {
  if (out == NULL) return EKV_ERR_INVALID_ARG;
  ekv_tokenizer *tok = *out = new_handle("tokenizer (in memory)");
  if (tok == NULL) return EKV_ERR_NO_MEMORY;
  if (data == NULL && size > 0) return ekv_fail(&tok->err, EKV_ERR_INVALID_ARG, "%s: data is NULL", tok->name);
  tok->file = malloc(size ? size : 1);
  if (tok->file == NULL) return no_memory(tok, "a copy of the file", size);
  if (size) memcpy(tok->file, data, size);
  tok->file_len = size;
  return parse_file(tok);
}

static ekv_status read_whole_file(ekv_tokenizer *tok, FILE *f) {
  size_t cap = 1 << 20;
  tok->file = malloc(cap);
  if (tok->file == NULL) return no_memory(tok, "reading the file", cap);
  for (;;) {
    size_t got = fread(tok->file + tok->file_len, 1, cap - tok->file_len, f);
    tok->file_len += got;
    if (got == 0) break;
    if (tok->file_len == cap) {
      if (cap >= MAX_FILE_BYTES) return corrupt(tok, "larger than %u bytes: not a tokenizer file", MAX_FILE_BYTES);
      unsigned char *bigger = realloc(tok->file, cap * 2);
      if (bigger == NULL) return no_memory(tok, "reading the file", cap * 2);
      tok->file = bigger;
      cap *= 2;
    }
  }
  if (ferror(f)) return ekv_fail(&tok->err, EKV_ERR_IO, "%s: cannot read: %s", tok->name, strerror(errno));
  return EKV_OK;
}

ekv_status ekv_tokenizer_open(const char *path, ekv_tokenizer **out) {
  if (out == NULL) return EKV_ERR_INVALID_ARG;
  ekv_tokenizer *tok = *out = new_handle(path != NULL ? path : "(null)");
  if (tok == NULL) return EKV_ERR_NO_MEMORY;
  if (path == NULL) return ekv_fail(&tok->err, EKV_ERR_INVALID_ARG, "tokenizer path is NULL");
  FILE *f = fopen(path, "rb");
  if (f == NULL) return ekv_fail(&tok->err, EKV_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  ekv_status st = read_whole_file(tok, f);
  fclose(f);
  return st != EKV_OK ? st : parse_file(tok);
}

void ekv_tokenizer_free(ekv_tokenizer *tok) {
  if (tok == NULL) return;
  free(tok->file);
  free(tok->merges);
  free(tok->added[0]);
  free(tok->added[1]);
  free(tok->classes);
  free(tok->stop_ids);
  free(tok->sym_id);
  free(tok->sym_prev);
  free(tok->sym_next);
  free(tok->heap);
  free(tok->chat_text);
  ekv_norm_scratch_free(&tok->norm);
  ekv_unigram_scratch_free(&tok->unigram_scratch);
  free(tok);
}

const char *ekv_tokenizer_last_error(const ekv_tokenizer *tok) {
  return tok == NULL ? "no tokenizer (out of memory?)" : tok->err.msg;
}

/* ------------------------------------------------------------------------------------------
 * Encoding: where ids go
 * ------------------------------------------------------------------------------------------ */
typedef struct id_sink {
  int32_t *ids;
  size_t cap, n;
} id_sink;

static void emit(id_sink *s, int32_t id) {
  if (s->n < s->cap) s->ids[s->n] = id;
  s->n++;
}

/* ------------------------------------------------------------------------------------------
 * BPE over one piece
 * ------------------------------------------------------------------------------------------ */
static ekv_status grow_scratch(ekv_tokenizer *tok, size_t n) {
  if (n <= tok->scratch_cap) return EKV_OK;
  size_t cap = tok->scratch_cap * 2 > n ? tok->scratch_cap * 2 : n;
  if (cap < 256) cap = 256;
  /* each merge pushes at most two heap entries after the n - 1 first ones */
  int32_t *id = alloc_array(cap, 4), *prev = alloc_array(cap, 4), *next = alloc_array(cap, 4);
  uint64_t *heap = cap <= SIZE_MAX / 3 ? alloc_array(cap * 3, 8) : NULL;
  if (id == NULL || prev == NULL || next == NULL || heap == NULL) {
    free(id);
    free(prev);
    free(next);
    free(heap);
    return ekv_fail(&tok->err, EKV_ERR_NO_MEMORY, "%s: out of memory for a %zu-byte word", tok->name, n);
  }
  free(tok->sym_id);
  free(tok->sym_prev);
  free(tok->sym_next);
  free(tok->heap);
  tok->sym_id = id;
  tok->sym_prev = prev;
  tok->sym_next = next;
  tok->heap = heap;
  tok->scratch_cap = cap;
  return EKV_OK;
}

/* min-heap of rank << 32 | position: the lowest rank first, the leftmost among equal ranks (the
 * order of HF's merge queue) */
static void heap_push(uint64_t *heap, size_t *len, uint64_t key) {
  size_t i = (*len)++;
  while (i > 0 && heap[(i - 1) / 2] > key) {
    heap[i] = heap[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  heap[i] = key;
}

static uint64_t heap_pop(uint64_t *heap, size_t *len) {
  uint64_t top = heap[0], last = heap[--*len];
  size_t i = 0, n = *len;
  for (;;) {
    size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && heap[child + 1] < heap[child]) child++;
    if (heap[child] >= last) break;
    heap[i] = heap[child];
    i = child;
  }
  if (n > 0) heap[i] = last;
  return top;
}

static void push_pair(ekv_tokenizer *tok, size_t *heap_len, int32_t pos) {
  int32_t next = tok->sym_next[pos];
  if (next < 0) return;
  const merge_slot *m = find_merge(tok, tok->sym_id[pos], tok->sym_id[next]);
  if (m != NULL) heap_push(tok->heap, heap_len, (uint64_t)m->rank << 32 | (uint32_t)pos);
}

/* The piece's initial symbols: one per byte, except that bytes without a token become the
 * unknown token (one per run when fuse_unk) or nothing. Returns the symbol count. */
static size_t initial_symbols(ekv_tokenizer *tok, const unsigned char *s, size_t n) {
  size_t count = 0;
  int in_unknown_run = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t id = tok->byte_id[s[i]];
    if (id == NO_ID) {
      if (tok->unk_id == NO_ID || (in_unknown_run && tok->fuse_unk)) continue;
      id = tok->unk_id;
      in_unknown_run = 1;
    } else {
      in_unknown_run = 0;
    }
    tok->sym_id[count++] = (int32_t)id;
  }
  return count;
}

/* The sentencepiece_bpe kind's initial symbols: one per character (its single-character piece), a
 * character without one as its bytes' byte-fallback tokens, or — when one of those is missing —
 * the unknown token (one per run when fuse_unk), as HF's BPE with byte_fallback. Ill-formed bytes
 * (never in a Python string) fall back byte by byte. */
static int32_t char_id(const ekv_tokenizer *tok, uint32_t cp) {
  size_t lo = 0, hi = tok->n_chars;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    uint32_t at = le32(tok->chars + 8 * mid);
    if (at == cp) return (int32_t)le32(tok->chars + 8 * mid + 4);
    if (at < cp)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -1;
}

static size_t initial_char_symbols(ekv_tokenizer *tok, const unsigned char *s, size_t n) {
  size_t count = 0;
  int in_unknown_run = 0;
  for (size_t i = 0; i < n;) {
    uint32_t cp = 0;
    size_t len = 1;
    ekv_utf8_unit unit = ekv_utf8_next(s + i, n - i, &cp, &len);
    if (unit != EKV_UTF8_CHAR) len = 1;
    int32_t id = unit == EKV_UTF8_CHAR ? char_id(tok, cp) : -1;
    if (id >= 0) {
      tok->sym_id[count++] = id;
      in_unknown_run = 0;
    } else {
      int all = 1;
      for (size_t k = 0; k < len; k++) all = all && tok->byte_id[s[i + k]] != NO_ID;
      if (all) {
        for (size_t k = 0; k < len; k++) tok->sym_id[count++] = (int32_t)tok->byte_id[s[i + k]];
        in_unknown_run = 0;
      } else if (tok->unk_id != NO_ID && !(in_unknown_run && tok->fuse_unk)) {
        tok->sym_id[count++] = (int32_t)tok->unk_id;
        in_unknown_run = 1;
      }
    }
    i += len;
  }
  return count;
}

static ekv_status bpe(ekv_tokenizer *tok, const unsigned char *s, size_t n, id_sink *out) {
  if (n >= INT32_MAX) return ekv_fail(&tok->err, EKV_ERR_INVALID_ARG, "%s: a %zu-byte word is too long", tok->name, n);
  EKV_TRY(grow_scratch(tok, n));
  size_t count = tok->model == MODEL_SP_BPE ? initial_char_symbols(tok, s, n) : initial_symbols(tok, s, n);
  size_t heap_len = 0;
  for (size_t i = 0; i < count; i++) {
    tok->sym_prev[i] = (int32_t)i - 1;
    tok->sym_next[i] = i + 1 < count ? (int32_t)i + 1 : -1;
  }
  for (size_t i = 0; i + 1 < count; i++) push_pair(tok, &heap_len, (int32_t)i);
  while (heap_len > 0) {
    uint64_t top = heap_pop(tok->heap, &heap_len);
    int32_t pos = (int32_t)(top & 0xFFFFFFFFu), next = tok->sym_next[pos];
    if (tok->sym_id[pos] < 0 || next < 0) continue; /* merged away, or now last */
    /* a rank names one pair: if the pair here no longer has this rank, the entry is stale */
    const merge_slot *m = find_merge(tok, tok->sym_id[pos], tok->sym_id[next]);
    if (m == NULL || m->rank != (uint32_t)(top >> 32)) continue;
    tok->sym_id[pos] = m->merged;
    tok->sym_id[next] = -1;
    tok->sym_next[pos] = tok->sym_next[next];
    if (tok->sym_next[pos] >= 0) tok->sym_prev[tok->sym_next[pos]] = pos;
    if (tok->sym_prev[pos] >= 0) push_pair(tok, &heap_len, tok->sym_prev[pos]);
    push_pair(tok, &heap_len, pos);
  }
  for (int32_t i = count > 0 ? 0 : -1; i >= 0; i = tok->sym_next[i]) emit(out, tok->sym_id[i]);
  return EKV_OK;
}

static ekv_status bpe_piece(ekv_tokenizer *tok, const unsigned char *s, size_t n, id_sink *out) {
  if (n == 1 && tok->byte_id[s[0]] != NO_ID) { /* most punctuation and spaces */
    emit(out, (int32_t)tok->byte_id[s[0]]);
    return EKV_OK;
  }
  return bpe(tok, s, n, out);
}

/* ------------------------------------------------------------------------------------------
 * The GPT-2 split regex by hand
 * ------------------------------------------------------------------------------------------ */
static uint8_t class_lookup(const ekv_tokenizer *tok, uint32_t cp) {
  size_t lo = 0, hi = tok->n_classes;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (cp < tok->classes[mid].first)
      hi = mid;
    else if (cp > tok->classes[mid].last)
      lo = mid + 1;
    else
      return tok->classes[mid].cls;
  }
  return CLASS_OTHER;
}

/* The class and byte length of the unit at t[p] (p < end): a well-formed character, or one
 * byte of anything else, which counts as "other". */
static size_t unit_at(const ekv_tokenizer *tok, const unsigned char *t, size_t p, size_t end, uint8_t *cls) {
  if (t[p] < 0x80) {
    *cls = tok->ascii_class[t[p]];
    return 1;
  }
  uint32_t cp;
  size_t len;
  if (ekv_utf8_next(t + p, end - p, &cp, &len) != EKV_UTF8_CHAR) {
    *cls = CLASS_OTHER;
    return 1;
  }
  *cls = class_lookup(tok, cp);
  return len;
}

/* the end of the run of units of class cls starting at p */
static size_t run_end(const ekv_tokenizer *tok, const unsigned char *t, size_t p, size_t end, uint8_t cls) {
  while (p < end) {
    uint8_t c;
    size_t len = unit_at(tok, t, p, end, &c);
    if (c != cls) break;
    p += len;
  }
  return p;
}

/* 's|'t|'re|'ve|'m|'ll|'d at t[p] == '\'': the length matched, or 0 */
static size_t contraction(const unsigned char *t, size_t p, size_t end) {
  if (p + 1 >= end) return 0;
  switch (t[p + 1]) {
    case 's': case 't': case 'm': case 'd': return 2;
    case 'r': return p + 2 < end && t[p + 2] == 'e' ? 3 : 0;
    case 'v': return p + 2 < end && t[p + 2] == 'e' ? 3 : 0;
    case 'l': return p + 2 < end && t[p + 2] == 'l' ? 3 : 0;
    default: return 0;
  }
}

/* The end of the regex match starting at p (the regex matches at every position, so matches
 * are consecutive). Alternatives in the regex's order; the first that matches wins. */
static size_t piece_end(const ekv_tokenizer *tok, const unsigned char *t, size_t p, size_t end) {
  if (t[p] == '\'') {
    size_t k = contraction(t, p, end);
    if (k > 0) return p + k;
  }
  uint8_t cls;
  size_t len = unit_at(tok, t, p, end, &cls);
  if (t[p] == ' ' && p + 1 < end) { /* ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` with the space */
    uint8_t next;
    size_t next_len = unit_at(tok, t, p + 1, end, &next);
    if (next != CLASS_SPACE) return run_end(tok, t, p + 1 + next_len, end, next);
  }
  if (cls != CLASS_SPACE) return run_end(tok, t, p + len, end, cls);
  /* whitespace: `\s+(?!\S)` takes the run to the end of the text, or all of it but the last
   * character before a non-space (which then starts the next piece, e.g. " word"); a single
   * whitespace character before a non-space is `\s+` */
  size_t last = p, q = p + len;
  while (q < end) {
    uint8_t c;
    size_t l = unit_at(tok, t, q, end, &c);
    if (c != CLASS_SPACE) break;
    last = q;
    q += l;
  }
  if (q == end || last == p) return q;
  return last;
}

static int is_line_break(unsigned char b) { return b == '\r' || b == '\n'; }

/* Qwen2's split regex, alternatives in order (the first that matches wins):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)      the file's contraction list (its case variants, measured)
 *   [^\r\n\p{L}\p{N}]?\p{L}+         letters, with one leading non-letter non-digit (a space,
 *                                     punctuation) that is not a line break
 *   \p{N}                             one digit: numbers split digit by digit
 *    ?[^\s\p{L}\p{N}]+[\r\n]*          punctuation (with a leading space), then line breaks
 *   \s*[\r\n]+                        whitespace up to its last line break
 *   \s+(?!\S) | \s+                   as in GPT-2's */
static size_t piece_end_qwen2(const ekv_tokenizer *tok, const unsigned char *t, size_t p, size_t end) {
  if (t[p] == '\'')
    for (uint32_t i = 0; i < tok->n_contractions; i++)
      if (tok->contraction_len[i] <= end - p && memcmp(t + p, tok->contraction_text[i], tok->contraction_len[i]) == 0)
        return p + tok->contraction_len[i];
  uint8_t cls;
  size_t len = unit_at(tok, t, p, end, &cls);
  if (cls == CLASS_LETTER) return run_end(tok, t, p + len, end, CLASS_LETTER);
  if (cls != CLASS_NUMBER && !is_line_break(t[p]) && p + len < end) {
    uint8_t next;
    size_t next_len = unit_at(tok, t, p + len, end, &next);
    if (next == CLASS_LETTER) return run_end(tok, t, p + len + next_len, end, CLASS_LETTER);
  }
  if (cls == CLASS_NUMBER) return p + len;
  size_t q = p;
  if (t[p] == ' ' && p + 1 < end) {
    uint8_t next;
    unit_at(tok, t, p + 1, end, &next);
    if (next == CLASS_OTHER) q = p + 1;
  }
  uint8_t first;
  size_t first_len = unit_at(tok, t, q, end, &first);
  if (first == CLASS_OTHER) {
    size_t r = run_end(tok, t, q + first_len, end, CLASS_OTHER);
    while (r < end && is_line_break(t[r])) r++;
    return r;
  }
  /* whitespace: through its last line break if it has one, else as GPT-2's regex */
  size_t last = p, r = p, after_break = 0;
  while (r < end) {
    uint8_t c;
    size_t l = unit_at(tok, t, r, end, &c);
    if (c != CLASS_SPACE) break;
    if (is_line_break(t[r])) after_break = r + 1;
    last = r;
    r += l;
  }
  if (after_break > 0) return after_break;
  if (r == end || last == p) return r;
  return last;
}

static void emit_to_sink(void *ctx, int32_t id) { emit((id_sink *)ctx, id); }

static ekv_status encode_plain(ekv_tokenizer *tok, const unsigned char *t, size_t begin, size_t end, id_sink *out) {
  if (tok->model == MODEL_SP_BPE) return begin == end ? EKV_OK : bpe(tok, t + begin, end - begin, out);
  if (tok->model == MODEL_UNIGRAM) { /* no pre-tokenizer: the whole span is one word */
    if (ekv_unigram_encode(&tok->unigram, &tok->unigram_scratch, t + begin, end - begin, tok->byte_id, emit_to_sink,
                           out) != 0)
      return no_memory(tok, "encoding a span", end - begin);
    return EKV_OK;
  }
  size_t p = begin;
  while (p < end) {
    size_t q = tok->pre_tokenizer == PRE_QWEN2 ? piece_end_qwen2(tok, t, p, end) : piece_end(tok, t, p, end);
    EKV_TRY(bpe_piece(tok, t + p, q - p, out));
    p = q;
  }
  return EKV_OK;
}

/* ------------------------------------------------------------------------------------------
 * Added tokens, then the split
 * ------------------------------------------------------------------------------------------ */
static const added_token *added_at(const ekv_tokenizer *tok, int pass, const unsigned char *t, size_t p,
                                   size_t end) {
  if (!tok->added_starts[pass][t[p]]) return NULL;
  for (uint32_t i = 0; i < tok->n_added[pass]; i++) {
    const added_token *a = &tok->added[pass][i];
    if (a->len <= end - p && memcmp(t + p, a->text, a->len) == 0) return a;
  }
  return NULL;
}

/* Cuts this pass's added tokens out of t[begin, end) leftmost-longest and hands what lies
 * between them to the next pass. */
static ekv_status encode_span(ekv_tokenizer *tok, int pass, const unsigned char *t, size_t begin, size_t end,
                              id_sink *out);

/* What lies between the raw added tokens is normalized (as HF normalizes each such split), then
 * searched for the normalized added tokens and split. The normalized text lives in the handle's
 * scratch until this span is encoded. */
static ekv_status encode_normalized(ekv_tokenizer *tok, const unsigned char *t, size_t begin, size_t end,
                                    id_sink *out) {
  if (tok->normalizer == NORM_NONE || begin == end) return encode_span(tok, PASS_NORMALIZED, t, begin, end, out);
  size_t n = 0;
  int rc = tok->normalizer == NORM_NFC ? ekv_nfc(&tok->nfc, &tok->norm, t + begin, end - begin, &n)
                                       : ekv_replace_space(&tok->norm, t + begin, end - begin, &n);
  if (rc != 0) return no_memory(tok, "normalizing the text", (end - begin) * 4);
  return encode_span(tok, PASS_NORMALIZED, tok->norm.out, 0, n, out);
}

static ekv_status encode_span(ekv_tokenizer *tok, int pass, const unsigned char *t, size_t begin, size_t end,
                              id_sink *out) {
  if (pass == PASS_SPLIT) return encode_plain(tok, t, begin, end, out);
  if (pass == PASS_RAW && tok->n_added[pass] == 0) return encode_normalized(tok, t, begin, end, out);
  if (tok->n_added[pass] == 0) return encode_span(tok, pass + 1, t, begin, end, out);
  size_t gap = begin;
  for (size_t p = begin; p < end;) {
    const added_token *a = added_at(tok, pass, t, p, end);
    if (a == NULL) {
      p++;
      continue;
    }
    EKV_TRY(pass == PASS_RAW ? encode_normalized(tok, t, gap, p, out) : encode_span(tok, pass + 1, t, gap, p, out));
    emit(out, a->id);
    p += a->len;
    gap = p;
  }
  return pass == PASS_RAW ? encode_normalized(tok, t, gap, end, out) : encode_span(tok, pass + 1, t, gap, end, out);
}

static ekv_status check_encode_args(ekv_tokenizer *tok, const char *text, size_t len, const int32_t *ids, size_t cap,
                                    const size_t *n_ids) {
  if (tok == NULL) return EKV_ERR_INVALID_ARG;
  if (!tok->ready) return EKV_ERR_INVALID_ARG; /* the open error stays the message */
  if ((text == NULL && len > 0) || (ids == NULL && cap > 0) || n_ids == NULL)
    return ekv_fail(&tok->err, EKV_ERR_INVALID_ARG, "%s: encode needs text (or len 0), ids (or cap 0) and n_ids",
                    tok->name);
  return EKV_OK;
}

ekv_status ekv_tokenizer_encode(ekv_tokenizer *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                                size_t *n_ids) {
  EKV_TRY(check_encode_args(tok, text, len, ids, cap, n_ids));
  id_sink out = {ids, cap, 0};
  *n_ids = 0;
  if (len > 0) EKV_TRY(encode_span(tok, PASS_RAW, (const unsigned char *)text, 0, len, &out));
  *n_ids = out.n;
  return EKV_OK;
}

/* Encode head + text + tail as one string (the split regex looks across a seam: "\n" + " Hi"
 * is not "\n" and " Hi"), in the handle's scratch buffer. */
static ekv_status encode_wrapped(ekv_tokenizer *tok, const unsigned char *head, size_t head_len, const char *text,
                                 size_t len, const unsigned char *tail, size_t tail_len, int32_t *ids, size_t cap,
                                 size_t *n_ids) {
  size_t fixed = head_len + tail_len;
  if (len > SIZE_MAX - fixed)
    return ekv_fail(&tok->err, EKV_ERR_INVALID_ARG, "%s: text of %zu bytes is too long", tok->name, len);
  size_t total = fixed + len;
  if (total > tok->chat_cap) {
    char *buf = malloc(total ? total : 1);
    if (buf == NULL) return no_memory(tok, "the chat text", total);
    free(tok->chat_text);
    tok->chat_text = buf;
    tok->chat_cap = total;
  }
  if (head_len > 0) memcpy(tok->chat_text, head, head_len);
  if (len > 0) memcpy(tok->chat_text + head_len, text, len);
  if (tail_len > 0) memcpy(tok->chat_text + head_len + len, tail, tail_len);
  return ekv_tokenizer_encode(tok, tok->chat_text, total, ids, cap, n_ids);
}

ekv_status ekv_tokenizer_encode_chat(ekv_tokenizer *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                                     size_t *n_ids) {
  return ekv_tokenizer_encode_part(tok, text, len, 1, EKV_PART_WHOLE, ids, cap, n_ids);
}

ekv_status ekv_tokenizer_encode_part(ekv_tokenizer *tok, const char *text, size_t len, int chat, ekv_text_part part,
                                     int32_t *ids, size_t cap, size_t *n_ids) {
  static const unsigned char SEP[] = EKV_QUESTION_SEPARATOR;
  EKV_TRY(check_encode_args(tok, text, len, ids, cap, n_ids));
  if (chat && !tok->has_chat)
    return ekv_fail(&tok->err, EKV_ERR_INVALID_ARG, "%s: the model has no chat template; encode the text plainly",
                    tok->name);
  const unsigned char *head = NULL, *tail = NULL;
  size_t head_len = 0, tail_len = 0;
  if (part == EKV_PART_QUESTION) {
    head = SEP;
    head_len = sizeof SEP - 1;
  } else if (chat) {
    head = tok->chat_prefix;
    head_len = tok->chat_prefix_len;
  }
  if (chat && part != EKV_PART_DOCUMENT) {
    tail = tok->chat_suffix;
    tail_len = tok->chat_suffix_len;
  }
  if (part != EKV_PART_WHOLE || chat || tok->bos_id == NO_ID)
    return encode_wrapped(tok, head, head_len, text, len, tail, tail_len, ids, cap, n_ids);
  /* a plain prompt of a tokenizer that puts BOS first (BOSP) */
  if (cap > 0) ids[0] = (int32_t)tok->bos_id;
  EKV_TRY(encode_wrapped(tok, head, head_len, text, len, tail, tail_len, cap > 0 ? ids + 1 : NULL, cap > 0 ? cap - 1 : 0,
                         n_ids));
  *n_ids += 1;
  return EKV_OK;
}

/* ------------------------------------------------------------------------------------------
 * Queries
 * ------------------------------------------------------------------------------------------ */
int ekv_tokenizer_has_chat_template(const ekv_tokenizer *tok) { return tok != NULL && tok->ready && tok->has_chat; }

const char *ekv_tokenizer_token_bytes(const ekv_tokenizer *tok, int32_t id, size_t *len) {
  if (len != NULL) *len = 0;
  if (tok == NULL || !tok->ready || id < 0 || (uint32_t)id >= tok->n_ids ||
      !(tok->vocab_flags[id] & VOCAB_PRESENT))
    return NULL;
  size_t n;
  const unsigned char *bytes = id_bytes(tok, (uint32_t)id, &n);
  if (len != NULL) *len = n;
  return (const char *)bytes;
}

int ekv_tokenizer_is_special(const ekv_tokenizer *tok, int32_t id) {
  if (tok == NULL || !tok->ready || id < 0 || (uint32_t)id >= tok->n_ids) return 0;
  return (tok->vocab_flags[id] & VOCAB_SPECIAL) != 0;
}

int32_t ekv_tokenizer_vocab_size(const ekv_tokenizer *tok) {
  return tok != NULL && tok->ready ? (int32_t)tok->n_ids : 0;
}

size_t ekv_tokenizer_stop_ids(const ekv_tokenizer *tok, int32_t *ids, size_t cap) {
  if (tok == NULL || !tok->ready) return 0;
  for (size_t i = 0; i < tok->n_stop && i < cap && ids != NULL; i++) ids[i] = tok->stop_ids[i];
  return tok->n_stop;
}
