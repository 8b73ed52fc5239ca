/* The device interface: where a session's buffers live and how bytes cross between the host
 * and them. The CPU device is plain memory; an OpenCL device (next) keeps caches, arena and
 * weights in device buffers, and only token ids go in and the last token's logits come out —
 * so the session code touches buffers only through these calls. */
#ifndef EKV_DEVICE_H
#define EKV_DEVICE_H

#include <dlpack/dlpack.h>
#include <stddef.h>

#include "status.h"

typedef struct ekv_device {
  const char *name;
  DLDevice dl; /* what the kernels' DLTensors carry */
  void *(*alloc)(size_t bytes); /* zero-filled; NULL on failure */
  void (*free)(void *buffer);
  /* host → device / device → host, at a byte offset into a device buffer */
  void (*write)(void *buffer, size_t offset, const void *src, size_t bytes);
  void (*read)(const void *buffer, size_t offset, void *dst, size_t bytes);
  /* the device view of weights mapped on the host (the CPU uses the mapping itself) */
  void *(*weights)(const void *host, size_t bytes);
} ekv_device;

const ekv_device *ekv_device_cpu(void);

#endif
