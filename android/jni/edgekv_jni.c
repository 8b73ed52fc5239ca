/* edgekv_jni.c — the Java bridge to libedgekv_runtime (class com.edgekv.demo.EdgeKv).
 *
 * Thin on purpose: each native method is one runtime call plus the conversions Java needs. The
 * engine stays native; the app's logic (which document is open, when to save or load its cache,
 * the memory check) is Java (Engine.java). Handles are the runtime's pointers as jlong.
 *
 * Errors: a failing call throws com.edgekv.demo.EdgeKvException(status, message) with the
 * runtime's per-handle message; nothing here aborts or prints.
 *
 * Text: Java strings are UTF-16. The runtime takes and gives standard UTF-8, which JNI's *UTF
 * functions do not speak: they use "modified UTF-8" (a character outside the BMP is two 3-byte
 * surrogates, NUL is 0xC0 0x80), and NewStringUTF with 4-byte sequences (any emoji) aborts a
 * debuggable app under CheckJNI. So text crosses as UTF-16 (GetStringRegion / NewString) and is
 * converted here. Generated text arrives from ekv_session_generate already cut at character
 * boundaries (it holds incomplete sequences back with ekv_utf8_stream); prefill never produces
 * text.
 *
 * Callbacks run on the thread that called prefill/generate (the runtime calls progress and
 * on_token from the caller's thread, never from its kernel workers), so the JNIEnv is valid.
 * Each callback's local references are deleted at once: a long generation would otherwise
 * overflow the local reference table. A callback that throws stops the work; the exception
 * propagates to the Java caller. */
#include <jni.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "edgekv.h"

#define CLASS_EXCEPTION "com/edgekv/demo/EdgeKvException"

/* ---- helpers --------------------------------------------------------------------------------- */

static jstring new_string(JNIEnv *env, const char *utf8, size_t len);

/* Throw EdgeKvException(status, message); the message is the runtime's UTF-8 (file paths in it
 * may hold any character). */
static void throw_status(JNIEnv *env, ekv_status st, const char *message) {
  if ((*env)->ExceptionCheck(env)) return;
  jclass cls = (*env)->FindClass(env, CLASS_EXCEPTION);
  if (cls == NULL) return; /* NoClassDefFoundError is pending */
  jmethodID ctor = (*env)->GetMethodID(env, cls, "<init>", "(ILjava/lang/String;)V");
  const char *text = message != NULL && message[0] != '\0' ? message : ekv_status_string(st);
  jstring m = ctor != NULL ? new_string(env, text, strlen(text)) : NULL;
  if (m != NULL) {
    jobject ex = (*env)->NewObject(env, cls, ctor, (jint)st, m);
    if (ex != NULL) (*env)->Throw(env, (jthrowable)ex);
    (*env)->DeleteLocalRef(env, ex);
    (*env)->DeleteLocalRef(env, m);
  }
  (*env)->DeleteLocalRef(env, cls);
}

static void throw_simple(JNIEnv *env, const char *cls_name, const char *message) {
  if ((*env)->ExceptionCheck(env)) return;
  jclass cls = (*env)->FindClass(env, cls_name);
  if (cls != NULL) (*env)->ThrowNew(env, cls, message);
  (*env)->DeleteLocalRef(env, cls);
}

static int require_handle(JNIEnv *env, jlong handle, const char *what) {
  if (handle != 0) return 1;
  throw_simple(env, "java/lang/IllegalStateException", what);
  return 0;
}

/* UTF-8 → UTF-16 (invalid or truncated sequences become U+FFFD, as the runtime does) → jstring. */
static jstring new_string(JNIEnv *env, const char *utf8, size_t len) {
  const unsigned char *s = (const unsigned char *)utf8;
  jchar stack[256] = {0};
  jchar *out = len <= sizeof stack / sizeof stack[0] ? stack : malloc(len * sizeof(jchar));
  if (out == NULL) {
    throw_simple(env, "java/lang/OutOfMemoryError", "edgekv: text too long to convert");
    return NULL;
  }
  size_t n = 0;
  for (size_t i = 0; i < len;) {
    uint32_t c = s[i], need = 0, min = 0;
    if (c < 0x80) need = 0;
    else if ((c & 0xE0) == 0xC0) need = 1, c &= 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0) need = 2, c &= 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0) need = 3, c &= 0x07, min = 0x10000;
    else { /* a continuation byte or 0xF8..0xFF where a character starts */
      out[n++] = 0xFFFD;
      i++;
      continue;
    }
    size_t k = 1;
    for (; k <= need && i + k < len && (s[i + k] & 0xC0) == 0x80; k++) c = (c << 6) | (s[i + k] & 0x3F);
    if (k <= need || c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
      out[n++] = 0xFFFD; /* one replacement for the bad prefix, then go on after it */
      i += k;
      continue;
    }
    i += k;
    if (c >= 0x10000) { /* 4 bytes in, 2 units out: still within len units */
      c -= 0x10000;
      out[n++] = (jchar)(0xD800 + (c >> 10));
      out[n++] = (jchar)(0xDC00 + (c & 0x3FF));
    } else {
      out[n++] = (jchar)c;
    }
  }
  jstring str = (*env)->NewString(env, out, (jsize)n);
  if (out != stack) free(out);
  return str;
}

/* jstring → UTF-16 → malloc'ed, NUL-terminated UTF-8 (*len bytes; an unpaired surrogate becomes
 * U+FFFD). NULL with an exception pending on failure. */
static char *utf8_of(JNIEnv *env, jstring str, size_t *len) {
  if (str == NULL) {
    throw_simple(env, "java/lang/NullPointerException", "edgekv: null string");
    return NULL;
  }
  jsize units = (*env)->GetStringLength(env, str);
  jchar *u = malloc(((size_t)units + 1) * sizeof(jchar));
  char *out = malloc((size_t)units * 3 + 1); /* a unit is at most 3 bytes; a pair 4 for 2 units */
  if (u == NULL || out == NULL) {
    free(u);
    free(out);
    throw_simple(env, "java/lang/OutOfMemoryError", "edgekv: text too long to convert");
    return NULL;
  }
  (*env)->GetStringRegion(env, str, 0, units, u);
  size_t n = 0;
  for (jsize i = 0; i < units; i++) {
    uint32_t c = u[i];
    if (c >= 0xD800 && c <= 0xDBFF && i + 1 < units && u[i + 1] >= 0xDC00 && u[i + 1] <= 0xDFFF) {
      c = 0x10000 + ((c - 0xD800) << 10) + (u[i + 1] - 0xDC00u);
      i++;
    } else if (c >= 0xD800 && c <= 0xDFFF) {
      c = 0xFFFD;
    }
    if (c < 0x80) {
      out[n++] = (char)c;
    } else if (c < 0x800) {
      out[n++] = (char)(0xC0 | (c >> 6));
      out[n++] = (char)(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out[n++] = (char)(0xE0 | (c >> 12));
      out[n++] = (char)(0x80 | ((c >> 6) & 0x3F));
      out[n++] = (char)(0x80 | (c & 0x3F));
    } else {
      out[n++] = (char)(0xF0 | (c >> 18));
      out[n++] = (char)(0x80 | ((c >> 12) & 0x3F));
      out[n++] = (char)(0x80 | ((c >> 6) & 0x3F));
      out[n++] = (char)(0x80 | (c & 0x3F));
    }
  }
  out[n] = '\0';
  free(u);
  *len = n;
  return out;
}

static int32_t *ids_of(JNIEnv *env, jintArray ids, size_t *n) {
  if (ids == NULL) {
    throw_simple(env, "java/lang/NullPointerException", "edgekv: null token array");
    return NULL;
  }
  jsize count = (*env)->GetArrayLength(env, ids);
  int32_t *out = malloc(((size_t)count + 1) * sizeof(int32_t));
  if (out == NULL) {
    throw_simple(env, "java/lang/OutOfMemoryError", "edgekv: token array");
    return NULL;
  }
  (*env)->GetIntArrayRegion(env, ids, 0, count, (jint *)out);
  *n = (size_t)count;
  return out;
}

static jintArray int_array(JNIEnv *env, const int32_t *ids, size_t n) {
  jintArray arr = (*env)->NewIntArray(env, (jsize)n);
  if (arr != NULL && n > 0) (*env)->SetIntArrayRegion(env, arr, 0, (jsize)n, (const jint *)ids);
  return arr;
}

/* Field setters for the plain Java holders (ModelInfo, Stats, SnapshotInfo): by name, so the
 * Java classes document themselves and a renamed field fails loudly (NoSuchFieldError). */
static void set_long(JNIEnv *env, jobject obj, jclass cls, const char *name, uint64_t v) {
  jfieldID f = (*env)->GetFieldID(env, cls, name, "J");
  if (f != NULL) (*env)->SetLongField(env, obj, f, (jlong)v);
}
static void set_int(JNIEnv *env, jobject obj, jclass cls, const char *name, int32_t v) {
  jfieldID f = (*env)->GetFieldID(env, cls, name, "I");
  if (f != NULL) (*env)->SetIntField(env, obj, f, (jint)v);
}
static void set_double(JNIEnv *env, jobject obj, jclass cls, const char *name, double v) {
  jfieldID f = (*env)->GetFieldID(env, cls, name, "D");
  if (f != NULL) (*env)->SetDoubleField(env, obj, f, (jdouble)v);
}
static void set_bool(JNIEnv *env, jobject obj, jclass cls, const char *name, int v) {
  jfieldID f = (*env)->GetFieldID(env, cls, name, "Z");
  if (f != NULL) (*env)->SetBooleanField(env, obj, f, v ? JNI_TRUE : JNI_FALSE);
}
static void set_string(JNIEnv *env, jobject obj, jclass cls, const char *name, const char *v) {
  if ((*env)->ExceptionCheck(env)) return;
  jfieldID f = (*env)->GetFieldID(env, cls, name, "Ljava/lang/String;");
  if (f == NULL) return;
  jstring s = v != NULL ? new_string(env, v, strlen(v)) : NULL;
  if (!(*env)->ExceptionCheck(env)) (*env)->SetObjectField(env, obj, f, s);
  if (s != NULL) (*env)->DeleteLocalRef(env, s);
}

/* ---- callbacks ------------------------------------------------------------------------------- */

typedef struct {
  JNIEnv *env;
  jobject progress; /* EdgeKv.Progress or NULL */
  jobject tokens;   /* EdgeKv.Tokens or NULL */
  jmethodID on_block, on_token;
} callbacks;

static int init_callbacks(JNIEnv *env, callbacks *cb, jobject progress, jobject tokens) {
  memset(cb, 0, sizeof *cb);
  cb->env = env;
  cb->progress = progress;
  cb->tokens = tokens;
  if (progress != NULL) {
    jclass c = (*env)->GetObjectClass(env, progress);
    cb->on_block = (*env)->GetMethodID(env, c, "onBlock", "(JJ)Z");
    (*env)->DeleteLocalRef(env, c);
    if (cb->on_block == NULL) return 0;
  }
  if (tokens != NULL) {
    jclass c = (*env)->GetObjectClass(env, tokens);
    cb->on_token = (*env)->GetMethodID(env, c, "onToken", "(ILjava/lang/String;)Z");
    (*env)->DeleteLocalRef(env, c);
    if (cb->on_token == NULL) return 0;
  }
  return 1;
}

static int on_progress(void *user, size_t done, size_t total) {
  callbacks *cb = user;
  if (cb->progress == NULL) return 0;
  jboolean stop = (*cb->env)->CallBooleanMethod(cb->env, cb->progress, cb->on_block, (jlong)done, (jlong)total);
  return stop || (*cb->env)->ExceptionCheck(cb->env);
}

static int on_token(void *user, int32_t id, const char *text, size_t len) {
  callbacks *cb = user;
  if (cb->tokens == NULL) return 0;
  JNIEnv *env = cb->env;
  jstring s = new_string(env, text, len);
  if (s == NULL) return 1; /* OutOfMemoryError pending */
  jboolean stop = (*env)->CallBooleanMethod(env, cb->tokens, cb->on_token, (jint)id, s);
  (*env)->DeleteLocalRef(env, s);
  return stop || (*env)->ExceptionCheck(env);
}

/* ---- the native methods of com.edgekv.demo.EdgeKv ------------------------------------------ */

#define FN(name) JNICALL Java_com_edgekv_demo_EdgeKv_##name
#define MODEL(h) ((ekv_model *)(intptr_t)(h))
#define SESSION(h) ((ekv_session *)(intptr_t)(h))

JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM *vm, void *reserved) {
  (void)vm;
  (void)reserved;
  return JNI_VERSION_1_6;
}

JNIEXPORT jstring FN(runtimeDevices)(JNIEnv *env, jclass cls) {
  (void)cls;
  const char *d = ekv_runtime_devices();
  return new_string(env, d, strlen(d));
}

JNIEXPORT jstring FN(statusName)(JNIEnv *env, jclass cls, jint status) {
  (void)cls;
  const char *s = ekv_status_string((ekv_status)status);
  return new_string(env, s, strlen(s));
}

/* Open an artifact directory. mem_limit: refuse (EKV_ERR_NO_MEMORY) before allocating when the
 * program's plan is above it (0 = no limit). Throws with the runtime's message on failure. */
JNIEXPORT jlong FN(modelOpen)(JNIEnv *env, jclass cls, jstring dir, jint threads, jlong mem_limit) {
  (void)cls;
  size_t len;
  char *path = utf8_of(env, dir, &len);
  if (path == NULL) return 0;
  ekv_model_options opts;
  ekv_model_options_init(&opts);
  opts.threads = threads > 0 ? threads : 0;
  opts.mem_limit_bytes = mem_limit > 0 ? (uint64_t)mem_limit : 0;
  ekv_model *m = NULL;
  ekv_status st = ekv_model_open(path, &opts, &m);
  free(path);
  if (st != EKV_OK) {
    throw_status(env, st, m != NULL ? ekv_model_last_error(m) : NULL);
    ekv_model_close(m);
    return 0;
  }
  return (jlong)(intptr_t)m;
}

JNIEXPORT void FN(modelClose)(JNIEnv *env, jclass cls, jlong model) {
  (void)env;
  (void)cls;
  ekv_model_close(MODEL(model));
}

JNIEXPORT jstring FN(modelLastError)(JNIEnv *env, jclass cls, jlong model) {
  (void)cls;
  if (!require_handle(env, model, "edgekv: no model")) return NULL;
  const char *e = ekv_model_last_error(MODEL(model));
  return new_string(env, e != NULL ? e : "", e != NULL ? strlen(e) : 0);
}

JNIEXPORT void FN(modelInfo)(JNIEnv *env, jclass cls, jlong model, jobject out) {
  (void)cls;
  if (!require_handle(env, model, "edgekv: no model")) return;
  ekv_model_info i;
  ekv_model_get_info(MODEL(model), &i);
  jclass c = (*env)->GetObjectClass(env, out);
  set_string(env, out, c, "modelId", i.model_id);
  set_string(env, out, c, "policy", i.policy);
  set_string(env, out, c, "policyParams", i.policy_params);
  set_string(env, out, c, "targetProfile", i.target_profile);
  set_string(env, out, c, "targetArch", i.target_arch);
  set_string(env, out, c, "edgekvVersion", i.edgekv_version);
  set_string(env, out, c, "weightHash", i.weight_hash);
  set_string(env, out, c, "device", i.device);
  set_int(env, out, c, "numLayers", i.num_layers);
  set_int(env, out, c, "vocabSize", i.vocab_size);
  set_int(env, out, c, "maxPosition", i.max_position);
  set_int(env, out, c, "budget", i.budget);
  set_int(env, out, c, "block", i.block);
  set_int(env, out, c, "pseudoRows", i.pseudo_rows);
  set_int(env, out, c, "questionRows", ekv_model_question_rows(MODEL(model)));
  set_int(env, out, c, "threads", i.threads);
  set_bool(env, out, c, "chat", i.chat);
  set_long(env, out, c, "weightsBytes", i.weights_bytes);
  set_long(env, out, c, "cacheBytes", i.cache_bytes);
  set_long(env, out, c, "arenaBytes", i.arena_bytes);
  set_long(env, out, c, "planBytes", i.plan_bytes);
  set_int(env, out, c, "kernels", i.n_kernels);
  (*env)->DeleteLocalRef(env, c);
}

JNIEXPORT jlong FN(sessionNew)(JNIEnv *env, jclass cls, jlong model) {
  (void)cls;
  if (!require_handle(env, model, "edgekv: no model")) return 0;
  ekv_session *s = NULL;
  ekv_status st = ekv_session_new(MODEL(model), &s);
  if (st != EKV_OK) {
    throw_status(env, st, s != NULL ? ekv_session_last_error(s) : ekv_model_last_error(MODEL(model)));
    ekv_session_free(s);
    return 0;
  }
  return (jlong)(intptr_t)s;
}

JNIEXPORT void FN(sessionFree)(JNIEnv *env, jclass cls, jlong session) {
  (void)env;
  (void)cls;
  ekv_session_free(SESSION(session));
}

JNIEXPORT void FN(sessionReset)(JNIEnv *env, jclass cls, jlong session) {
  (void)cls;
  if (require_handle(env, session, "edgekv: no session")) ekv_session_reset(SESSION(session));
}

JNIEXPORT jstring FN(sessionLastError)(JNIEnv *env, jclass cls, jlong session) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return NULL;
  const char *e = ekv_session_last_error(SESSION(session));
  return new_string(env, e != NULL ? e : "", e != NULL ? strlen(e) : 0);
}

JNIEXPORT jlong FN(position)(JNIEnv *env, jclass cls, jlong session) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return 0;
  return (jlong)ekv_session_position(SESSION(session));
}

/* Any thread: the running prefill or generation stops at the next block or token. */
JNIEXPORT void FN(cancel)(JNIEnv *env, jclass cls, jlong session) {
  (void)env;
  (void)cls;
  ekv_session_cancel(SESSION(session));
}

/* Token ids of `text` as one part of a document + question prompt (EKV_PART_*), in the chat
 * template's form when `chat`. */
JNIEXPORT jintArray FN(encode)(JNIEnv *env, jclass cls, jlong model, jstring text, jboolean chat, jint part) {
  (void)cls;
  if (!require_handle(env, model, "edgekv: no model")) return NULL;
  ekv_tokenizer *tok = ekv_model_tokenizer(MODEL(model));
  if (tok == NULL) {
    throw_status(env, EKV_ERR_INVALID_ARG, "this artifact has no tokenizer (tokenizer.ekt): recompile it from a "
                 "model with a byte-level BPE tokenizer");
    return NULL;
  }
  if (part < EKV_PART_WHOLE || part > EKV_PART_QUESTION) {
    throw_simple(env, "java/lang/IllegalArgumentException", "edgekv: part must be 0, 1 or 2");
    return NULL;
  }
  size_t len, n = 0;
  char *utf8 = utf8_of(env, text, &len);
  if (utf8 == NULL) return NULL;
  ekv_status st = ekv_tokenizer_encode_part(tok, utf8, len, chat ? 1 : 0, (ekv_text_part)part, NULL, 0, &n);
  int32_t *ids = st == EKV_OK ? malloc((n + 1) * sizeof(int32_t)) : NULL;
  if (st == EKV_OK && ids == NULL) st = EKV_ERR_NO_MEMORY;
  if (st == EKV_OK) st = ekv_tokenizer_encode_part(tok, utf8, len, chat ? 1 : 0, (ekv_text_part)part, ids, n, &n);
  free(utf8);
  jintArray out = NULL;
  if (st == EKV_OK) out = int_array(env, ids, n);
  else throw_status(env, st, ekv_tokenizer_last_error(tok));
  free(ids);
  return out;
}

JNIEXPORT void FN(prefill)(JNIEnv *env, jclass cls, jlong session, jintArray ids, jobject progress) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return;
  callbacks cb;
  if (!init_callbacks(env, &cb, progress, NULL)) return;
  size_t n;
  int32_t *p = ids_of(env, ids, &n);
  if (p == NULL) return;
  ekv_status st = ekv_session_prefill(SESSION(session), p, n, on_progress, &cb);
  free(p);
  if (st != EKV_OK) throw_status(env, st, ekv_session_last_error(SESSION(session)));
}

/* The question whose rows score every prefill block that follows (artifacts compiled with
 * --question-rows); null or empty clears it. The runtime refuses one longer than the rows. */
JNIEXPORT void FN(setQuestion)(JNIEnv *env, jclass cls, jlong session, jintArray ids) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return;
  size_t n = 0;
  int32_t *p = NULL;
  if (ids != NULL && (*env)->GetArrayLength(env, ids) > 0) {
    p = ids_of(env, ids, &n);
    if (p == NULL) return;
  }
  ekv_status st = ekv_session_set_question(SESSION(session), p, n);
  free(p);
  if (st != EKV_OK) throw_status(env, st, ekv_session_last_error(SESSION(session)));
}

/* One decode step (the token at the next position); then `greedy` reads the next token. */
JNIEXPORT void FN(decode)(JNIEnv *env, jclass cls, jlong session, jint token) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return;
  ekv_status st = ekv_session_decode(SESSION(session), (int32_t)token);
  if (st != EKV_OK) throw_status(env, st, ekv_session_last_error(SESSION(session)));
}

/* The argmax of the last step's logits (lowest id on ties, like the runtime's greedy sampler). */
JNIEXPORT jint FN(greedy)(JNIEnv *env, jclass cls, jlong session, jlong model) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session") || !require_handle(env, model, "edgekv: no model")) return -1;
  const float *logits = ekv_session_logits(SESSION(session));
  if (logits == NULL) {
    throw_status(env, EKV_ERR_INVALID_ARG, "no logits yet: prefill or decode first");
    return -1;
  }
  ekv_model_info info;
  ekv_model_get_info(MODEL(model), &info);
  int32_t best = 0;
  for (int32_t i = 1; i < info.vocab_size; i++)
    if (logits[i] > logits[best]) best = i;
  return best;
}

/* Prefill `prompt` (continuing the sequence), then sample up to max_new tokens, streaming each
 * token's text to `tokens`. Returns the generated ids (a stop id ends it and is included). */
JNIEXPORT jintArray FN(generate)(JNIEnv *env, jclass cls, jlong session, jintArray prompt, jint max_new,
                                 jfloat temperature, jfloat top_p, jlong seed, jobject progress, jobject tokens) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return NULL;
  if (max_new < 0) {
    throw_simple(env, "java/lang/IllegalArgumentException", "edgekv: maxNewTokens must be 0 or more");
    return NULL;
  }
  callbacks cb;
  if (!init_callbacks(env, &cb, progress, tokens)) return NULL;
  ekv_sampler *sampler = NULL;
  ekv_status st = ekv_sampler_new(temperature, top_p, (uint64_t)seed, &sampler);
  if (st != EKV_OK) {
    ekv_sampler_free(sampler);
    throw_status(env, st, "bad sampling settings: temperature must be >= 0 and top-p in (0, 1]");
    return NULL;
  }
  size_t n, n_out = 0;
  int32_t *p = ids_of(env, prompt, &n);
  int32_t *out = p != NULL ? malloc(((size_t)max_new + 1) * sizeof(int32_t)) : NULL;
  jintArray result = NULL;
  if (p != NULL && out == NULL) throw_simple(env, "java/lang/OutOfMemoryError", "edgekv: output ids");
  if (out != NULL) {
    st = ekv_session_generate(SESSION(session), p, n, max_new, sampler, on_progress, on_token, &cb, out,
                              (size_t)max_new, &n_out);
    if ((*env)->ExceptionCheck(env)) {
      /* a callback threw: that exception goes to the caller */
    } else if (st != EKV_OK) {
      throw_status(env, st, ekv_session_last_error(SESSION(session)));
    } else {
      result = int_array(env, out, n_out < (size_t)max_new ? n_out : (size_t)max_new);
    }
  }
  free(out);
  free(p);
  ekv_sampler_free(sampler);
  return result;
}

JNIEXPORT void FN(stats)(JNIEnv *env, jclass cls, jlong session, jobject out) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return;
  ekv_stats s;
  ekv_session_get_stats(SESSION(session), &s);
  jclass c = (*env)->GetObjectClass(env, out);
  set_long(env, out, c, "prefillTokens", s.prefill_tokens);
  set_long(env, out, c, "prefillBlocks", s.prefill_blocks);
  set_long(env, out, c, "decodeTokens", s.decode_tokens);
  set_double(env, out, c, "prefillSeconds", s.prefill_seconds);
  set_double(env, out, c, "decodeSeconds", s.decode_seconds);
  set_double(env, out, c, "prepareSeconds", s.prepare_seconds);
  set_double(env, out, c, "loadSeconds", s.load_seconds);
  set_double(env, out, c, "firstBlockSeconds", s.first_block_seconds);
  set_long(env, out, c, "runtimeBytesPeak", s.runtime_bytes_peak);
  set_long(env, out, c, "workspaceBytesPeak", s.workspace_bytes_peak);
  set_long(env, out, c, "peakRssBytes", s.peak_rss_bytes);
  set_long(env, out, c, "mappedBytes", s.mapped_bytes);
  set_long(env, out, c, "deviceBytesPeak", s.device_bytes_peak);
  set_long(env, out, c, "position", ekv_session_position(SESSION(session)));
  (*env)->DeleteLocalRef(env, c);
}

/* Save the document's cache (atomically). `question` may be null (the cache knows no question). */
JNIEXPORT void FN(save)(JNIEnv *env, jclass cls, jlong session, jstring path, jstring question, jboolean chat) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return;
  size_t len;
  char *p = utf8_of(env, path, &len);
  if (p == NULL) return;
  char *q = NULL;
  if (question != NULL && (q = utf8_of(env, question, &len)) == NULL) {
    free(p);
    return;
  }
  ekv_status st = ekv_session_save(SESSION(session), p, q, chat ? 1 : 0);
  free(p);
  free(q);
  if (st != EKV_OK) throw_status(env, st, ekv_session_last_error(SESSION(session)));
}

/* Map a saved document cache back (copy-on-write) and continue from it. */
JNIEXPORT void FN(load)(JNIEnv *env, jclass cls, jlong session, jstring path) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return;
  size_t len;
  char *p = utf8_of(env, path, &len);
  if (p == NULL) return;
  ekv_status st = ekv_session_load(SESSION(session), p);
  free(p);
  if (st != EKV_OK) throw_status(env, st, ekv_session_last_error(SESSION(session)));
}

/* What the loaded snapshot records; false when none is loaded. */
JNIEXPORT jboolean FN(snapshotInfo)(JNIEnv *env, jclass cls, jlong session, jobject out) {
  (void)cls;
  if (!require_handle(env, session, "edgekv: no session")) return JNI_FALSE;
  ekv_snapshot_info i;
  if (ekv_session_snapshot_info(SESSION(session), &i) != EKV_OK) return JNI_FALSE;
  jclass c = (*env)->GetObjectClass(env, out);
  set_string(env, out, c, "question", i.question);
  set_string(env, out, c, "madeFrom", i.made_from);
  set_bool(env, out, c, "chat", i.chat);
  set_long(env, out, c, "tokens", i.tokens);
  set_double(env, out, c, "documentSeconds", i.document_seconds);
  (*env)->DeleteLocalRef(env, c);
  return JNI_TRUE;
}
