/* edgekv.h — the native runtime's one public header.
 *
 * The runtime runs an artifact written by `edgekv compile`: a directory holding the
 * TVM-generated kernel library (model.so), the weights (params.safetensors, mapped read-only),
 * the flat program (program.ekv: kernel calls, static memory plan, cache layout, settings) and
 * the tokenizer (tokenizer.ekt). It knows programs, not policies: every eviction policy is
 * kernels and buffers in the program.
 *
 * Objects (each with its own open/close pair; *_free(NULL) and *_close(NULL) are no-ops):
 *   ekv_model      the immutable, validated artifact: program, mapped weights, resolved kernels
 *   ekv_session    one sequence over a model: the fixed-size caches, the planned arena, the
 *                  position, timings. Several sessions may share a model (not concurrently:
 *                  kernels use the model's thread pool).
 *   ekv_tokenizer  byte-level BPE over the artifact's tokenizer file
 *   ekv_sampler    greedy / temperature + top-p with its own seeded RNG
 *
 * Errors: every call returns an ekv_status; the message of the last failure is kept per handle
 * (ekv_model_last_error, ekv_session_last_error, ekv_tokenizer_last_error). Open functions
 * hand back a handle even when they fail (as SQLite does) so the caller can ask why; close it.
 * Nothing in the library prints or exits.
 */
#ifndef EDGEKV_H
#define EDGEKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EKV_API_VERSION 1

typedef enum ekv_status {
  EKV_OK = 0,
  EKV_ERR_IO = 1,           /* a file could not be opened, read, mapped or written */
  EKV_ERR_FORMAT = 2,       /* a file is truncated, corrupt, or of an unknown format version */
  EKV_ERR_MISMATCH = 3,     /* the artifact's parts disagree, or it was built for another machine */
  EKV_ERR_INVALID_ARG = 4,  /* the caller's input is unusable (empty prompt, past the context, ...) */
  EKV_ERR_NO_MEMORY = 5,    /* an allocation failed, or the memory plan is above the limit */
  EKV_ERR_KERNEL = 6,       /* a compiled kernel reported an error */
  EKV_ERR_CANCELLED = 7,    /* ekv_session_cancel() or a progress callback stopped the work */
  EKV_ERR_CAPACITY = 8      /* a policy that never evicts ('full') ran out of cache entries */
} ekv_status;

/* "ok", "io error", ... (static strings) */
const char *ekv_status_string(ekv_status status);

/* ------------------------------------------------------------------------------------------
 * Tokenizer
 * ------------------------------------------------------------------------------------------ */
typedef struct ekv_tokenizer ekv_tokenizer;

/* Open a tokenizer file (tokenizer.ekt, written by `edgekv compile`). *out is set even on
 * failure (ask ekv_tokenizer_last_error, then ekv_tokenizer_free). */
ekv_status ekv_tokenizer_open(const char *path, ekv_tokenizer **out);
/* The same from bytes in memory (copied; the caller keeps ownership of data). */
ekv_status ekv_tokenizer_open_memory(const void *data, size_t size, ekv_tokenizer **out);
void ekv_tokenizer_free(ekv_tokenizer *tok);
const char *ekv_tokenizer_last_error(const ekv_tokenizer *tok);

/* Encode UTF-8 text (len bytes; invalid UTF-8 is encoded as its bytes, as HF tokenizers does
 * after lossy decoding) into ids exactly as HF `tokenizers` encodes it (added/special tokens
 * matched in the text, no BOS/EOS added). Writes up to cap ids into ids (which may be NULL
 * when cap is 0) and the full count into *n_ids: call once with cap 0 to size the buffer. */
ekv_status ekv_tokenizer_encode(ekv_tokenizer *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                                size_t *n_ids);
/* Encode `text` as one user turn of the model's chat template with the generation prompt
 * (the pieces the exporter rendered from the template). EKV_ERR_INVALID_ARG when the model
 * has no chat template. */
ekv_status ekv_tokenizer_encode_chat(ekv_tokenizer *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                                     size_t *n_ids);
int ekv_tokenizer_has_chat_template(const ekv_tokenizer *tok);
/* The raw bytes a token stands for (byte-level decoded; a special token's own text).
 * Returns NULL for an id outside the vocabulary. */
const char *ekv_tokenizer_token_bytes(const ekv_tokenizer *tok, int32_t id, size_t *len);
/* 1 for special / control tokens (skipped when decoding for display). */
int ekv_tokenizer_is_special(const ekv_tokenizer *tok, int32_t id);
int32_t ekv_tokenizer_vocab_size(const ekv_tokenizer *tok);
/* The end-of-sequence ids generation stops at (eos, and the chat template's end of turn).
 * Returns the count; writes up to cap. */
size_t ekv_tokenizer_stop_ids(const ekv_tokenizer *tok, int32_t *ids, size_t cap);

/* Streaming text out: bytes in, complete UTF-8 out. A character whose bytes span two tokens
 * is held back until it is complete (a terminal and Java's NewStringUTF both need whole
 * characters); invalid sequences come out as U+FFFD, as Python's errors="replace". */
typedef struct ekv_utf8_stream {
  unsigned char pending[4];
  int n_pending;
} ekv_utf8_stream;
void ekv_utf8_stream_init(ekv_utf8_stream *s);
/* Appends the complete text of (held bytes + in[0..n)) to out (capacity cap, at least 4*(n+4)
 * bytes); returns the bytes written. */
size_t ekv_utf8_stream_push(ekv_utf8_stream *s, const char *in, size_t n, char *out, size_t cap);
/* Whatever is still held, as U+FFFD replacement(s); returns the bytes written. */
size_t ekv_utf8_stream_flush(ekv_utf8_stream *s, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* EDGEKV_H */
