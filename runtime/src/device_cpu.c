#include <string.h>

#include "alloc.h"
#include "device.h"

static void *cpu_alloc(size_t bytes) { return ekv_alloc(bytes, EKV_MEM_RUNTIME); }
static void cpu_free(void *buffer) { ekv_free(buffer); }
static void cpu_write(void *buffer, size_t offset, const void *src, size_t bytes) {
  memcpy((unsigned char *)buffer + offset, src, bytes);
}
static void cpu_read(const void *buffer, size_t offset, void *dst, size_t bytes) {
  memcpy(dst, (const unsigned char *)buffer + offset, bytes);
}
/* kernels only read weights: the read-only mapping is handed to them as it is */
static void *cpu_weights(const void *host, size_t bytes) {
  (void)bytes;
  return (void *)(uintptr_t)host;
}

static const ekv_device CPU = {"cpu", {kDLCPU, 0}, cpu_alloc, cpu_free, cpu_write, cpu_read, cpu_weights};

const ekv_device *ekv_device_cpu(void) { return &CPU; }
