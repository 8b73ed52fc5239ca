/* Greedy and seeded temperature / top-p sampling. The sampler owns its RNG (PCG32), so a
 * seed reproduces a run. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "edgekv.h"

struct ekv_sampler {
  float temperature, top_p;
  uint64_t state, inc;
  int32_t cap;
  float *probs;
  int32_t *order;
};

static uint32_t pcg32(ekv_sampler *s) {
  uint64_t old = s->state;
  s->state = old * 6364136223846793005ULL + s->inc;
  uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
  uint32_t rot = (uint32_t)(old >> 59u);
  return (xorshifted >> rot) | (xorshifted << ((32u - rot) & 31u));
}

/* uniform in [0, 1) with 24 bits */
static float uniform(ekv_sampler *s) { return (float)(pcg32(s) >> 8) / 16777216.0f; }

ekv_status ekv_sampler_new(float temperature, float top_p, uint64_t seed, ekv_sampler **out) {
  *out = NULL;
  if (!(temperature >= 0.0f) || !(top_p > 0.0f && top_p <= 1.0f)) return EKV_ERR_INVALID_ARG;
  ekv_sampler *s = ekv_alloc(sizeof *s, EKV_MEM_RUNTIME);
  if (s == NULL) return EKV_ERR_NO_MEMORY;
  s->temperature = temperature;
  s->top_p = top_p;
  s->inc = (seed << 1u) | 1u;
  s->state = 0;
  pcg32(s);
  s->state += 0x853c49e6748fea9bULL ^ seed;
  pcg32(s);
  *out = s;
  return EKV_OK;
}

void ekv_sampler_free(ekv_sampler *s) {
  if (s == NULL) return;
  ekv_free(s->probs);
  ekv_free(s->order);
  ekv_free(s);
}

static int32_t argmax(const float *logits, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; i++)
    if (logits[i] > logits[best]) best = i;
  return best;
}

static _Thread_local const float *t_sort_probs;

static int by_prob_desc(const void *a, const void *b) {
  float pa = t_sort_probs[*(const int32_t *)a], pb = t_sort_probs[*(const int32_t *)b];
  if (pa != pb) return pa < pb ? 1 : -1;
  return *(const int32_t *)a - *(const int32_t *)b;
}

int32_t ekv_sampler_sample(ekv_sampler *s, const float *logits, int32_t n) {
  if (s == NULL || s->temperature == 0.0f || n <= 1) return argmax(logits, n);
  if (s->cap < n) {
    ekv_free(s->probs);
    ekv_free(s->order);
    s->probs = ekv_alloc(sizeof(float) * (size_t)n, EKV_MEM_RUNTIME);
    s->order = ekv_alloc(sizeof(int32_t) * (size_t)n, EKV_MEM_RUNTIME);
    s->cap = (s->probs != NULL && s->order != NULL) ? n : 0;
    if (s->cap == 0) return argmax(logits, n); /* no memory for sampling: stay greedy */
  }
  float max = logits[argmax(logits, n)], sum = 0.0f;
  for (int32_t i = 0; i < n; i++) {
    s->probs[i] = expf((logits[i] - max) / s->temperature);
    sum += s->probs[i];
  }
  int32_t kept = n;
  if (s->top_p < 1.0f) {
    /* nucleus: the smallest set of most likely tokens whose mass reaches top_p */
    for (int32_t i = 0; i < n; i++) s->order[i] = i;
    t_sort_probs = s->probs;
    qsort(s->order, (size_t)n, sizeof(int32_t), by_prob_desc);
    float mass = 0.0f;
    for (kept = 0; kept < n;) {
      mass += s->probs[s->order[kept++]];
      if (mass >= s->top_p * sum) break;
    }
    sum = mass;
  }
  float r = uniform(s) * sum, acc = 0.0f;
  for (int32_t k = 0; k < kept; k++) {
    int32_t i = s->top_p < 1.0f ? s->order[k] : k;
    acc += s->probs[i];
    if (r < acc) return i;
  }
  return s->top_p < 1.0f ? s->order[kept - 1] : n - 1;
}
