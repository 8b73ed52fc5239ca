#include "alloc.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A header in front of each block records its size and kind, so ekv_free can count it. */
typedef struct {
  uint64_t bytes;
  uint32_t kind;
  uint32_t magic;
} block_header;
#define HEADER_SPACE EKV_ALIGN
#define BLOCK_MAGIC 0xEC0A11C5u

static _Atomic uint64_t g_current;
static _Atomic uint64_t g_peak;
static _Atomic uint64_t g_kind_current[EKV_MEM_KINDS];
static _Atomic uint64_t g_kind_peak[EKV_MEM_KINDS];

static void raise_peak(_Atomic uint64_t *peak, uint64_t value) {
  uint64_t seen = atomic_load(peak);
  while (value > seen && !atomic_compare_exchange_weak(peak, &seen, value)) {
  }
}

static void *allocate(size_t bytes, ekv_mem_kind kind, int zero) {
  if (bytes > SIZE_MAX - 2 * HEADER_SPACE) return NULL;
  size_t total = ekv_align_up(bytes + HEADER_SPACE, EKV_ALIGN);
  void *mem = NULL; /* posix_memalign: Android has aligned_alloc only from API 28 */
  if (posix_memalign(&mem, EKV_ALIGN, total) != 0) return NULL;
  unsigned char *raw = mem;
  if (zero) memset(raw + HEADER_SPACE, 0, total - HEADER_SPACE);
  block_header *h = (block_header *)raw;
  h->bytes = total;
  h->kind = (uint32_t)kind;
  h->magic = BLOCK_MAGIC;
  raise_peak(&g_peak, atomic_fetch_add(&g_current, total) + total);
  raise_peak(&g_kind_peak[kind], atomic_fetch_add(&g_kind_current[kind], total) + total);
  return raw + HEADER_SPACE;
}

void *ekv_alloc(size_t bytes, ekv_mem_kind kind) { return allocate(bytes, kind, 1); }
void *ekv_alloc_uninit(size_t bytes, ekv_mem_kind kind) { return allocate(bytes, kind, 0); }

size_t ekv_alloc_usable(const void *ptr) {
  const block_header *h = (const block_header *)((const unsigned char *)ptr - HEADER_SPACE);
  return (size_t)h->bytes - HEADER_SPACE;
}

void ekv_free(void *ptr) {
  if (ptr == NULL) return;
  unsigned char *raw = (unsigned char *)ptr - HEADER_SPACE;
  block_header *h = (block_header *)raw;
  if (h->magic != BLOCK_MAGIC) abort(); /* a pointer not from ekv_alloc: a runtime bug */
  h->magic = 0;
  atomic_fetch_sub(&g_current, h->bytes);
  atomic_fetch_sub(&g_kind_current[h->kind], h->bytes);
  free(raw);
}

uint64_t ekv_mem_current(void) { return atomic_load(&g_current); }
uint64_t ekv_mem_peak(void) { return atomic_load(&g_peak); }
uint64_t ekv_mem_kind_peak(ekv_mem_kind kind) { return atomic_load(&g_kind_peak[kind]); }

void ekv_mem_reset_peaks(void) {
  atomic_store(&g_peak, atomic_load(&g_current));
  for (int k = 0; k < EKV_MEM_KINDS; k++) atomic_store(&g_kind_peak[k], atomic_load(&g_kind_current[k]));
}

static uint64_t status_kib(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  if (f == NULL) return 0;
  char line[256];
  size_t klen = strlen(key);
  uint64_t kib = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    if (strncmp(line, key, klen) == 0) {
      kib = strtoull(line + klen, NULL, 10);
      break;
    }
  }
  fclose(f);
  return kib * 1024;
}

uint64_t ekv_peak_rss(void) { return status_kib("VmHWM:"); }
uint64_t ekv_current_rss(void) { return status_kib("VmRSS:"); }
