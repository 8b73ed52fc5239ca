/* edgekv-run: answer a prompt with a compiled artifact, no Python. The only place in the
 * runtime that prints or exits.
 *
 *   edgekv-run ARTIFACT --prompt TEXT | --prompt-file F | --prompt-ids 1,2,3|@FILE [--chat]
 *              [--max-new-tokens 64] [--temperature 0] [--top-p 1] [--seed 0] [--threads N]
 *              [--mem-limit 1.5GiB] [--report out.json] [--allow-beyond-context]
 *              [--no-verify | --verify-weights] [--quiet] [--check] [--warmup] [--ignore-eos]
 *   edgekv-run ARTIFACT --prompt-file DOC [--chat] --question Q ... [--save-cache F]
 *   edgekv-run ARTIFACT --prompt-file DOC [--chat] --save-cache F   (read and save the document only)
 *   edgekv-run ARTIFACT --load-cache F --question Q ...
 *   edgekv-run ARTIFACT --prompt ... --repeat-open N   (open, run, close N times: a teardown check)
 *
 * Exit status: 0 done, 2 bad input or artifact (the message says what to change), 130 cancelled. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "edgekv.h"
#include "json.h"

#define MAX_PROMPT_BYTES ((size_t)64 << 20)

#define MAX_QUESTIONS 64

typedef struct {
  const char *artifact, *prompt, *prompt_file, *prompt_ids, *report, *save_cache, *load_cache;
  const char *questions[MAX_QUESTIONS];
  int n_questions;
  int chat, max_new, threads, allow_beyond, verify_weights, quiet, check_only, warmup, ignore_eos, repeat_open;
  float temperature, top_p;
  uint64_t seed, mem_limit;
} options;

static ekv_session *g_session; /* for SIGINT: cancel at the next block or token */

/* the first ^C stops the work at the next kernel call and the run ends with 130; a second one
 * (the default action) ends the process at once */
static void on_sigint(int sig) {
  (void)sig;
  if (g_session != NULL) ekv_session_cancel(g_session);
  signal(SIGINT, SIG_DFL);
}

static int fail(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "error: ");
  fprintf(stderr, fmt, a, b);
  fputc('\n', stderr);
  return 2;
}

static void usage(FILE *f) {
  fputs("usage: edgekv-run ARTIFACT (--prompt TEXT | --prompt-file FILE | --prompt-ids 1,2,3|@FILE) [--chat]\n"
        "                  [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--threads N]\n"
        "                  [--mem-limit BYTES] [--report FILE] [--allow-beyond-context] [--no-verify | --verify-weights]\n"
        "                  [--quiet] [--check] [--warmup] [--ignore-eos]\n"
        "       edgekv-run ARTIFACT --prompt-file DOC [--chat] --question Q [--question Q2 ...] [--save-cache F]\n"
        "       edgekv-run ARTIFACT --prompt-file DOC [--chat] --save-cache F      (the document only, for later questions)\n"
        "       edgekv-run ARTIFACT --load-cache F --question Q [--question Q2 ...]\n"
        "  --question         a question about the prompt (the document): each answered from the document's state\n"
        "  --save-cache       save the document's compressed cache to F (atomically)\n"
        "  --load-cache       answer from a saved cache instead of reading a document (its --chat form is kept)\n"
        "Runs an artifact written by `edgekv compile` (program.ekv, model.so, params, tokenizer.ekt).\n"
        "  --check            open and validate the artifact, then exit\n"
        "  --quiet            print the answer only: no progress, warnings or summary line on stderr (errors still)\n"
        "  --no-verify        trust the weights: skip the check of each weight's checksum at open (by default a corrupt\n"
        "                     params file is refused; a stamp beside the artifact makes later opens of the same file free)\n"
        "  --verify-weights   check every weight's checksum even when the stamp says an earlier open did\n"
        "  --mem-limit        refuse before allocating when the plan is above it (512MiB, 1.5GiB, bytes)\n"
        "  --threads          kernel threads (default: the usable cores — affinity, physical and big cores, a CPU\n"
        "                     quota — less those busy with other work; more than the usable cores is clamped to them)\n"
        "  --warmup           run the prompt's first block once before the timed run (benchmarks)\n"
        "  --ignore-eos       decode exactly --max-new-tokens tokens (benchmarks)\n"
        "  --repeat-open N    open the artifact twice, run the prompt greedily on each, free and close them; N rounds\n"
        "                     in one process, each round's ids compared with the first's (a driver's teardown check)\n",
        f);
}

/* "512MiB", "1.5GiB", "2GB", "1000000" → bytes; 0 on a bad value */
static uint64_t parse_bytes(const char *s) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno != 0 || end == s || !(v > 0)) return 0;
  static const struct { const char *suffix; double scale; } UNITS[] = {
      {"", 1}, {"b", 1}, {"k", 1e3}, {"kb", 1e3}, {"kib", 1024.0}, {"m", 1e6}, {"mb", 1e6}, {"mib", 1048576.0},
      {"g", 1e9}, {"gb", 1e9}, {"gib", 1073741824.0}};
  char unit[8] = "";
  size_t n = strlen(end);
  if (n >= sizeof unit) return 0;
  for (size_t i = 0; i < n; i++) unit[i] = (char)((end[i] >= 'A' && end[i] <= 'Z') ? end[i] - 'A' + 'a' : end[i]);
  unit[n] = '\0';
  for (size_t i = 0; i < sizeof UNITS / sizeof UNITS[0]; i++)
    if (strcmp(unit, UNITS[i].suffix) == 0) {
      double bytes = v * UNITS[i].scale;
      return bytes >= 1.8e19 ? 0 : (uint64_t)bytes;
    }
  return 0;
}

static int parse_int(const char *s, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

static int parse_float(const char *s, float *out) {
  char *end;
  errno = 0;
  float v = strtof(s, &end);
  if (errno != 0 || end == s || *end != '\0') return 0;
  *out = v;
  return 1;
}

static int parse_args(int argc, char **argv, options *o) {
  static const struct option LONG[] = {
      {"prompt", required_argument, 0, 'p'},       {"prompt-file", required_argument, 0, 'f'},
      {"prompt-ids", required_argument, 0, 'i'},   {"chat", no_argument, 0, 'c'},
      {"max-new-tokens", required_argument, 0, 'n'}, {"temperature", required_argument, 0, 't'},
      {"top-p", required_argument, 0, 'P'},        {"seed", required_argument, 0, 's'},
      {"threads", required_argument, 0, 'T'},      {"mem-limit", required_argument, 0, 'm'},
      {"report", required_argument, 0, 'r'},       {"allow-beyond-context", no_argument, 0, 'A'},
      {"verify-weights", no_argument, 0, 'V'},     {"quiet", no_argument, 0, 'q'},
      {"no-verify", no_argument, 0, 'N'},
      {"check", no_argument, 0, 'C'},              {"help", no_argument, 0, 'h'},
      {"warmup", no_argument, 0, 'W'},             {"ignore-eos", no_argument, 0, 'E'},
      {"question", required_argument, 0, 'Q'},     {"save-cache", required_argument, 0, 'S'},
      {"load-cache", required_argument, 0, 'L'},   {"repeat-open", required_argument, 0, 'R'},
      {0, 0, 0, 0}};
  o->max_new = 64;
  o->top_p = 1.0f;
  o->verify_weights = EKV_VERIFY_DEFAULT;
  long v;
  int c;
  opterr = 0;
  while ((c = getopt_long(argc, argv, "p:f:i:cn:t:P:s:T:m:r:AVNqChWEQ:S:L:R:", LONG, NULL)) != -1) {
    switch (c) {
      case 'p': o->prompt = optarg; break;
      case 'f': o->prompt_file = optarg; break;
      case 'i': o->prompt_ids = optarg; break;
      case 'c': o->chat = 1; break;
      case 'n':
        if (!parse_int(optarg, 0, 1 << 24, &v)) return fail("--max-new-tokens %s is not a count of tokens (0 or more)", optarg, "");
        o->max_new = (int)v;
        break;
      case 't':
        if (!parse_float(optarg, &o->temperature) || !(o->temperature >= 0.0f))
          return fail("--temperature %s: give 0 (greedy) or a positive number such as 0.7", optarg, "");
        break;
      case 'P':
        if (!parse_float(optarg, &o->top_p) || !(o->top_p > 0.0f && o->top_p <= 1.0f))
          return fail("--top-p %s: give a number in (0, 1], such as 0.9", optarg, "");
        break;
      case 's':
        if (!parse_int(optarg, 0, LONG_MAX, &v)) return fail("--seed %s is not a non-negative integer", optarg, "");
        o->seed = (uint64_t)v;
        break;
      case 'T':
        if (!parse_int(optarg, 1, 1024, &v)) return fail("--threads %s: give a count from 1 to 1024", optarg, "");
        o->threads = (int)v;
        break;
      case 'm':
        o->mem_limit = parse_bytes(optarg);
        if (o->mem_limit == 0) return fail("--mem-limit %s: give bytes such as 512MiB, 1.5GiB or 2000000000", optarg, "");
        break;
      case 'r': o->report = optarg; break;
      case 'A': o->allow_beyond = 1; break;
      case 'V': o->verify_weights = EKV_VERIFY_ALWAYS; break;
      case 'N': o->verify_weights = EKV_VERIFY_OFF; break;
      case 'q': o->quiet = 1; break;
      case 'C': o->check_only = 1; break;
      case 'W': o->warmup = 1; break;
      case 'E': o->ignore_eos = 1; break;
      case 'Q':
        if (o->n_questions == MAX_QUESTIONS) return fail("at most %s --question options%s", "64", "");
        if (optarg[0] == '\0') return fail("--question is empty; give the question's text%s%s", "", "");
        o->questions[o->n_questions++] = optarg;
        break;
      case 'S': o->save_cache = optarg; break;
      case 'L': o->load_cache = optarg; break;
      case 'R':
        if (!parse_int(optarg, 1, 100000, &v)) return fail("--repeat-open %s: give a count of rounds from 1 to 100000", optarg, "");
        o->repeat_open = (int)v;
        break;
      case 'h': usage(stdout); exit(0);
      default:
        usage(stderr);
        return fail("unknown or incomplete option %s", argv[optind - 1], "");
    }
  }
  if (optind != argc - 1) {
    usage(stderr);
    return fail("give exactly one artifact directory%s%s", "", "");
  }
  o->artifact = argv[optind];
  int sources = (o->prompt != NULL) + (o->prompt_file != NULL) + (o->prompt_ids != NULL);
  if (o->check_only) return 0;
  if (o->load_cache != NULL) {
    if (sources != 0) return fail("--load-cache holds the document already: drop --prompt/--prompt-file/--prompt-ids%s%s", "", "");
    if (o->n_questions == 0) return fail("--load-cache needs at least one --question to answer from it%s%s", "", "");
    if (o->save_cache != NULL) return fail("give --save-cache or --load-cache, not both%s%s", "", "");
    return 0;
  }
  if (sources != 1) return fail("give one of --prompt, --prompt-file or --prompt-ids%s%s", "", "");
  if (o->repeat_open > 0 && (o->n_questions > 0 || o->save_cache != NULL || o->report != NULL))
    return fail("--repeat-open runs the prompt only: drop --question, --save-cache and --report%s%s", "", "");
  if (o->prompt_ids != NULL && (o->n_questions > 0)) return fail("--question needs a text document (--prompt or --prompt-file)%s%s", "", "");
  return 0;
}

/* An output path (--report, --save-cache) is checked before any work, so a run never ends by
 * losing its result. */
static int check_output_path(const char *option, const char *path) {
  if (path == NULL) return 0;
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL) snprintf(dir, sizeof dir, ".");
  else if (slash == dir) dir[1] = '\0';
  else *slash = '\0';
  char what[4200];
  snprintf(what, sizeof what, "%s %s", option, path);
  if (access(dir, W_OK) != 0) return fail("%s: the folder %s does not exist or is not writable", what, dir);
  if (access(path, F_OK) == 0 && access(path, W_OK) != 0) return fail("%s is not writable%s", what, "");
  FILE *probe = fopen(path, "r");
  if (probe != NULL) {
    char c;
    int is_dir = fread(&c, 1, 1, probe) == 0 && ferror(probe);
    fclose(probe);
    if (is_dir) return fail("%s is a directory; give a file path%s", what, "");
  }
  return 0;
}

/* `option`: what the user gave (--prompt-file FILE, --prompt-ids @FILE), named in the errors */
static int read_prompt_file(const char *option, const char *path, char **out, size_t *len) {
  char what[4200];
  snprintf(what, sizeof what, "%s %s%s", option, strcmp(option, "--prompt-ids") == 0 ? "@" : "", path);
  FILE *f = fopen(path, "rb");
  if (f == NULL) return fail("cannot read %s: %s", what, strerror(errno));
  char *buf = malloc(MAX_PROMPT_BYTES + 1);
  if (buf == NULL) {
    fclose(f);
    return fail("out of memory reading %s%s", path, "");
  }
  size_t n = fread(buf, 1, MAX_PROMPT_BYTES + 1, f);
  int bad = ferror(f);
  fclose(f);
  if (bad || n > MAX_PROMPT_BYTES) {
    free(buf);
    return fail("cannot read %s (unreadable, a directory, or over 64 MiB)%s", what, "");
  }
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return 0;
}

/* text → ids (malloc'd) as the whole prompt, a document, or a question about it */
static int encode_text(ekv_model *model, const char *text, size_t len, int chat, ekv_text_part part, int32_t **ids,
                       size_t *n) {
  ekv_tokenizer *tok = ekv_model_tokenizer(model);
  if (tok == NULL) return fail("this artifact has no tokenizer; pass --prompt-ids%s%s", "", "");
  if (chat && !ekv_tokenizer_has_chat_template(tok))
    return fail("--chat: the model has no chat template; run without --chat%s%s", "", "");
  size_t count = 0;
  ekv_status st = ekv_tokenizer_encode_part(tok, text, len, chat, part, NULL, 0, &count);
  *ids = st == EKV_OK ? malloc(sizeof(int32_t) * (count + 1)) : NULL;
  if (st == EKV_OK && *ids != NULL) st = ekv_tokenizer_encode_part(tok, text, len, chat, part, *ids, count, n);
  if (st != EKV_OK || *ids == NULL) return fail("cannot tokenize the text: %s%s", ekv_tokenizer_last_error(tok), "");
  return 0;
}

/* The text rules both runtimes apply (edgekv/cli/common.py, check_text): UTF-8, and not only
 * whitespace (space, tab, newline, carriage return, vertical tab, form feed). */
static int check_text(const char *option, const char *file, const char *text, size_t len) {
  size_t bad = ekv_utf8_check(text, len);
  if (bad < len) {
    char what[4200], where[64];
    snprintf(what, sizeof what, "%s%s%s", option, file != NULL ? " " : "", file != NULL ? file : "");
    snprintf(where, sizeof where, "byte 0x%02x at offset %zu", (unsigned char)text[bad], bad);
    return fail("%s is not UTF-8 text (%s); save it as UTF-8", what, where);
  }
  for (size_t i = 0; i < len; i++)
    if (strchr(" \t\n\r\v\f", text[i]) == NULL || text[i] == '\0') return 0;
  return fail("the prompt is empty; pass --prompt TEXT or --prompt-file FILE with some text%s%s", "", "");
}

static int encode_prompt(const options *o, ekv_model *model, int32_t **ids, size_t *n) {
  *ids = NULL;
  *n = 0;
  if (o->prompt_ids != NULL) {
    /* @FILE: the ids in a file (a long prompt's ids do not fit one command-line argument) */
    char *from_file = NULL;
    size_t file_len = 0;
    if (o->prompt_ids[0] == '@' && read_prompt_file("--prompt-ids", o->prompt_ids + 1, &from_file, &file_len) != 0) return 2;
    const char *list = from_file != NULL ? from_file : o->prompt_ids;
    while (from_file != NULL && file_len > 0 && (from_file[file_len - 1] == '\n' || from_file[file_len - 1] == ' '))
      from_file[--file_len] = '\0'; /* a trailing newline */
    size_t cap = strlen(list) / 2 + 2;
    int32_t *out = malloc(sizeof(int32_t) * cap);
    if (out == NULL) {
      free(from_file);
      return fail("out of memory%s%s", "", "");
    }
    const char *p = list;
    while (*p != '\0') {
      char *end;
      long v = strtol(p, &end, 10);
      if (end == p || v < 0 || v > INT32_MAX || (*end != ',' && *end != '\0') || *n >= cap) {
        free(out);
        free(from_file);
        return fail("--prompt-ids %s: give comma-separated token ids (or @FILE holding them)%s", o->prompt_ids, "");
      }
      out[(*n)++] = (int32_t)v;
      p = *end == ',' ? end + 1 : end;
    }
    free(from_file);
    *ids = out;
    return 0;
  }
  char *text = (char *)o->prompt;
  size_t len = text != NULL ? strlen(text) : 0;
  if (o->prompt_file != NULL && read_prompt_file("--prompt-file", o->prompt_file, &text, &len) != 0) return 2;
  int rc = check_text(o->prompt_file != NULL ? "--prompt-file" : "--prompt", o->prompt_file, text, len);
  ekv_text_part part = (o->n_questions > 0 || o->save_cache != NULL) ? EKV_PART_DOCUMENT : EKV_PART_WHOLE;
  if (rc == 0) rc = encode_text(model, text, len, o->chat, part, ids, n);
  if (text != o->prompt) free(text);
  return rc;
}

typedef struct {
  const options *o;
  int tty;
  char *text;
  size_t text_len, text_cap;
  int32_t *out_ids;
  size_t n_out, out_cap;
  size_t block;
  double cold_first_block; /* the --warmup block, timed: start-up without a warm cache */
  /* document mode: one answer per --question, each from the document's saved state */
  double question_start, ttft; /* time to first token of the current question */
  double document_seconds;     /* the document's prefill (0 when it came from --load-cache) */
  size_t document_tokens;
  int document_reads;          /* 1, or one per question (an artifact compiled with --question-rows) */
  ekv_snapshot_info loaded;    /* what --load-cache's snapshot records; its strings are the copies below */
  char *loaded_question, *loaded_made_from; /* copies: the snapshot's own strings die at the next load */
  int reported;                /* an error was already printed (the CLI's own checks) */
  struct answer {
    const char *question;
    char *text;
    int32_t *ids;
    size_t n_ids, prompt_tokens;
    double ttft, load_seconds, prefill_seconds, decode_seconds;
  } answers[MAX_QUESTIONS];
  int n_answers;
} run_state;

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int on_progress(void *user, size_t done, size_t total) {
  run_state *r = user;
  if (r->o->quiet) return 0;
  if (r->tty) {
    fprintf(stderr, "\rprefill %zu/%zu tokens (%zu%%)", done, total, total ? 100 * done / total : 100);
    if (done == total) fputc('\n', stderr);
  } else if (done == total) {
    fprintf(stderr, "prefill: %zu tokens in %zu blocks\n", total, (total + r->block - 1) / r->block);
  }
  return 0;
}

static int on_token(void *user, int32_t id, const char *text, size_t len) {
  run_state *r = user;
  if (r->n_out == 0 && r->question_start > 0) r->ttft = now_seconds() - r->question_start;
  if (r->n_out < r->out_cap) r->out_ids[r->n_out++] = id;
  if (len > 0) {
    if (r->text_len + len + 1 > r->text_cap) {
      size_t cap = (r->text_cap + len + 1) * 2;
      char *grown = realloc(r->text, cap);
      if (grown == NULL) return 1;
      r->text = grown;
      r->text_cap = cap;
    }
    memcpy(r->text + r->text_len, text, len);
    r->text_len += len;
    r->text[r->text_len] = '\0';
    fwrite(text, 1, len, stdout); /* the answer, with or without --quiet */
    fflush(stdout);
  }
  return 0;
}

static void write_report(const options *o, ekv_model *model, ekv_session *s, const run_state *r, size_t n_prompt,
                         const char *status, const char *error) {
  char tmp[PATH_MAX];
  snprintf(tmp, sizeof tmp, "%s.part", o->report);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) {
    fprintf(stderr, "error: cannot write the report %s: %s\n", o->report, strerror(errno));
    return;
  }
  ekv_model_info info;
  ekv_model_get_info(model, &info);
  ekv_stats st;
  ekv_session_get_stats(s, &st);
  json_writer w;
  json_begin(&w, f);
  json_object(&w, NULL);
  json_string(&w, "engine", "native");
  json_string(&w, "status", status);
  if (error != NULL) json_string(&w, "error", error);
  json_string(&w, "artifact", o->artifact);
  json_string(&w, "model", info.model_id);
  json_string(&w, "policy", info.policy);
  json_string(&w, "policy_params", info.policy_params);
  json_int(&w, "budget_tokens", info.budget);
  json_int(&w, "block", info.block);
  json_string(&w, "target", info.target_profile);
  json_int(&w, "threads", info.threads);
  json_uint(&w, "prompt_tokens", n_prompt);
  json_uint(&w, "generated_tokens", r->n_out);
  json_array(&w, "generated_ids");
  for (size_t i = 0; i < r->n_out; i++) json_int(&w, NULL, r->out_ids[i]);
  json_end_array(&w);
  json_string_n(&w, "text", r->text != NULL ? r->text : "", r->text_len);
  json_double(&w, "load_seconds", st.load_seconds);
  json_double(&w, "first_block_seconds", st.first_block_seconds);
  /* load to the end of the first block, on cold caches (the warm-up block when there was one) */
  json_double(&w, "startup_seconds", st.load_seconds + (r->cold_first_block > 0 ? r->cold_first_block
                                                                                : st.first_block_seconds));
  json_double(&w, "prepare_seconds", st.prepare_seconds);
  json_double(&w, "prefill_seconds", st.prefill_seconds);
  json_double(&w, "decode_seconds", st.decode_seconds);
  json_double(&w, "prefill_tok_s", st.prefill_seconds > 0 ? (double)st.prefill_tokens / st.prefill_seconds : 0.0 / 0.0);
  json_double(&w, "decode_tok_s", st.decode_seconds > 0 ? (double)st.decode_tokens / st.decode_seconds : 0.0 / 0.0);
  json_object(&w, "memory");
  json_object(&w, "plan");
  json_uint(&w, "weights_bytes", info.weights_bytes);
  json_uint(&w, "cache_bytes", info.cache_bytes);
  json_uint(&w, "arena_bytes", info.arena_bytes);
  json_uint(&w, "total_bytes", info.plan_bytes);
  json_end_object(&w);
  json_uint(&w, "peak_rss_bytes", st.peak_rss_bytes);
  json_uint(&w, "runtime_alloc_peak_bytes", st.runtime_bytes_peak);
  json_uint(&w, "workspace_peak_bytes", st.workspace_bytes_peak);
  json_uint(&w, "weights_mapped_bytes", st.mapped_bytes);
  json_string(&w, "device", info.device);
  json_uint(&w, "device_bytes_peak", st.device_bytes_peak); /* 0 on the CPU */
  json_end_object(&w);
  if (r->n_answers > 0 || o->save_cache != NULL) {
    json_uint(&w, "document_tokens", r->document_tokens);
    json_double(&w, "document_prefill_seconds", r->document_seconds);
    json_uint(&w, "document_reads", (uint64_t)r->document_reads);
    if (o->save_cache != NULL) json_string(&w, "saved_cache", o->save_cache);
    if (o->load_cache != NULL) {
      json_string(&w, "loaded_cache", o->load_cache);
      json_double(&w, "document_prefill_seconds_when_saved", r->loaded.document_seconds);
      json_string(&w, "made_for_question", r->loaded.question);
    }
    json_array(&w, "answers");
    for (int i = 0; i < r->n_answers; i++) {
      const struct answer *a = &r->answers[i];
      json_object(&w, NULL);
      json_string(&w, "question", a->question);
      json_string(&w, "text", a->text != NULL ? a->text : "");
      json_array(&w, "generated_ids");
      for (size_t k = 0; k < a->n_ids; k++) json_int(&w, NULL, a->ids[k]);
      json_end_array(&w);
      json_uint(&w, "question_tokens", a->prompt_tokens);
      json_double(&w, "load_seconds", a->load_seconds);
      json_double(&w, "question_prefill_seconds", a->prefill_seconds);
      json_double(&w, "decode_seconds", a->decode_seconds);
      /* from the state of the document being ready (loaded or just read) to the first answer token */
      json_double(&w, "time_to_first_token_seconds", a->ttft);
      json_end_object(&w);
    }
    json_end_array(&w);
  }
  json_array(&w, "cache_lengths");
  for (int32_t l = 0; l < info.num_layers; l++) {
    int32_t heads = 0, fill = 0;
    ekv_session_kept_positions(s, l, NULL, 0, &heads, &fill);
    json_int(&w, NULL, fill);
  }
  json_end_array(&w);
  json_end_object(&w);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad || rename(tmp, o->report) != 0) {
    remove(tmp);
    fprintf(stderr, "error: cannot write the report %s: %s\n", o->report, strerror(errno));
  }
}

static char *copy_string(const char *text) {
  size_t n = strlen(text) + 1;
  char *copy = malloc(n);
  if (copy != NULL) memcpy(copy, text, n);
  return copy;
}

/* A document, then each question from the document's state: the state is saved once (to
 * --save-cache, or a temporary file when several questions need it) and loaded again before
 * every question but the first, so no answer leaks into the next question's cache. An artifact
 * compiled with --question-rows reads the document once per question instead, knowing it (its
 * blocks score with the question's rows); --save-cache then keeps the first question's state. */
static ekv_status run_document(const options *o, ekv_model *model, ekv_session *s, ekv_sampler *sampler,
                               const int32_t *doc, size_t n_doc, run_state *r) {
  ekv_status st = EKV_OK;
  char tmp_path[] = "/tmp/edgekv-run-doc-XXXXXX";
  int per_question = o->load_cache == NULL && o->n_questions > 0 && ekv_model_question_rows(model) > 0;
  const char *snapshot = o->load_cache != NULL ? o->load_cache : o->save_cache;
  if (per_question) snapshot = NULL;
  if (snapshot == NULL && o->n_questions > 1 && !per_question) {
    int fd = mkstemp(tmp_path);
    if (fd < 0) return EKV_ERR_IO;
    close(fd);
    snapshot = tmp_path;
  }
  double t0 = now_seconds();
  int chat = o->chat;
  if (o->load_cache != NULL) {
    st = ekv_session_load(s, o->load_cache);
    r->answers[0].load_seconds = now_seconds() - t0;
    if (st == EKV_OK) {
      ekv_session_snapshot_info(s, &r->loaded);
      /* each later question loads the file again, which unmaps the strings the info points into */
      r->loaded_question = copy_string(r->loaded.question);
      r->loaded_made_from = copy_string(r->loaded.made_from);
      if (r->loaded_question == NULL || r->loaded_made_from == NULL) return EKV_ERR_NO_MEMORY;
      r->loaded.question = r->loaded_question;
      r->loaded.made_from = r->loaded_made_from;
      r->document_tokens = (size_t)r->loaded.tokens;
      if (o->chat && !r->loaded.chat) { /* the questions follow the document's form */
        r->reported = 1;
        fail("%s holds a document read without the chat template: ask without --chat%s", o->load_cache, "");
        return EKV_ERR_INVALID_ARG;
      }
      chat = r->loaded.chat;
      if (r->loaded.question[0] != '\0')
        for (int q = 0; q < o->n_questions; q++)
          if (strcmp(r->loaded.question, o->questions[q]) != 0 && !o->quiet)
            fprintf(stderr, "warning: %s was made knowing the question \"%s\" (a query-aware policy's cache); "
                    "answers to other questions may miss what it evicted\n", o->load_cache, r->loaded.question);
    }
  } else if (!per_question) {
    st = ekv_session_prefill(s, doc, n_doc, on_progress, r);
    r->document_seconds = now_seconds() - t0;
    r->document_tokens = n_doc;
    r->document_reads = 1;
    if (st == EKV_OK && snapshot != NULL) st = ekv_session_save(s, snapshot, NULL, o->chat);
    if (st == EKV_OK && o->save_cache != NULL && !o->quiet)
      fprintf(stderr, "saved the document's cache (%zu tokens) to %s\n", n_doc, o->save_cache);
  }
  for (int q = 0; st == EKV_OK && q < o->n_questions; q++) {
    struct answer *a = &r->answers[q];
    a->question = o->questions[q];
    r->question_start = now_seconds();
    if (q > 0 && !per_question) {
      st = ekv_session_load(s, snapshot);
      a->load_seconds = now_seconds() - r->question_start;
      if (st != EKV_OK) break;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (encode_text(model, a->question, strlen(a->question), chat, EKV_PART_QUESTION, &ids, &n) != 0) {
      r->reported = 1;
      st = EKV_ERR_INVALID_ARG;
      break;
    }
    if (!o->quiet && o->n_questions > 1) {
      fflush(stdout);
      fprintf(stderr, "question %d: %s\n", q + 1, a->question);
    }
    double before = 0.0;
    if (per_question) { /* this question's own reading of the document */
      if (q > 0) ekv_session_reset(s);
      double td = now_seconds();
      st = ekv_session_set_question(s, ids, n);
      if (st == EKV_OK) st = ekv_session_prefill(s, doc, n_doc, on_progress, r);
      ekv_session_set_question(s, NULL, 0);
      r->document_seconds += now_seconds() - td;
      r->document_tokens = n_doc;
      r->document_reads++;
      if (st == EKV_OK && q == 0 && o->save_cache != NULL) {
        st = ekv_session_save(s, o->save_cache, a->question, o->chat);
        if (st == EKV_OK && !o->quiet)
          fprintf(stderr, "saved the document's cache (%zu tokens, read knowing question 1) to %s\n", n_doc,
                  o->save_cache);
      }
      if (st != EKV_OK) {
        free(ids);
        break;
      }
      ekv_stats read;
      ekv_session_get_stats(s, &read);
      before = read.prefill_seconds;
      r->question_start = now_seconds();
    }
    r->n_out = 0;
    r->text_len = 0;
    r->ttft = 0;
    size_t n_out = 0;
    st = ekv_session_generate(s, ids, n, o->max_new, sampler, NULL, on_token, r, NULL, 0, &n_out);
    free(ids);
    if (r->text_len > 0) fputc('\n', stdout);
    ekv_stats stats;
    ekv_session_get_stats(s, &stats);
    a->prompt_tokens = n;
    a->ttft = r->ttft + (q == 0 && o->load_cache != NULL ? a->load_seconds : 0.0);
    a->prefill_seconds = stats.prefill_seconds - before;
    a->decode_seconds = stats.decode_seconds;
    a->n_ids = r->n_out;
    a->ids = malloc(sizeof(int32_t) * (r->n_out + 1));
    a->text = malloc(r->text_len + 1);
    if (a->ids != NULL) memcpy(a->ids, r->out_ids, sizeof(int32_t) * r->n_out);
    if (a->text != NULL) {
      if (r->text_len) memcpy(a->text, r->text, r->text_len);
      a->text[r->text_len] = '\0';
    }
    r->n_answers = q + 1;
  }
  r->question_start = 0;
  if (snapshot == tmp_path) unlink(tmp_path);
  return st;
}

/* One model of the artifact: open, a session, the prompt run greedily (ids into out), freed and
 * closed in the order an app does. Returns 0, or 2 with the error printed. */
static int open_run_close(const options *o, const ekv_model_options *mo, ekv_model **model, ekv_session **s,
                          int32_t *out, size_t *n_out) {
  if (ekv_model_open(o->artifact, mo, model) != EKV_OK) return fail("%s%s", ekv_model_last_error(*model), "");
  if (ekv_session_new(*model, s) != EKV_OK) return fail("%s%s", ekv_session_last_error(*s), "");
  int32_t *ids = NULL;
  size_t n = 0;
  int rc = encode_prompt(o, *model, &ids, &n);
  ekv_sampler *greedy = NULL;
  if (rc == 0 && ekv_sampler_new(0.0f, 1.0f, 0, &greedy) != EKV_OK) rc = fail("cannot make a sampler%s%s", "", "");
  if (rc == 0 && ekv_session_generate(*s, ids, n, o->max_new, greedy, NULL, NULL, NULL, out, (size_t)o->max_new,
                                      n_out) != EKV_OK)
    rc = fail("%s%s", ekv_session_last_error(*s), "");
  ekv_sampler_free(greedy);
  free(ids);
  return rc;
}

/* --repeat-open N: N rounds in one process, each opening the artifact twice (a GPU artifact's two
 * models share one device: its kernels, queue and context), running the prompt on both, then
 * freeing the sessions and closing the models in the opposite order of opening. A driver that
 * crashes in teardown crashes here (exit 139 from the shell); the ids of every run must match
 * round 1's. */
static int repeat_open(const options *o) {
  ekv_model_options mo;
  ekv_model_options_init(&mo);
  mo.threads = o->threads;
  mo.mem_limit_bytes = o->mem_limit;
  mo.verify_weights = o->verify_weights;
  size_t cap = (size_t)o->max_new + 1;
  int32_t *first = calloc(cap, sizeof *first), *got = calloc(cap, sizeof *got);
  size_t n_first = 0;
  int rc = first != NULL && got != NULL ? 0 : fail("out of memory%s%s", "", "");
  for (int round = 1; rc == 0 && round <= o->repeat_open; round++) {
    ekv_model *m[2] = {NULL, NULL};
    ekv_session *s[2] = {NULL, NULL};
    char device[256] = ""; /* a copy: the name belongs to the device, gone after the last close */
    for (int k = 0; k < 2 && rc == 0; k++) {
      size_t n_got = 0;
      rc = open_run_close(o, &mo, &m[k], &s[k], got, &n_got);
      if (rc != 0) break;
      if (round == 1 && k == 0) {
        memcpy(first, got, sizeof *got * n_got);
        n_first = n_got;
      } else if (n_got != n_first || memcmp(first, got, sizeof *got * n_got) != 0) {
        rc = fail("--repeat-open: a run gave other ids than round 1's first run%s%s", "", "");
      }
      ekv_model_info info;
      ekv_model_get_info(m[k], &info);
      snprintf(device, sizeof device, "%s", info.device);
    }
    for (int k = 1; k >= 0; k--) ekv_session_free(s[k]);
    for (int k = 1; k >= 0; k--) ekv_model_close(m[k]);
    if (rc == 0 && !o->quiet)
      fprintf(stderr, "edgekv-run: round %d of %d: 2 models opened, %zu ids each, freed and closed (%s)\n", round,
              o->repeat_open, n_first, device);
  }
  free(first);
  free(got);
  if (rc == 0) printf("repeat-open: %d rounds ok\n", o->repeat_open);
  return rc;
}

int main(int argc, char **argv) {
  options o;
  memset(&o, 0, sizeof o);
  int rc = parse_args(argc, argv, &o);
  if (rc != 0) return rc;
  if (check_output_path("--report", o.report) != 0 || check_output_path("--save-cache", o.save_cache) != 0) return 2;
  if (o.prompt != NULL && check_text("--prompt", NULL, o.prompt, strlen(o.prompt)) != 0) return 2;
  if (o.prompt_file != NULL) { /* read now too: a bad prompt is refused before the model loads */
    char *text = NULL;
    size_t len = 0;
    rc = read_prompt_file("--prompt-file", o.prompt_file, &text, &len);
    if (rc == 0) rc = check_text("--prompt-file", o.prompt_file, text, len);
    free(text);
    if (rc != 0) return 2;
  }
  if (o.repeat_open > 0) return repeat_open(&o);
  if (o.load_cache != NULL) { /* a cache from another artifact, policy, N or B: refused before the load */
    char why[1024];
    if (ekv_snapshot_check(o.artifact, o.load_cache, why, sizeof why) != EKV_OK) return fail("%s%s", why, "");
  }
  ekv_model_options mo;
  ekv_model_options_init(&mo);
  mo.threads = o.threads;
  mo.mem_limit_bytes = o.mem_limit;
  mo.verify_weights = o.verify_weights;
  if (o.threads > 0) { /* the runtime clamps a count above the usable cores: say so */
    ekv_thread_choice tc;
    ekv_choose_threads(o.threads, &tc);
    if (tc.clamped)
      fprintf(stderr, "warning: --threads %d is more than the %d usable cores here (affinity, physical and big "
              "cores, CPU quota): using %d; threads beyond the cores only wait for each other\n", o.threads, tc.cores,
              tc.count);
  }
  ekv_model *model = NULL;
  if (ekv_model_open(o.artifact, &mo, &model) != EKV_OK) {
    rc = fail("%s%s", ekv_model_last_error(model), "");
    ekv_model_close(model);
    return rc;
  }
  if (o.check_only) {
    ekv_model_info info;
    ekv_model_get_info(model, &info);
    printf("ok: %s, policy %s, N = %d, B = %d, %d kernels, plan %.1f MiB\n", info.model_id, info.policy, info.budget,
           info.block, info.n_kernels, (double)info.plan_bytes / 1048576.0);
    ekv_model_close(model);
    return 0;
  }
  int32_t *ids = NULL;
  size_t n = 0;
  ekv_session *s = NULL;
  ekv_sampler *sampler = NULL;
  run_state r = {.o = &o, .tty = isatty(2)};
  if (o.load_cache == NULL) rc = encode_prompt(&o, model, &ids, &n);
  if (rc == 0 && ekv_session_new(model, &s) != EKV_OK) rc = fail("%s%s", ekv_session_last_error(s), "");
  if (rc == 0 && ekv_sampler_new(o.temperature, o.top_p, o.seed, &sampler) != EKV_OK) rc = fail("bad sampling settings%s%s", "", "");
  if (rc == 0) {
    ekv_model_info info;
    ekv_model_get_info(model, &info);
    r.block = (size_t)info.block;
    r.out_cap = (size_t)o.max_new;
    r.out_ids = malloc(sizeof(int32_t) * (r.out_cap + 1));
    ekv_session_allow_beyond_context(s, o.allow_beyond);
    g_session = s;
    signal(SIGINT, on_sigint);
    if (!o.quiet)
      fprintf(stderr, "edgekv-run: %s, policy %s, N = %d, B = %d, %d threads; prompt %zu tokens\n", info.model_id,
              info.policy, info.budget, info.block, info.threads, n);
    size_t n_out = 0;
    ekv_status st = EKV_OK;
    if (o.warmup) { /* caches, arena and weight pages touched once; timings start after */
      double t0 = now_seconds();
      st = ekv_session_prefill(s, ids, n < (size_t)info.block ? n : (size_t)info.block, NULL, NULL);
      r.cold_first_block = now_seconds() - t0;
      ekv_session_reset(s);
    }
    if (o.ignore_eos) ekv_session_set_stop_ids(s, NULL, 0);
    if (st == EKV_OK && (o.n_questions > 0 || o.save_cache != NULL || o.load_cache != NULL))
      st = run_document(&o, model, s, sampler, ids, n, &r);
    else if (st == EKV_OK)
      st = ekv_session_generate(s, ids, n, o.max_new, sampler, on_progress, on_token, &r, NULL, 0, &n_out);
    if (r.text_len > 0) fputc('\n', stdout);
    const char *err = st == EKV_OK ? NULL : ekv_session_last_error(s);
    if (st == EKV_OK && !o.quiet) { /* the run in one line, as `edgekv run` prints its table */
      ekv_stats sum;
      ekv_session_get_stats(s, &sum);
      fprintf(stderr, "edgekv-run: load %.2f s; prefill %llu tokens, %.1f tok/s; decode %llu tokens, %.1f tok/s; "
              "memory plan %.1f MiB (KV cache %.1f MiB), peak RSS %.1f MiB; threads %d\n", sum.load_seconds,
              (unsigned long long)sum.prefill_tokens,
              sum.prefill_seconds > 0 ? (double)sum.prefill_tokens / sum.prefill_seconds : 0.0,
              (unsigned long long)sum.decode_tokens,
              sum.decode_seconds > 0 ? (double)sum.decode_tokens / sum.decode_seconds : 0.0,
              (double)info.plan_bytes / 1048576.0, (double)info.cache_bytes / 1048576.0,
              (double)sum.peak_rss_bytes / 1048576.0, info.threads);
    }
    if (o.report != NULL) write_report(&o, model, s, &r, n, st == EKV_OK ? "ok" : ekv_status_string(st), err);
    if (st == EKV_ERR_CANCELLED) {
      fprintf(stderr, "edgekv-run: %s\n", err);
      rc = 130;
    }
    else if (st != EKV_OK) rc = r.reported ? 2 : fail("%s%s", err, "");
    g_session = NULL;
  }
  free(r.out_ids);
  free(r.text);
  free(r.loaded_question);
  free(r.loaded_made_from);
  for (int i = 0; i < r.n_answers; i++) {
    free(r.answers[i].text);
    free(r.answers[i].ids);
  }
  free(ids);
  ekv_sampler_free(sampler);
  ekv_session_free(s);
  ekv_model_close(model);
  return rc;
}
