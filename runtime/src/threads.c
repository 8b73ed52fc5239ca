/* The thread count of a run: the rule edgekv/threads.py follows, for the runtime without Python
 * (docs/NATIVE.md, "Threads"). Usable cores = the CPUs this process may run on (affinity), one per
 * physical core (SMT siblings share its arithmetic units), the big cores of a big.LITTLE chip (top
 * frequency within 25 % of the fastest), at most a cgroup v2 CPU quota. The default subtracts the
 * other runnable processes (/proc/stat procs_running, the median of a few samples), at least one;
 * a request above the usable cores is clamped to them: a thread beyond a core only waits for one,
 * and every parallel region waits for its slowest thread (64 threads on 2 cores ran 10x slower). */
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "edgekv.h"

#define MAX_CPUS 1024
#define BUSY_SAMPLES 7

static int read_small(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return 0;
  size_t n = fread(buf, 1, cap - 1, f);
  fclose(f);
  buf[n] = '\0';
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) buf[--n] = '\0';
  return n > 0;
}

static int allowed_cpus(int *cpus) {
  int n = 0;
#ifdef CPU_SETSIZE
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE && c < MAX_CPUS; c++)
      if (CPU_ISSET(c, &set)) cpus[n++] = c;
    if (n > 0) return n;
  }
#endif
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  for (int c = 0; c < (online > 0 ? online : 1) && c < MAX_CPUS; c++) cpus[n++] = c;
  return n;
}

/* one CPU per physical core: the first of each distinct thread_siblings_list */
static int physical(int *cpus, int n) {
  static char keys[MAX_CPUS][64];
  int kept = 0;
  for (int i = 0; i < n; i++) {
    char path[128], key[64];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", cpus[i]);
    if (!read_small(path, key, sizeof key)) snprintf(key, sizeof key, "%d", cpus[i]);
    int seen = 0;
    for (int k = 0; k < kept && !seen; k++) seen = strcmp(keys[k], key) == 0;
    if (seen) continue;
    snprintf(keys[kept], sizeof keys[kept], "%s", key);
    cpus[kept++] = cpus[i];
  }
  return kept;
}

/* big.LITTLE: the cores whose top frequency is within 25 % of the fastest (all, when any is unknown) */
static int big_cores(const int *cpus, int n) {
  static long freq[MAX_CPUS];
  long top = 0;
  for (int i = 0; i < n; i++) {
    char path[128], text[32];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/cpufreq/cpuinfo_max_freq", cpus[i]);
    if (!read_small(path, text, sizeof text) || (freq[i] = atol(text)) <= 0) return n;
    if (freq[i] > top) top = freq[i];
  }
  int big = 0;
  for (int i = 0; i < n; i++) big += (double)freq[i] >= 0.75 * (double)top;
  return big > 0 ? big : n;
}

/* cgroup v2 cpu.max "quota period" as whole cores; 0 without a quota */
static int quota_cores(void) {
  char text[64];
  if (!read_small("/sys/fs/cgroup/cpu.max", text, sizeof text)) return 0;
  long long quota, period;
  if (sscanf(text, "%lld %lld", &quota, &period) != 2 || quota <= 0 || period <= 0) return 0; /* "max ..." */
  long long cores = (quota + period - 1) / period;
  return cores < 1 ? 1 : (int)cores;
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* other runnable threads on the CPUs this process may use (0 where /proc/stat cannot be read) */
static int other_runnable(int allowed) {
  int values[BUSY_SAMPLES], n = 0;
  for (int i = 0; i < BUSY_SAMPLES; i++) {
    FILE *f = fopen("/proc/stat", "rb");
    if (f == NULL) return 0;
    char line[256];
    while (fgets(line, sizeof line, f) != NULL)
      if (strncmp(line, "procs_running ", 14) == 0) {
        values[n++] = atoi(line + 14);
        break;
      }
    fclose(f);
    if (i + 1 < BUSY_SAMPLES) nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
  }
  if (n == 0) return 0;
  qsort(values, (size_t)n, sizeof values[0], cmp_int);
  int others = values[n / 2] - 1;
  if (others < 0) others = 0;
  long total = sysconf(_SC_NPROCESSORS_ONLN);
  if (total > 0 && allowed < total) others = (int)lround((double)others * allowed / (double)total);
  return others;
}

int ekv_usable_cores(void) {
  static int cpus[MAX_CPUS];
  int n = allowed_cpus(cpus);
  n = big_cores(cpus, physical(cpus, n));
  int quota = quota_cores();
  if (quota > 0 && quota < n) n = quota;
  return n > 0 ? n : 1;
}

void ekv_choose_threads(int requested, ekv_thread_choice *out) {
  memset(out, 0, sizeof *out);
  out->requested = requested;
  out->cores = ekv_usable_cores();
  if (requested > 0) {
    out->count = requested > out->cores ? out->cores : requested;
    out->clamped = requested > out->cores;
    return;
  }
  static int cpus[MAX_CPUS];
  out->busy = other_runnable(allowed_cpus(cpus));
  out->count = out->cores - out->busy > 1 ? out->cores - out->busy : 1;
}
