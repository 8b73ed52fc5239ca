#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#include "alloc.h"

/* spins before a worker sleeps / the caller yields: a few microseconds, enough to catch the
 * next kernel's parallel loop without burning a time slice on a loaded machine */
#define SPIN_ROUNDS 20000
#define YIELD_AFTER 2000

struct ekv_threadpool {
  int threads; /* including the caller */
  pthread_t *workers;
  pthread_mutex_t lock;
  pthread_cond_t wake;
  _Atomic unsigned long generation;
  _Atomic int sleepers;
  _Atomic int remaining;
  _Atomic int failed;
  _Atomic int stop;
  /* the current job */
  ekv_task_fn fn;
  void *ctx;
  int n_tasks;
};

typedef struct {
  ekv_threadpool *pool;
  int index;
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

int ekv_online_cores(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

static void run_share(ekv_threadpool *pool, int index) {
  for (int t = index; t < pool->n_tasks; t += pool->threads)
    if (pool->fn(t, pool->n_tasks, pool->ctx) != 0) atomic_store(&pool->failed, 1);
}

static void *worker_main(void *p) {
  worker_arg *arg = p;
  ekv_threadpool *pool = arg->pool;
  int index = arg->index;
  ekv_free(arg);
  unsigned long seen = 0; /* workers start before the first job: generation 0 is "no job yet" */
  for (;;) {
    unsigned long now = seen;
    for (int i = 0; i < SPIN_ROUNDS && (now = atomic_load(&pool->generation)) == seen; i++) cpu_relax();
    if (now == seen) {
      pthread_mutex_lock(&pool->lock);
      atomic_fetch_add(&pool->sleepers, 1);
      while ((now = atomic_load(&pool->generation)) == seen && !atomic_load(&pool->stop))
        pthread_cond_wait(&pool->wake, &pool->lock);
      atomic_fetch_sub(&pool->sleepers, 1);
      pthread_mutex_unlock(&pool->lock);
    }
    if (atomic_load(&pool->stop)) return NULL;
    seen = now;
    run_share(pool, index);
    atomic_fetch_sub(&pool->remaining, 1);
  }
}

ekv_status ekv_threadpool_new(ekv_error *err, int threads, ekv_threadpool **out) {
  *out = NULL;
  if (threads <= 0) threads = ekv_online_cores();
  ekv_threadpool *pool = ekv_alloc(sizeof *pool, EKV_MEM_RUNTIME);
  if (pool == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate the thread pool");
  pool->threads = threads;
  pthread_mutex_init(&pool->lock, NULL);
  pthread_cond_init(&pool->wake, NULL);
  if (threads > 1) {
    pool->workers = ekv_alloc(sizeof(pthread_t) * (size_t)(threads - 1), EKV_MEM_RUNTIME);
    if (pool->workers == NULL) {
      ekv_threadpool_free(pool);
      return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate the thread pool");
    }
    for (int i = 1; i < threads; i++) {
      worker_arg *arg = ekv_alloc(sizeof *arg, EKV_MEM_RUNTIME);
      if (arg == NULL) {
        pool->threads = i;
        ekv_threadpool_free(pool);
        return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate the thread pool");
      }
      arg->pool = pool;
      arg->index = i;
      if (pthread_create(&pool->workers[i - 1], NULL, worker_main, arg) != 0) {
        ekv_free(arg);
        pool->threads = i; /* join the ones that started */
        ekv_threadpool_free(pool);
        return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot start worker thread %d of %d", i, threads);
      }
    }
  }
  *out = pool;
  return EKV_OK;
}

void ekv_threadpool_free(ekv_threadpool *pool) {
  if (pool == NULL) return;
  pthread_mutex_lock(&pool->lock);
  atomic_store(&pool->stop, 1);
  atomic_fetch_add(&pool->generation, 1);
  pthread_cond_broadcast(&pool->wake);
  pthread_mutex_unlock(&pool->lock);
  for (int i = 1; i < pool->threads; i++) pthread_join(pool->workers[i - 1], NULL);
  pthread_mutex_destroy(&pool->lock);
  pthread_cond_destroy(&pool->wake);
  ekv_free(pool->workers);
  ekv_free(pool);
}

int ekv_threadpool_size(const ekv_threadpool *pool) { return pool->threads; }

int ekv_threadpool_run(ekv_threadpool *pool, int n_tasks, ekv_task_fn fn, void *ctx) {
  if (n_tasks <= 0) n_tasks = pool->threads;
  atomic_store(&pool->failed, 0);
  if (pool->threads == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; t++)
      if (fn(t, n_tasks, ctx) != 0) atomic_store(&pool->failed, 1);
    return atomic_load(&pool->failed);
  }
  pool->fn = fn;
  pool->ctx = ctx;
  pool->n_tasks = n_tasks;
  atomic_store(&pool->remaining, pool->threads - 1);
  atomic_fetch_add(&pool->generation, 1); /* publishes the job (seq_cst) */
  if (atomic_load(&pool->sleepers) > 0) {
    pthread_mutex_lock(&pool->lock);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
  }
  run_share(pool, 0);
  for (int i = 0; atomic_load(&pool->remaining) > 0; i++) {
    if (i < YIELD_AFTER) cpu_relax();
    else sched_yield();
  }
  return atomic_load(&pool->failed);
}
