/* The reconstruction rows of `--compress reconstruct` (edgekv/policies/reconstruct.py): the extra rows
 * of each prefill step of a document longer than N, filled from the program's settings. */
#ifndef EDGEKV_RECONSTRUCT_H
#define EDGEKV_RECONSTRUCT_H

#include <stddef.h>
#include <stdint.h>

#include "program.h"

/* Writes the rows of the block doc[start, start + n) into tokens / positions (at most cap rows): the
 * repeat prompt ("reconstruct_first" before block 0, else "reconstruct_later" then the previous block's
 * last "reconstruct_tail" tokens), "reconstruct_suffix", then the block, at positions start + n on.
 * Returns the rows written, or -1 when they do not fit cap (a program this runtime cannot fill). */
int64_t ekv_reconstruct_rows(const ekv_program *p, const int32_t *doc, size_t start, size_t n, int64_t *tokens,
                             int64_t *positions, size_t cap);

#endif
