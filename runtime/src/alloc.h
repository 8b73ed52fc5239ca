/* The one allocation path: every byte the runtime allocates goes through here, so the
 * memory report (current and peak) is exact. Blocks are 64-byte aligned (TVM's CPU kernels
 * need it) and zero-filled. */
#ifndef EKV_ALLOC_H
#define EKV_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#define EKV_ALIGN 64

typedef enum { EKV_MEM_RUNTIME = 0, EKV_MEM_WORKSPACE = 1, EKV_MEM_KINDS = 2 } ekv_mem_kind;

void *ekv_alloc(size_t bytes, ekv_mem_kind kind);
/* The same, not zero-filled (kernel workspaces: TVM's are not either). */
void *ekv_alloc_uninit(size_t bytes, ekv_mem_kind kind);
/* The usable bytes of a block from ekv_alloc / ekv_alloc_uninit (at least what was asked). */
size_t ekv_alloc_usable(const void *ptr);
void ekv_free(void *ptr);
uint64_t ekv_mem_current(void);
uint64_t ekv_mem_peak(void);
uint64_t ekv_mem_kind_peak(ekv_mem_kind kind);
void ekv_mem_reset_peaks(void);
/* the process's peak resident set in bytes (VmHWM; 0 where unknown) */
uint64_t ekv_peak_rss(void);
uint64_t ekv_current_rss(void);

static inline size_t ekv_align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

#endif
