#include "reader.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"

static ekv_status map_file(ekv_error *err, const char *path, int prot, ekv_mapped_file *out) {
  out->data = NULL;
  out->size = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ekv_fail(err, EKV_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return ekv_fail(err, EKV_ERR_IO, "%s is not a regular file", path);
  }
  if (st.st_size > 0) {
    void *p = mmap(NULL, (size_t)st.st_size, prot, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      close(fd);
      return ekv_fail(err, EKV_ERR_IO, "cannot map %s: %s", path, strerror(e));
    }
    out->data = p;
    out->size = (size_t)st.st_size;
  }
  close(fd);
  return EKV_OK;
}

ekv_status ekv_map_file(ekv_error *err, const char *path, ekv_mapped_file *out) {
  return map_file(err, path, PROT_READ, out);
}

ekv_status ekv_map_file_private(ekv_error *err, const char *path, ekv_mapped_file *out) {
  return map_file(err, path, PROT_READ | PROT_WRITE, out);
}

void ekv_unmap_file(ekv_mapped_file *file) {
  if (file->data != NULL) munmap((void *)file->data, file->size);
  file->data = NULL;
  file->size = 0;
}

ekv_status ekv_read_file(ekv_error *err, const char *path, size_t max_bytes, unsigned char **data, size_t *size) {
  *data = NULL;
  *size = 0;
  FILE *f = fopen(path, "rb");
  if (f == NULL) return ekv_fail(err, EKV_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    fclose(f);
    return ekv_fail(err, EKV_ERR_IO, "%s is not a regular file", path);
  }
  if ((uint64_t)st.st_size > max_bytes) {
    fclose(f);
    return ekv_fail(err, EKV_ERR_FORMAT, "%s is %lld bytes, more than the %zu expected", path, (long long)st.st_size,
                    max_bytes);
  }
  unsigned char *buf = ekv_alloc((size_t)st.st_size + 1, EKV_MEM_RUNTIME);
  if (buf == NULL) {
    fclose(f);
    return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot allocate %lld bytes for %s", (long long)st.st_size, path);
  }
  size_t got = fread(buf, 1, (size_t)st.st_size, f);
  fclose(f);
  if (got != (size_t)st.st_size) {
    ekv_free(buf);
    return ekv_fail(err, EKV_ERR_IO, "short read of %s", path);
  }
  *data = buf;
  *size = got;
  return EKV_OK;
}

int64_t ekv_le64s(const unsigned char *p) {
  uint64_t u = ekv_le64(p);
  int64_t v;
  memcpy(&v, &u, sizeof v);
  return v;
}

double ekv_lef64(const unsigned char *p) {
  uint64_t u = ekv_le64(p);
  double v;
  memcpy(&v, &u, sizeof v);
  return v;
}

/* zlib's CRC-32, eight bytes a step ("slicing by 8": table k holds the CRC of a byte followed by k
 * zero bytes): the weights are checked at every open that has no valid stamp, so this runs at
 * memory speed rather than a byte per table lookup. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int k = 1; k < 8; k++) crc_table[k][i] = (crc_table[k - 1][i] >> 8) ^ crc_table[0][crc_table[k - 1][i] & 0xFFu];
}

uint32_t ekv_crc32(uint32_t crc, const void *data, size_t len) {
  pthread_once(&crc_once, crc_init);
  const unsigned char *p = data;
  crc = ~crc;
  for (; len >= 8; p += 8, len -= 8) {
    uint32_t lo = ekv_le32(p) ^ crc, hi = ekv_le32(p + 4);
    crc = crc_table[7][lo & 0xFFu] ^ crc_table[6][(lo >> 8) & 0xFFu] ^ crc_table[5][(lo >> 16) & 0xFFu] ^
          crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFFu] ^ crc_table[2][(hi >> 8) & 0xFFu] ^
          crc_table[1][(hi >> 16) & 0xFFu] ^ crc_table[0][hi >> 24];
  }
  for (size_t i = 0; i < len; i++) crc = crc_table[0][(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

int ekv_path_join(char *buf, size_t cap, const char *dir, const char *name) {
  int n = snprintf(buf, cap, "%s/%s", dir, name);
  return n > 0 && (size_t)n < cap;
}
