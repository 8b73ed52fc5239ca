#include <string.h>

#include "alloc.h"
#include "device.h"

static void *cpu_alloc(ekv_device *d, size_t bytes) { return ekv_alloc(bytes, EKV_MEM_RUNTIME); }
static void cpu_free(ekv_device *d, void *buffer) { ekv_free(buffer); }
/* views and weights are host memory the CPU's kernels use in place: nothing to release */
static void *cpu_view(ekv_device *d, void *base, size_t offset, size_t bytes) { return (unsigned char *)base + offset; }
static void *cpu_upload(ekv_device *d, const void *host, size_t bytes) { return (void *)(uintptr_t)host; }
static void cpu_drop(ekv_device *d, void *handle) {}
static ekv_status cpu_write(ekv_device *d, void *buffer, size_t offset, const void *src, size_t bytes) {
  memcpy((unsigned char *)buffer + offset, src, bytes);
  return EKV_OK;
}
static ekv_status cpu_read(ekv_device *d, const void *buffer, size_t offset, void *dst, size_t bytes) {
  memcpy(dst, (const unsigned char *)buffer + offset, bytes);
  return EKV_OK;
}
static ekv_status cpu_finish(ekv_device *d) { return EKV_OK; }
static void cpu_close(ekv_device *d) {}

/* One CPU device serves every model: it holds no state. */
static ekv_device CPU = {.name = "cpu", .dl = {kDLCPU, 0}, .host_memory = 1, .alloc = cpu_alloc, .free = cpu_free,
                         .view = cpu_view, .upload = cpu_upload, .drop = cpu_drop, .write = cpu_write,
                         .read = cpu_read, .finish = cpu_finish, .close = cpu_close};

ekv_device *ekv_device_cpu(void) { return &CPU; }
