/* Reading binary files safely: a read-only mapping that knows its length, little-endian
 * field readers, overflow-safe range checks, CRC-32. */
#ifndef EKV_READER_H
#define EKV_READER_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct ekv_mapped_file {
  const unsigned char *data;
  size_t size;
} ekv_mapped_file;

/* Map `path` read-only (an empty file gives data == NULL, size 0). */
ekv_status ekv_map_file(ekv_error *err, const char *path, ekv_mapped_file *out);
/* Map `path` copy-on-write: writable, but writes stay in this process and never reach the file. */
ekv_status ekv_map_file_private(ekv_error *err, const char *path, ekv_mapped_file *out);
void ekv_unmap_file(ekv_mapped_file *file);
/* Read a whole (small) file into an ekv_alloc'd buffer. */
ekv_status ekv_read_file(ekv_error *err, const char *path, size_t max_bytes, unsigned char **data, size_t *size);

/* offset + length lies inside a buffer of `size` bytes (no overflow). */
static inline int ekv_range_ok(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}
/* a * b without overflow into *out (0 on overflow). */
static inline int ekv_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
  if (a != 0 && b > UINT64_MAX / a) return 0;
  *out = a * b;
  return 1;
}

static inline uint16_t ekv_le16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t ekv_le32(const unsigned char *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t ekv_le64(const unsigned char *p) {
  return (uint64_t)ekv_le32(p) | ((uint64_t)ekv_le32(p + 4) << 32);
}
int64_t ekv_le64s(const unsigned char *p);
double ekv_lef64(const unsigned char *p);

/* zlib's CRC-32 (polynomial 0xEDB88320), continued from `crc` (0 to start). */
uint32_t ekv_crc32(uint32_t crc, const void *data, size_t len);

/* Join a directory and a file name into buf; 0 when it does not fit. */
int ekv_path_join(char *buf, size_t cap, const char *dir, const char *name);

#endif
