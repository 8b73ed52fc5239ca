/* The reconstruction rows of `--compress reconstruct`: see reconstruct.h. The settings hold the repeat
 * prompt's ids as comma-separated decimals (compiler/backend/program.py), read here without a parser. */
#include "reconstruct.h"

#include <stdlib.h>

/* Appends the ids of a comma-separated list to tokens from row *at; false when they pass cap. */
static int put_ids(const char *list, int64_t *tokens, size_t *at, size_t cap) {
  const char *c = list;
  while (*c != '\0') {
    char *end = NULL;
    long id = strtol(c, &end, 10);
    if (end == c) return 0; /* not a number: a damaged program */
    if (*at >= cap) return 0;
    tokens[(*at)++] = (int64_t)id;
    c = *end == ',' ? end + 1 : end;
  }
  return 1;
}

int64_t ekv_reconstruct_rows(const ekv_program *p, const int32_t *doc, size_t start, size_t n, int64_t *tokens,
                             int64_t *positions, size_t cap) {
  size_t at = 0;
  if (start == 0) {
    if (!put_ids(ekv_program_str(p, "reconstruct_first"), tokens, &at, cap)) return -1;
  } else {
    size_t tail = (size_t)ekv_program_int(p, "reconstruct_tail", 0);
    size_t from = start > tail ? start - tail : 0;
    if (!put_ids(ekv_program_str(p, "reconstruct_later"), tokens, &at, cap)) return -1;
    for (size_t i = from; i < start; i++) {
      if (at >= cap) return -1;
      tokens[at++] = doc[i];
    }
  }
  if (!put_ids(ekv_program_str(p, "reconstruct_suffix"), tokens, &at, cap)) return -1;
  for (size_t i = 0; i < n; i++) {
    if (at >= cap) return -1;
    tokens[at++] = doc[start + i];
  }
  for (size_t r = 0; r < at; r++) positions[r] = (int64_t)(start + n + r);
  return (int64_t)at;
}
