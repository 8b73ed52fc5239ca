#include "cpu_check.h"

#include <stdio.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>

/* Feature bits by CPUID leaf/subleaf/register (Intel SDM vol. 2A, CPUID; AMD APM vol. 3), and
 * the XCR0 state bits the OS must enable for the registers they use. */
enum { R_EBX, R_ECX, R_EDX, R_EAX };
enum { OS_NONE = 0, OS_AVX = 0x6, OS_AVX512 = 0xE6, OS_AMX = 0x60000 };
static const struct {
  const char *name;
  unsigned leaf, subleaf, reg, bit, os;
} FEATURES[] = {
    {"sse4.1", 1, 0, R_ECX, 19, OS_NONE},       {"sse4.2", 1, 0, R_ECX, 20, OS_NONE},
    {"popcnt", 1, 0, R_ECX, 23, OS_NONE},       {"avx", 1, 0, R_ECX, 28, OS_AVX},
    {"fma", 1, 0, R_ECX, 12, OS_AVX},           {"f16c", 1, 0, R_ECX, 29, OS_AVX},
    {"avx2", 7, 0, R_EBX, 5, OS_AVX},           {"bmi", 7, 0, R_EBX, 3, OS_NONE},
    {"bmi2", 7, 0, R_EBX, 8, OS_NONE},          {"avx512f", 7, 0, R_EBX, 16, OS_AVX512},
    {"avx512dq", 7, 0, R_EBX, 17, OS_AVX512},   {"avx512ifma", 7, 0, R_EBX, 21, OS_AVX512},
    {"avx512cd", 7, 0, R_EBX, 28, OS_AVX512},   {"avx512bw", 7, 0, R_EBX, 30, OS_AVX512},
    {"avx512vl", 7, 0, R_EBX, 31, OS_AVX512},   {"avx512vbmi", 7, 0, R_ECX, 1, OS_AVX512},
    {"avx512vbmi2", 7, 0, R_ECX, 6, OS_AVX512}, {"gfni", 7, 0, R_ECX, 8, OS_NONE},
    {"vaes", 7, 0, R_ECX, 9, OS_AVX},           {"vpclmulqdq", 7, 0, R_ECX, 10, OS_AVX},
    {"avx512vnni", 7, 0, R_ECX, 11, OS_AVX512}, {"avx512bitalg", 7, 0, R_ECX, 12, OS_AVX512},
    {"avx512vpopcntdq", 7, 0, R_ECX, 14, OS_AVX512}, {"avx512fp16", 7, 0, R_EDX, 23, OS_AVX512},
    {"amx-bf16", 7, 0, R_EDX, 22, OS_AMX},      {"amx-tile", 7, 0, R_EDX, 24, OS_AMX},
    {"amx-int8", 7, 0, R_EDX, 25, OS_AMX},      {"avxvnni", 7, 1, R_EAX, 4, OS_AVX},
    {"avx512bf16", 7, 1, R_EAX, 5, OS_AVX512},
};

static unsigned long long xcr0(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* no OSXSAVE */
  unsigned lo, hi;
  __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}

/* 1 present, 0 absent, -1 a name this runtime does not know */
static int has_feature(const char *name, size_t len) {
  for (size_t i = 0; i < sizeof FEATURES / sizeof FEATURES[0]; i++) {
    if (strlen(FEATURES[i].name) != len || strncmp(FEATURES[i].name, name, len) != 0) continue;
    unsigned r[4] = {0, 0, 0, 0};
    if (!__get_cpuid_count(FEATURES[i].leaf, FEATURES[i].subleaf, &r[R_EAX], &r[R_EBX], &r[R_ECX], &r[R_EDX]))
      return 0;
    if (!(r[FEATURES[i].reg] & (1u << FEATURES[i].bit))) return 0;
    return (xcr0() & FEATURES[i].os) == FEATURES[i].os;
  }
  return -1;
}
#else
static int has_feature(const char *name, size_t len) {
  (void)name;
  (void)len;
  return -1;
}
#endif

const char *ekv_host_arch(void) {
#if defined(__x86_64__)
  return "x86_64";
#elif defined(__aarch64__)
  return "aarch64";
#else
  return "unknown";
#endif
}

ekv_status ekv_cpu_check(ekv_error *err, const char *arch, const char *features) {
  if (strcmp(arch, ekv_host_arch()) != 0)
    return ekv_fail(err, EKV_ERR_MISMATCH, "the artifact was compiled for %s and this machine is %s: compile it with "
                    "--target host here, or run it on a %s machine", arch, ekv_host_arch(), arch);
  char missing[512] = "";
  size_t used = 0;
  for (const char *p = features; *p != '\0';) {
    const char *end = strchr(p, ',');
    size_t len = end != NULL ? (size_t)(end - p) : strlen(p);
    if (len > 0) {
      int has = has_feature(p, len);
      if (has != 1 && used + len + 16 < sizeof missing) {
        used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%.*s%s", used ? ", " : "", (int)len, p,
                                 has < 0 ? " (unknown to this runtime)" : "");
      }
    }
    p += len + (end != NULL);
  }
  if (used > 0)
    return ekv_fail(err, EKV_ERR_MISMATCH, "the artifact's kernels use CPU features this machine lacks: %s. "
                    "Recompile it here (edgekv compile --target host), which builds for this CPU", missing);
  return EKV_OK;
}
