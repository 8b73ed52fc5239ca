/* The registry of open GPU devices and the launch-argument walk: see device_gpu.h. */
#include "device_gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ekv_status ekv_gpu_registry_open(ekv_gpu_registry *r, ekv_error *err, const ekv_program *prog, const char *path,
                                 uint64_t plan_bytes, ekv_gpu_entry **out) {
  *out = NULL;
  char key[PATH_MAX];
  if (realpath(path, key) == NULL) snprintf(key, sizeof key, "%s", path);
  pthread_mutex_lock(&r->lock);
  ekv_gpu_entry *e = r->head;
  while (e != NULL && strcmp(e->key, key) != 0) e = e->next;
  ekv_status st = EKV_OK;
  if (e != NULL) { /* this artifact is open already: its device, checked against this model's plan */
    st = r->check(err, e, prog, plan_bytes);
    if (st == EKV_OK) e->refs++;
  } else {
    st = r->open(err, prog, path, plan_bytes, &e);
    if (st == EKV_OK) {
      snprintf(e->key, sizeof e->key, "%s", key);
      e->refs = 1;
      e->next = r->head;
      r->head = e;
    } else if (e != NULL) {
      r->release(e);
      e = NULL;
    }
  }
  pthread_mutex_unlock(&r->lock);
  if (st == EKV_OK) *out = e;
  return st;
}

void ekv_gpu_registry_close(ekv_gpu_registry *r, ekv_gpu_entry *entry) {
  pthread_mutex_lock(&r->lock);
  int last = --entry->refs == 0;
  if (last)
    for (ekv_gpu_entry **p = &r->head; *p != NULL; p = &(*p)->next)
      if (*p == entry) {
        *p = entry->next;
        break;
      }
  pthread_mutex_unlock(&r->lock);
  if (last) r->release(entry);
}

const char *ekv_gpu_launch_args(const ekv_device_kernel *desc, const TVMFFIAny *args, int32_t num_args,
                                ekv_gpu_value *values) {
  if (num_args != (int32_t)(desc->n_args + desc->n_tags)) return "called with the wrong argument count";
  if (desc->n_args > EKV_GPU_MAX_LAUNCH_ARGS) return "more arguments than a launch takes";
  for (uint32_t i = 0; i < desc->n_args; i++) {
    const TVMFFIAny *a = &args[i];
    double real = a->type_index == kTVMFFIFloat ? a->v_float64 : (double)a->v_int64;
    switch (desc->args[i]) {
      case EKV_DARG_BUFFER:
        if (a->type_index != kTVMFFIOpaquePtr || a->v_ptr == NULL) return "a buffer argument is not a device buffer";
        values[i].ptr = a->v_ptr;
        break;
      case EKV_DARG_I32: values[i].i32 = (int32_t)a->v_int64; break;
      case EKV_DARG_U32: values[i].u32 = (uint32_t)a->v_int64; break;
      case EKV_DARG_I64: values[i].i64 = a->v_int64; break;
      case EKV_DARG_F32: values[i].f32 = (float)real; break;
      default: values[i].f64 = real; break;
    }
  }
  return NULL;
}

const char *ekv_gpu_launch_dims(const ekv_device_kernel *desc, const TVMFFIAny *args, ekv_gpu_dims *out) {
  *out = (ekv_gpu_dims){{1, 1, 1}, {1, 1, 1}, 0};
  for (uint32_t t = 0; t < desc->n_tags; t++) {
    int64_t extent = args[desc->n_args + t].v_int64;
    uint8_t tag = desc->tags[t];
    if (tag == EKV_TAG_DYN_SHARED) {
      if (extent < 0 || extent > INT_MAX) return "a dynamic shared memory size is out of range";
      out->shared = (unsigned int)extent;
      continue;
    }
    if (extent <= 0 || extent > UINT_MAX) return "a launch extent is not positive";
    if (tag <= EKV_TAG_BLOCK_Z) out->grid[tag] = (unsigned int)extent;
    else if (tag <= EKV_TAG_THREAD_Z) out->block[tag - EKV_TAG_THREAD_X] = (unsigned int)extent;
    else return "an unknown launch tag";
  }
  return NULL;
}

int ekv_gpu_find_kernel(const char *name, const void *kernels, uint32_t n, size_t stride, size_t desc_offset) {
  if (strcmp(name, "__tvm_set_device") == 0) return EKV_GPU_SET_DEVICE;
  for (uint32_t k = 0; k < n; k++) {
    const ekv_device_kernel *desc = (const ekv_device_kernel *)(const void *)((const char *)kernels + k * stride + desc_offset);
    if (strcmp(desc->name, name) == 0) return (int)k;
  }
  TVMFFIErrorSetRaisedFromCStr("RuntimeError", "the library calls a device kernel the program does not list");
  return EKV_GPU_NO_KERNEL;
}

char *ekv_gpu_read_file(const char *path, size_t *size) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  char *data = NULL;
  if (fseek(f, 0, SEEK_END) == 0) {
    long n = ftell(f);
    if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (data = malloc((size_t)n + 1)) != NULL) {
      if (fread(data, 1, (size_t)n, f) != (size_t)n) {
        free(data);
        data = NULL;
      } else {
        data[n] = '\0'; /* NUL-terminated: OpenCL C and PTX are taken as strings */
        *size = (size_t)n;
      }
    }
  }
  fclose(f);
  return data;
}
