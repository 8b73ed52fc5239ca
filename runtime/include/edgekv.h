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
  EKV_ERR_CAPACITY = 8,     /* a policy that never evicts ('full') ran out of cache entries */
  EKV_ERR_DEVICE = 9        /* the device (OpenCL) is missing, failed to build the kernels, or failed a call */
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

/* Encode UTF-8 text (len bytes) into ids exactly as HF `tokenizers` encodes it (added/special
 * tokens matched in the text, no BOS/EOS added). Invalid UTF-8, which HF never sees, is kept:
 * each invalid byte is tokenized as itself, split like U+FFFD. Writes up to cap ids into ids
 * (which may be NULL when cap is 0) and the full count into *n_ids: call once with cap 0 to size
 * the buffer. A tokenizer handle is used by one thread at a time (encode reuses its scratch). */
ekv_status ekv_tokenizer_encode(ekv_tokenizer *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                                size_t *n_ids);
/* Encode `text` as one user turn of the model's chat template with the generation prompt
 * (the pieces the exporter rendered from the template). EKV_ERR_INVALID_ARG when the model
 * has no chat template. */
ekv_status ekv_tokenizer_encode_chat(ekv_tokenizer *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                                     size_t *n_ids);
int ekv_tokenizer_has_chat_template(const ekv_tokenizer *tok);

/* A document and a question about it, encoded as two parts so that the document's cache can be
 * kept and each question appended later (ekv_session_save / _load): the document part is the
 * chat template's prefix + the document; the question part is EKV_QUESTION_SEPARATOR + the
 * question + the template's suffix (no template: the document, and the separator + question).
 * A run of document then question is exactly these two parts in a row. */
typedef enum { EKV_PART_WHOLE = 0, EKV_PART_DOCUMENT = 1, EKV_PART_QUESTION = 2 } ekv_text_part;
#define EKV_QUESTION_SEPARATOR "\n\n"
ekv_status ekv_tokenizer_encode_part(ekv_tokenizer *tok, const char *text, size_t len, int chat, ekv_text_part part,
                                     int32_t *ids, size_t cap, size_t *n_ids);
/* The raw bytes a token stands for (byte-level decoded; a special token's own text).
 * Returns NULL for an id outside the vocabulary. */
const char *ekv_tokenizer_token_bytes(const ekv_tokenizer *tok, int32_t id, size_t *len);
/* 1 for special / control tokens (skipped when decoding for display). */
int ekv_tokenizer_is_special(const ekv_tokenizer *tok, int32_t id);
int32_t ekv_tokenizer_vocab_size(const ekv_tokenizer *tok);
/* The ids generation stops at (the tokenizer's eos_token_id, as the Python runs do; for
 * SmolLM2 that is <|im_end|>). Returns the count; writes up to cap. */
size_t ekv_tokenizer_stop_ids(const ekv_tokenizer *tok, int32_t *ids, size_t cap);

/* Streaming text out: bytes in, complete UTF-8 out. A character whose bytes span two tokens
 * is held back until it is complete (a terminal and Java's NewStringUTF both need whole
 * characters); invalid sequences come out as U+FFFD, as Python's errors="replace". */
typedef struct ekv_utf8_stream {
  unsigned char pending[4];
  int n_pending;
} ekv_utf8_stream;
void ekv_utf8_stream_init(ekv_utf8_stream *s);
/* The offset of the first byte of text that is not well-formed UTF-8 (strict, as Python's
 * decoder: no overlongs, surrogates or code points above U+10FFFF; a sequence cut off at the end
 * counts), or n when it all is. Input text is refused at that byte, as the Python CLI refuses it. */
size_t ekv_utf8_check(const char *text, size_t n);
/* Appends the complete text of (held bytes + in[0..n)) to out (capacity cap, at least 4*(n+4)
 * bytes); returns the bytes written. */
size_t ekv_utf8_stream_push(ekv_utf8_stream *s, const char *in, size_t n, char *out, size_t cap);
/* Whatever is still held, as U+FFFD replacement(s); returns the bytes written. */
size_t ekv_utf8_stream_flush(ekv_utf8_stream *s, char *out, size_t cap);


/* ------------------------------------------------------------------------------------------
 * Model: the immutable, validated artifact
 * ------------------------------------------------------------------------------------------ */
typedef struct ekv_model ekv_model;

typedef struct ekv_model_options {
  int threads;               /* worker threads for the kernels; 0 = every online core */
  uint64_t mem_limit_bytes;  /* 0 = none; refuse (EKV_ERR_NO_MEMORY) before allocating when the
                                plan (weights + caches + arena) is above it */
  int verify_weights;        /* EKV_VERIFY_*; ekv_model_options_init sets EKV_VERIFY_DEFAULT */
} ekv_model_options;
/* Weight verification at open. DEFAULT: each weight's CRC-32 (the program records them) is checked,
 * a corrupt one refused by its name, unless a stamp beside the artifact (.params.verified: the params
 * file's size, inode, mtime and ctime and the program's CRC) says an earlier open checked this very
 * file; a clean check writes the stamp (an unwritable directory only means checking every time).
 * ALWAYS ignores the stamp; OFF trusts the file (`--no-verify`). */
enum { EKV_VERIFY_OFF = 0, EKV_VERIFY_DEFAULT = 1, EKV_VERIFY_ALWAYS = 2 };
enum { EKV_WEIGHTS_UNCHECKED = 0, EKV_WEIGHTS_CHECKED = 1, EKV_WEIGHTS_STAMPED = 2 };

void ekv_model_options_init(ekv_model_options *opts);

/* The thread count of a run (runtime/src/threads.c; edgekv/threads.py is the same rule): the usable
 * cores (affinity, physical cores, big cores, a cgroup CPU quota); by default those minus the other
 * runnable processes (at least 1); a request above the usable cores clamped to them (clamped = 1).
 * ekv_model_open applies it to options.threads (0 = the default). */
typedef struct ekv_thread_choice {
  int count, requested, cores, busy, clamped;
} ekv_thread_choice;
void ekv_choose_threads(int requested, ekv_thread_choice *out);
int ekv_usable_cores(void);
/* The devices this build of the runtime runs artifacts on: "cpu" or "cpu,opencl". */
const char *ekv_runtime_devices(void);
/* Open an artifact directory: program.ekv (validated whole: every index, offset and size),
 * the library (CPU features and architecture checked before dlopen, every kernel resolved),
 * the weights mapped read-only, the tokenizer. *out is set even on failure. */
ekv_status ekv_model_open(const char *artifact_dir, const ekv_model_options *opts, ekv_model **out);
void ekv_model_close(ekv_model *model);
const char *ekv_model_last_error(const ekv_model *model);
/* The artifact's tokenizer (NULL when it has none); owned by the model. */
ekv_tokenizer *ekv_model_tokenizer(ekv_model *model);

typedef struct ekv_model_info {
  const char *model_id, *policy, *policy_params, *target_profile, *target_arch, *edgekv_version, *weight_hash;
  int32_t num_layers, vocab_size, max_position, budget, block, pseudo_rows, threads, chat;
  uint64_t weights_bytes;   /* the mapped params file */
  uint64_t cache_bytes;     /* one session's caches (all layers, all fields) */
  uint64_t arena_bytes;     /* one session's planned intermediates */
  uint64_t plan_bytes;      /* weights + caches + arena + inputs */
  int32_t n_kernels, n_calls_prefill, n_calls_decode;
  const char *device; /* "cpu", or "opencl: <platform> / <device>" */
  int32_t weights_check;  /* EKV_WEIGHTS_*: how this open trusted the weights */
  double verify_seconds;  /* the seconds the check took (0 when stamped or off) */
  int32_t threads_cores, threads_busy; /* the thread choice: usable cores, other runnable processes seen */
} ekv_model_info;
/* Strings point into the model; valid until ekv_model_close. */
void ekv_model_get_info(const ekv_model *model, ekv_model_info *info);

/* ------------------------------------------------------------------------------------------
 * Session: one sequence — caches, arena, position
 * ------------------------------------------------------------------------------------------ */
typedef struct ekv_session ekv_session;

/* Allocates the caches and the arena once (nothing is allocated per block or token). */
ekv_status ekv_session_new(ekv_model *model, ekv_session **out);
void ekv_session_free(ekv_session *session);
const char *ekv_session_last_error(const ekv_session *session);
/* Empty the caches (restores every cache field's initial contents) and the position. */
void ekv_session_reset(ekv_session *session);

/* Called after each block: tokens done so far and in all; return nonzero to cancel. */
typedef int (*ekv_progress_fn)(void *user, size_t done, size_t total);

/* Block-wise prefill of a prompt (after reset; or continuing the sequence). Runs the program's
 * per-prompt preparation when it has one, then ceil(n / B) prefill calls. */
ekv_status ekv_session_prefill(ekv_session *session, const int32_t *ids, size_t n, ekv_progress_fn progress,
                               void *user);
/* The question that will follow the next prefill's tokens (a document's question), for an artifact
 * compiled with --question-rows: its rows then score every block of the prefill at their true
 * future positions and never enter the cache; it applies to every prefill until cleared (ids
 * NULL or n 0). Refused when the artifact has no question rows or fewer than n; the question
 * itself is prefilled after the document, as any continuation. */
ekv_status ekv_session_set_question(ekv_session *session, const int32_t *ids, size_t n);
/* The longest question (tokens) the artifact's prefill rows hold (0: compiled without). */
int32_t ekv_model_question_rows(const ekv_model *model);
/* One decode step: token at the next position. */
ekv_status ekv_session_decode(ekv_session *session, int32_t token);
/* The last step's logits (vocab_size floats; valid until the next step). */
const float *ekv_session_logits(const ekv_session *session);
/* Next position (= tokens in the sequence so far). */
size_t ekv_session_position(const ekv_session *session);
/* Let the sequence run past the model's trained context (refused by default: quality degrades). */
void ekv_session_allow_beyond_context(ekv_session *session, int allow);
/* Ask a running prefill/generate to stop at the next block or token (any thread). */
void ekv_session_cancel(ekv_session *session);
/* (Safe from a signal handler. The work stops before the next kernel call: within one kernel's time.
 * A prefill or decode stopped inside a block leaves that block half applied: reset the session,
 * or load a snapshot, before using it again.) */

/* Layer `layer`'s kept entries: the cache's fill count and per KV head its original positions
 * ([heads][fill], head-major, into out with room for cap). */
ekv_status ekv_session_kept_positions(const ekv_session *session, int32_t layer, int32_t *out, size_t cap,
                                      int32_t *heads, int32_t *fill);

/* Save the cache state — every layer's kept K/V and positions, the policy's cache state, the
 * position — to one file, atomically (written beside it, then renamed). `question` (or NULL)
 * records that the cache was made knowing a question (query-aware policies); `chat` that the
 * document was read with the chat template (its questions must be too). The file also names
 * the artifact it was made with (its absolute path) and the document's prefill time. */
ekv_status ekv_session_save(ekv_session *session, const char *path, const char *question, int chat);
/* Map a snapshot back (copy-on-write: nothing is copied, the file never changes) and continue
 * from it; refused when it was made for other weights, another artifact or other settings, or
 * fails its checksums. Load it again to answer another question from the same state. */
ekv_status ekv_session_load(ekv_session *session, const char *path);
/* Whether the snapshot at `path` can be loaded into a session of the artifact in `artifact_dir`,
 * judged from program.ekv and the snapshot's header alone — nothing is loaded, no weight mapped —
 * so that a cache made with another artifact, policy, N, B or K/V format is refused before the
 * slow part (edgekv-run --load-cache calls it first). The reason goes to `msg` (cap bytes). */
ekv_status ekv_snapshot_check(const char *artifact_dir, const char *path, char *msg, size_t cap);

/* What a loaded snapshot records (strings point into the mapping; valid until the next load,
 * reset or free). */
typedef struct ekv_snapshot_info {
  const char *question;    /* the question it was made knowing ("" none) */
  const char *made_from;   /* the artifact it was made with ("" when not recorded) */
  int chat;                /* the document was read with the chat template */
  uint64_t tokens;         /* document tokens prefilled */
  double document_seconds; /* that prefill's time when the snapshot was made (0 unknown) */
} ekv_snapshot_info;
/* EKV_ERR_INVALID_ARG when no snapshot is loaded. */
ekv_status ekv_session_snapshot_info(const ekv_session *session, ekv_snapshot_info *info);

typedef struct ekv_stats {
  uint64_t prefill_tokens, prefill_blocks, decode_tokens;
  double prefill_seconds, decode_seconds, prepare_seconds, load_seconds, first_block_seconds;
  uint64_t runtime_bytes_peak;   /* the runtime's own allocations (caches, arena, workspaces, ...) */
  uint64_t workspace_bytes_peak; /* kernel workspaces at their peak */
  uint64_t peak_rss_bytes;       /* the process's peak resident set (VmHWM) */
  uint64_t mapped_bytes;         /* the params file mapping */
  uint64_t device_bytes_peak;    /* device memory held at its peak (weights, caches, arena, workspaces;
                                    0 on the CPU, where it is the runtime's own allocations) */
} ekv_stats;
void ekv_session_get_stats(const ekv_session *session, ekv_stats *stats);

/* ------------------------------------------------------------------------------------------
 * Sampling and generation
 * ------------------------------------------------------------------------------------------ */
typedef struct ekv_sampler ekv_sampler;
/* temperature 0 = greedy (argmax, lowest id on ties); top_p in (0, 1]; seed fixes the RNG. */
ekv_status ekv_sampler_new(float temperature, float top_p, uint64_t seed, ekv_sampler **out);
void ekv_sampler_free(ekv_sampler *sampler);
int32_t ekv_sampler_sample(ekv_sampler *sampler, const float *logits, int32_t n);

/* The ids generation stops at (default: the tokenizer's stop ids); n = 0: never stop early. */
void ekv_session_set_stop_ids(ekv_session *session, const int32_t *ids, size_t n);

/* Called with each generated token and its complete UTF-8 text so far held back at character
 * boundaries (special tokens give empty text); return nonzero to stop. */
typedef int (*ekv_token_fn)(void *user, int32_t id, const char *text, size_t len);

/* Prefill `prompt`, then sample up to max_new tokens (a stop id ends it and is included).
 * out_ids (cap entries, may be NULL) receives the generated ids, *n_out their count. */
ekv_status ekv_session_generate(ekv_session *session, const int32_t *prompt, size_t n, int32_t max_new,
                                ekv_sampler *sampler, ekv_progress_fn progress, ekv_token_fn on_token, void *user,
                                int32_t *out_ids, size_t cap, size_t *n_out);

#ifdef __cplusplus
}
#endif
#endif /* EDGEKV_H */
