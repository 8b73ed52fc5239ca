/* emutls.c — emulated thread-local storage for the freestanding Android build of the runtime.
 *
 * The runtime has _Thread_local variables (a kernel's error message, the current thread pool).
 * For Android below API 29 the compilers emit no ELF TLS (bionic's linker loads it only from
 * Android 10) but "emulated TLS": every access becomes a call of __emutls_get_address(&control),
 * one control record per variable. The NDK links an implementation from its compiler-rt; Debian's
 * clang has none for Android, so android/build.sh links this one into libedgekv_runtime.so, which
 * lets the app run from API 24. It is hidden: the library's own variables go through it, and it
 * never interposes on another library's.
 *
 * The control record is the layout clang and gcc emit: size, alignment, a word the
 * implementation owns (here: 0 until first use, then 1 + the variable's slot number), and the
 * initial bytes (NULL: zeros). Each thread keeps an array of slots in a pthread key, allocated
 * on its first access and freed, with every variable, when the thread exits. There is no way to
 * report an error from a variable access, so running out of memory here aborts (as compiler-rt
 * does); it takes a few hundred bytes per thread. */
#define _POSIX_C_SOURCE 200112L /* posix_memalign under -std=c11 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct emutls_control {
  size_t size;
  size_t align;
  uintptr_t index;
  const void *init;
} emutls_control;

typedef struct emutls_slots {
  size_t n;
  void *slot[];
} emutls_slots;

static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static pthread_key_t key;
static int key_made;
static pthread_mutex_t index_lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t n_variables;

static void free_slots(void *p) {
  emutls_slots *s = p;
  for (size_t i = 0; i < s->n; i++) free(s->slot[i]);
  free(s);
}

static void make_key(void) { key_made = pthread_key_create(&key, free_slots) == 0; }

__attribute__((visibility("hidden"))) void *__emutls_get_address(emutls_control *c);

void *__emutls_get_address(emutls_control *c) {
  uintptr_t index = __atomic_load_n(&c->index, __ATOMIC_ACQUIRE);
  if (index == 0) { /* first access of this variable in any thread: give it a slot number */
    pthread_once(&key_once, make_key);
    pthread_mutex_lock(&index_lock);
    index = c->index;
    if (index == 0) {
      index = ++n_variables;
      __atomic_store_n(&c->index, index, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&index_lock);
  }
  if (!key_made) abort();
  emutls_slots *s = pthread_getspecific(key);
  if (s == NULL || s->n < index) { /* this thread's first access, or a variable numbered since */
    size_t old = s != NULL ? s->n : 0, n = index + 8;
    emutls_slots *grown = realloc(s, sizeof *grown + n * sizeof(void *));
    if (grown == NULL) abort();
    memset(&grown->slot[old], 0, (n - old) * sizeof(void *));
    grown->n = n;
    if (pthread_setspecific(key, grown) != 0) abort();
    s = grown;
  }
  void **slot = &s->slot[index - 1];
  if (*slot == NULL) {
    size_t align = c->align > sizeof(void *) ? c->align : sizeof(void *);
    void *p = NULL;
    if (posix_memalign(&p, align, c->size > 0 ? c->size : 1) != 0) abort();
    if (c->init != NULL) memcpy(p, c->init, c->size);
    else memset(p, 0, c->size);
    *slot = p;
  }
  return *slot;
}
