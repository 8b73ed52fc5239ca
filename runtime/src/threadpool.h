/* A small pthread pool for TVM's parallel loops. The caller runs task 0; workers spin briefly
 * for the next job, then sleep on a condition variable, so an oversubscribed machine is not
 * burnt by spinning threads. */
#ifndef EKV_THREADPOOL_H
#define EKV_THREADPOOL_H

#include "status.h"

typedef struct ekv_threadpool ekv_threadpool;
/* task(task_id, n_tasks, ctx) → 0 or an error */
typedef int (*ekv_task_fn)(int task_id, int n_tasks, void *ctx);

ekv_status ekv_threadpool_new(ekv_error *err, int threads, ekv_threadpool **out);
void ekv_threadpool_free(ekv_threadpool *pool);
int ekv_threadpool_size(const ekv_threadpool *pool);
/* Run tasks 0..n_tasks-1 (0 = one per thread) and wait; returns nonzero when any failed. */
int ekv_threadpool_run(ekv_threadpool *pool, int n_tasks, ekv_task_fn fn, void *ctx);
/* online cores of this machine */
int ekv_online_cores(void);

#endif
