/* jni_harness.c — the JNI bridge (android/jni/edgekv_jni.c) driven without a JVM, for aarch64 under
 * qemu-user (tests/test_android_app.py, slow): a C program that loads libedgekv_runtime.so and
 * libedgekv_jni.so as an app does (dlopen RTLD_LOCAL, the runtime first: System.loadLibrary), and
 * calls the bridge's Java_* functions with a small JNIEnv of its own, in the order the app's Engine
 * does: open, info, encode the document, prefill it with progress, save its cache, answer the first
 * question; load the cache, answer the second; a cancelled prefill; stats; close.
 *
 *   jni_harness RUNTIME_SO JNI_SO ARTIFACT DOCUMENT_FILE SNAPSHOT MAX_NEW QUESTION1 QUESTION2
 *
 * HARNESS_CHAT=1 in the environment: the document and questions in the model's chat form, as
 * edgekv-run --chat and the app's chat mode (tests/test_android_package.py, the README demo).
 * HARNESS_THREADS=N: the kernels' threads (default 2; 1 under an emulator on a busy machine, where
 * a thread waiting at a barrier costs as much as one working).
 * HARNESS_ANSWERS_ONLY=1: stop after the two answers, without the cancelled prefill and the missing
 * artifact (tools/experiments/check_android_qemu.py on a real model: under qemu the cancel check's
 * second prefill of a one-block document costs minutes and shows nothing the tiny model's does not).
 *
 * Prints one JSON object. The JNIEnv implements only the functions the bridge calls (the others
 * are NULL: calling one crashes, which the test would see). Objects are tagged structs; strings
 * are UTF-16, as in Java. Never shipped. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <dlfcn.h>
#include <jni.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum kind { K_CLASS, K_STRING, K_INTS, K_EXCEPTION, K_HOLDER, K_PROGRESS, K_TOKENS };
typedef struct field {
  char name[40];
  char sig[64];
  int64_t i;
  double d;
  struct object *o;
} field;
typedef struct object {
  enum kind kind;
  char name[80];       /* class: its name; holder: its class */
  jchar *chars;        /* string */
  int32_t *ints;       /* int array */
  jsize n;             /* string length / array length */
  int status;          /* exception */
  struct object *msg;  /* exception message */
  field fields[40];    /* holder */
  int n_fields;
  int cancel_after;    /* progress: return true after this many blocks (0: never) */
  int calls;           /* progress / tokens calls */
  char log[16384];     /* what the callbacks saw */
  size_t log_len;
} object;
typedef struct method {
  char name[32];
  char sig[64];
} method;

static double seconds(void) { /* since the first call */
  static struct timespec start;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (start.tv_sec == 0 && start.tv_nsec == 0) start = now;
  return (double)(now.tv_sec - start.tv_sec) + 1e-9 * (double)(now.tv_nsec - start.tv_nsec);
}

static object *pending;
static method methods[16];
static int n_methods;

static object *new_object(enum kind k, const char *name) {
  object *o = calloc(1, sizeof *o);
  if (o == NULL) abort();
  o->kind = k;
  snprintf(o->name, sizeof o->name, "%s", name != NULL ? name : "");
  return o;
}

static void logf_(object *o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(o->log + o->log_len, sizeof o->log - o->log_len, fmt, ap);
  va_end(ap);
  if (n > 0 && o->log_len + (size_t)n < sizeof o->log) o->log_len += (size_t)n;
}

/* ---- the JNIEnv functions the bridge uses ------------------------------------------------- */
static jclass find_class(JNIEnv *e, const char *name) {
  (void)e;
  return (jclass)new_object(K_CLASS, name);
}
static jclass get_object_class(JNIEnv *e, jobject obj) {
  (void)e;
  return (jclass)new_object(K_CLASS, ((object *)obj)->name);
}
static jmethodID get_method_id(JNIEnv *e, jclass c, const char *name, const char *sig) {
  (void)e;
  (void)c;
  for (int i = 0; i < n_methods; i++)
    if (strcmp(methods[i].name, name) == 0 && strcmp(methods[i].sig, sig) == 0) return (jmethodID)&methods[i];
  method *m = &methods[n_methods++];
  snprintf(m->name, sizeof m->name, "%s", name);
  snprintf(m->sig, sizeof m->sig, "%s", sig);
  return (jmethodID)m;
}
static jfieldID get_field_id(JNIEnv *e, jclass c, const char *name, const char *sig) {
  (void)e;
  (void)c;
  method *m = calloc(1, sizeof *m); /* a field id: name and signature */
  snprintf(m->name, sizeof m->name, "%s", name);
  snprintf(m->sig, sizeof m->sig, "%s", sig);
  return (jfieldID)m;
}
static field *slot(jobject obj, jfieldID id) {
  object *o = (object *)obj;
  method *f = (method *)id;
  for (int i = 0; i < o->n_fields; i++)
    if (strcmp(o->fields[i].name, f->name) == 0) return &o->fields[i];
  field *s = &o->fields[o->n_fields++];
  snprintf(s->name, sizeof s->name, "%s", f->name);
  snprintf(s->sig, sizeof s->sig, "%s", f->sig);
  return s;
}
static void set_long(JNIEnv *e, jobject o, jfieldID f, jlong v) { (void)e; slot(o, f)->i = v; }
static void set_int(JNIEnv *e, jobject o, jfieldID f, jint v) { (void)e; slot(o, f)->i = v; }
static void set_bool(JNIEnv *e, jobject o, jfieldID f, jboolean v) { (void)e; slot(o, f)->i = v; }
static void set_double(JNIEnv *e, jobject o, jfieldID f, jdouble v) { (void)e; slot(o, f)->d = v; }
static void set_object(JNIEnv *e, jobject o, jfieldID f, jobject v) { (void)e; slot(o, f)->o = (object *)v; }

static jstring new_string(JNIEnv *e, const jchar *chars, jsize n) {
  (void)e;
  object *s = new_object(K_STRING, "java/lang/String");
  s->chars = malloc(((size_t)n + 1) * sizeof(jchar));
  if (s->chars == NULL) abort();
  memcpy(s->chars, chars, (size_t)n * sizeof(jchar));
  s->n = n;
  return (jstring)s;
}
static jsize string_length(JNIEnv *e, jstring s) { (void)e; return ((object *)s)->n; }
static void string_region(JNIEnv *e, jstring s, jsize start, jsize len, jchar *buf) {
  (void)e;
  memcpy(buf, ((object *)s)->chars + start, (size_t)len * sizeof(jchar));
}
static jintArray new_int_array(JNIEnv *e, jsize n) {
  (void)e;
  object *a = new_object(K_INTS, "[I");
  a->ints = calloc((size_t)n + 1, sizeof(int32_t));
  a->n = n;
  return (jintArray)a;
}
static jsize array_length(JNIEnv *e, jarray a) { (void)e; return ((object *)a)->n; }
static void get_ints(JNIEnv *e, jintArray a, jsize start, jsize len, jint *buf) {
  (void)e;
  memcpy(buf, ((object *)a)->ints + start, (size_t)len * sizeof(jint));
}
static void set_ints(JNIEnv *e, jintArray a, jsize start, jsize len, const jint *buf) {
  (void)e;
  memcpy(((object *)a)->ints + start, buf, (size_t)len * sizeof(jint));
}
static void delete_local_ref(JNIEnv *e, jobject o) { (void)e; (void)o; }
static jboolean exception_check(JNIEnv *e) { (void)e; return pending != NULL; }
static jint throw_(JNIEnv *e, jthrowable t) { (void)e; pending = (object *)t; return 0; }
static jint throw_new(JNIEnv *e, jclass c, const char *msg) {
  (void)e;
  object *x = new_object(K_EXCEPTION, ((object *)c)->name);
  x->status = -1;
  size_t n = strlen(msg);
  jchar *u = malloc((n + 1) * sizeof(jchar));
  for (size_t i = 0; i < n; i++) u[i] = (unsigned char)msg[i];
  x->msg = (object *)new_string(NULL, u, (jsize)n);
  free(u);
  pending = x;
  return 0;
}
static jobject new_object_v(JNIEnv *e, jclass c, jmethodID ctor, ...) { /* EdgeKvException(int, String) */
  (void)e;
  (void)ctor;
  va_list ap;
  va_start(ap, ctor);
  object *x = new_object(K_EXCEPTION, ((object *)c)->name);
  x->status = va_arg(ap, jint);
  x->msg = va_arg(ap, object *);
  va_end(ap);
  return (jobject)x;
}
static void utf16_json(object *log_to, const jchar *s, jsize n);
static jboolean call_boolean(JNIEnv *e, jobject obj, jmethodID id, ...) {
  (void)e;
  object *o = (object *)obj;
  method *m = (method *)id;
  va_list ap;
  va_start(ap, id);
  jboolean stop = JNI_FALSE;
  o->calls++;
  if (strcmp(m->name, "onBlock") == 0 && strcmp(m->sig, "(JJ)Z") == 0) {
    jlong done = va_arg(ap, jlong), total = va_arg(ap, jlong);
    logf_(o, "%s\"%lld/%lld\"", o->calls > 1 ? "," : "", (long long)done, (long long)total);
    /* live, for a run stopped before the end: how far the prefill got and when */
    fprintf(stderr, "harness: block %lld/%lld tokens at %.1f s\n", (long long)done, (long long)total, seconds());
    stop = o->cancel_after > 0 && o->calls >= o->cancel_after;
  } else if (strcmp(m->name, "onToken") == 0 && strcmp(m->sig, "(ILjava/lang/String;)Z") == 0) {
    jint id_ = va_arg(ap, jint);
    fprintf(stderr, "harness: token %d at %.1f s\n", (int)id_, seconds());
    object *s = va_arg(ap, object *);
    logf_(o, "%s[%d,", o->calls > 1 ? "," : "", (int)id_);
    utf16_json(o, s->chars, s->n);
    logf_(o, "]");
  } else {
    fprintf(stderr, "harness: unexpected method %s%s\n", m->name, m->sig);
    abort();
  }
  va_end(ap);
  return stop;
}

/* text as a JSON array of UTF-16 code units (exactly what Java would hold) */
static void utf16_json(object *to, const jchar *s, jsize n) {
  logf_(to, "[");
  for (jsize i = 0; i < n; i++) logf_(to, "%s%u", i ? "," : "", (unsigned)s[i]);
  logf_(to, "]");
}

static struct JNINativeInterface table;
static JNIEnv env_value = &table;
static JNIEnv *env = &env_value;

static void init_env(void) {
  table.FindClass = find_class;
  table.GetObjectClass = get_object_class;
  table.GetMethodID = get_method_id;
  table.GetFieldID = get_field_id;
  table.SetLongField = set_long;
  table.SetIntField = set_int;
  table.SetBooleanField = set_bool;
  table.SetDoubleField = set_double;
  table.SetObjectField = set_object;
  table.NewString = new_string;
  table.GetStringLength = string_length;
  table.GetStringRegion = string_region;
  table.NewIntArray = new_int_array;
  table.GetArrayLength = array_length;
  table.GetIntArrayRegion = get_ints;
  table.SetIntArrayRegion = set_ints;
  table.DeleteLocalRef = delete_local_ref;
  table.ExceptionCheck = exception_check;
  table.Throw = throw_;
  table.ThrowNew = throw_new;
  table.NewObject = new_object_v;
  table.CallBooleanMethod = call_boolean;
}

/* ---- calling the bridge -------------------------------------------------------------------- */
static void *jni;
static void *fn(const char *name) {
  char sym[128];
  snprintf(sym, sizeof sym, "Java_com_edgekv_demo_EdgeKv_%s", name);
  void *p = dlsym(jni, sym);
  if (p == NULL) {
    printf("{\"error\": \"missing %s\"}\n", sym);
    exit(1);
  }
  return p;
}

static object out_obj; /* the JSON being written */
#define OUT(...) logf_(&out_obj, __VA_ARGS__)

static object *jstr(const char *utf8) { /* ASCII/UTF-8 → UTF-16 (BMP only: enough for the arguments) */
  size_t n = strlen(utf8), k = 0;
  jchar *u = malloc((n + 1) * sizeof(jchar));
  for (size_t i = 0; i < n; i++) {
    unsigned c = (unsigned char)utf8[i];
    if (c >= 0xE0 && i + 2 < n) c = ((c & 0x0F) << 12) | ((utf8[i + 1] & 0x3F) << 6) | (utf8[i + 2] & 0x3F), i += 2;
    else if (c >= 0xC0 && i + 1 < n) c = ((c & 0x1F) << 6) | (utf8[i + 1] & 0x3F), i += 1;
    u[k++] = (jchar)c;
  }
  object *s = (object *)new_string(NULL, u, (jsize)k);
  free(u);
  return s;
}

/* after a bridge call: the pending exception as "status message" into the JSON (or null) */
static int took_exception(const char *key) {
  if (pending == NULL) return 0;
  OUT("\"%s\": [%d, ", key, pending->status);
  utf16_json(&out_obj, pending->msg ? pending->msg->chars : NULL, pending->msg ? pending->msg->n : 0);
  OUT("], ");
  pending = NULL;
  return 1;
}

static void ints_json(const char *key, object *a) {
  OUT("\"%s\": [", key);
  for (jsize i = 0; a != NULL && i < a->n; i++) OUT("%s%d", i ? "," : "", a->ints[i]);
  OUT("], ");
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  return buf;
}

typedef jstring (*str_fn)(JNIEnv *, jclass);
typedef jlong (*open_fn)(JNIEnv *, jclass, jstring, jint, jlong);
typedef void (*handle_fn)(JNIEnv *, jclass, jlong);
typedef void (*fill_fn)(JNIEnv *, jclass, jlong, jobject);
typedef jlong (*new_fn)(JNIEnv *, jclass, jlong);
typedef jintArray (*encode_fn)(JNIEnv *, jclass, jlong, jstring, jboolean, jint);
typedef void (*prefill_fn)(JNIEnv *, jclass, jlong, jintArray, jobject);
typedef jintArray (*generate_fn)(JNIEnv *, jclass, jlong, jintArray, jint, jfloat, jfloat, jlong, jobject, jobject);
typedef void (*save_fn)(JNIEnv *, jclass, jlong, jstring, jstring, jboolean);
typedef void (*load_fn)(JNIEnv *, jclass, jlong, jstring);

int main(int argc, char **argv) {
  if (argc != 9) {
    fprintf(stderr, "usage: jni_harness RUNTIME_SO JNI_SO ARTIFACT DOCUMENT_FILE SNAPSHOT MAX_NEW Q1 Q2\n");
    return 2;
  }
  init_env();
  seconds();
  /* System.loadLibrary("edgekv_runtime"); System.loadLibrary("edgekv_jni"): both RTLD_LOCAL */
  void *rt = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  jni = rt != NULL ? dlopen(argv[2], RTLD_NOW | RTLD_LOCAL) : NULL;
  if (jni == NULL) {
    printf("{\"error\": \"dlopen: %s\"}\n", dlerror());
    return 1;
  }
  jclass cls = find_class(env, "com/edgekv/demo/EdgeKv");
  const char *doc = read_file(argv[4]);
  int max_new = atoi(argv[6]);
  jboolean chat = getenv("HARNESS_CHAT") != NULL && strcmp(getenv("HARNESS_CHAT"), "1") == 0 ? JNI_TRUE : JNI_FALSE;
  OUT("{");
  object *devices = (object *)((str_fn)fn("runtimeDevices"))(env, cls);
  OUT("\"devices\": ");
  utf16_json(&out_obj, devices->chars, devices->n);
  OUT(", ");

  int threads = getenv("HARNESS_THREADS") != NULL ? atoi(getenv("HARNESS_THREADS")) : 2;
  jlong model = ((open_fn)fn("modelOpen"))(env, cls, (jstring)jstr(argv[3]), threads > 0 ? threads : 2, 0);
  if (took_exception("open_error")) {
    OUT("\"end\": 1}");
    printf("%s\n", out_obj.log);
    return 0;
  }
  object *info = new_object(K_HOLDER, "com/edgekv/demo/ModelInfo");
  ((fill_fn)fn("modelInfo"))(env, cls, model, (jobject)info);
  OUT("\"info\": {");
  for (int i = 0; i < info->n_fields; i++) {
    field *f = &info->fields[i];
    OUT("\"%s\": ", f->name);
    if (f->sig[0] == 'L') {
      if (f->o) utf16_json(&out_obj, f->o->chars, f->o->n);
      else OUT("null");
    } else {
      OUT("%lld", (long long)f->i);
    }
    OUT(", ");
  }
  OUT("\"end\": 1}, ");
  jlong session = ((new_fn)fn("sessionNew"))(env, cls, model);
  if (took_exception("session_error")) return 1;

  /* the first question: read the document, save its cache, answer */
  object *docids = (object *)((encode_fn)fn("encode"))(env, cls, model, (jstring)jstr(doc), chat, 1);
  took_exception("encode_error");
  object *progress = new_object(K_PROGRESS, "com/edgekv/demo/HarnessProgress");
  ((prefill_fn)fn("prefill"))(env, cls, session, (jintArray)docids, (jobject)progress);
  took_exception("prefill_error");
  OUT("\"document_tokens\": %d, \"progress\": [%s], ", docids->n, progress->log);
  ((save_fn)fn("save"))(env, cls, session, (jstring)jstr(argv[5]), NULL, chat);
  took_exception("save_error");
  OUT("\"answers\": [");
  for (int q = 0; q < 2; q++) {
    if (q == 1) {
      ((load_fn)fn("load"))(env, cls, session, (jstring)jstr(argv[5]));
      took_exception("load_error");
    }
    object *qids = (object *)((encode_fn)fn("encode"))(env, cls, model, (jstring)jstr(argv[7 + q]), chat, 2);
    object *tokens = new_object(K_TOKENS, "com/edgekv/demo/HarnessTokens");
    object *ids = (object *)((generate_fn)fn("generate"))(env, cls, session, (jintArray)qids, max_new, 0.0f, 1.0f, 0,
                                                           NULL, (jobject)tokens);
    OUT("%s{", q ? ", " : "");
    took_exception("error");
    ints_json("generated_ids", ids);
    object *stats = new_object(K_HOLDER, "com/edgekv/demo/Stats");
    ((fill_fn)fn("stats"))(env, cls, session, (jobject)stats);
    for (int i = 0; i < stats->n_fields; i++)
      if (strcmp(stats->fields[i].sig, "J") == 0) OUT("\"%s\": %lld, ", stats->fields[i].name, (long long)stats->fields[i].i);
    OUT("\"tokens\": [%s]}", tokens->log);
  }
  OUT("], ");
  if (getenv("HARNESS_ANSWERS_ONLY") != NULL && strcmp(getenv("HARNESS_ANSWERS_ONLY"), "1") == 0) {
    ((handle_fn)fn("sessionFree"))(env, cls, session);
    ((handle_fn)fn("modelClose"))(env, cls, model);
    OUT("\"end\": 1}");
    printf("%s\n", out_obj.log);
    return 0;
  }

  /* a prefill cancelled from its progress callback after two blocks */
  ((handle_fn)fn("sessionReset"))(env, cls, session);
  object *stop = new_object(K_PROGRESS, "com/edgekv/demo/HarnessProgress");
  stop->cancel_after = 2;
  ((prefill_fn)fn("prefill"))(env, cls, session, (jintArray)docids, (jobject)stop);
  if (!took_exception("cancelled")) OUT("\"cancelled\": null, ");
  OUT("\"cancel_progress_calls\": %d, ", stop->calls);
  /* a bad artifact path: an exception, not a crash */
  ((open_fn)fn("modelOpen"))(env, cls, (jstring)jstr("/nonexistent/artifact"), 1, 0);
  if (!took_exception("missing")) OUT("\"missing\": null, ");

  ((handle_fn)fn("sessionFree"))(env, cls, session);
  ((handle_fn)fn("modelClose"))(env, cls, model);
  OUT("\"end\": 1}");
  printf("%s\n", out_obj.log);
  return 0;
}
