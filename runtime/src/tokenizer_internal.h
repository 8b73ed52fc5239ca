/* Shared by tokenizer.c and utf8.c: one UTF-8 scanner, so the tokenizer's split and the
 * streaming decoder agree on what a well-formed character is. */
#ifndef EKV_TOKENIZER_INTERNAL_H
#define EKV_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

typedef enum ekv_utf8_unit {
  EKV_UTF8_CHAR,       /* a well-formed character of *len bytes, *cp its code point */
  EKV_UTF8_INVALID,    /* ill-formed: *len is its maximal subpart (1..3 bytes), one U+FFFD */
  EKV_UTF8_INCOMPLETE  /* s[0..n) is a well-formed start that needs more bytes (*len = n) */
} ekv_utf8_unit;

/* The unit starting at s[0] (n >= 1 bytes available). Well-formed is Unicode's Table 3-7:
 * no overlong forms, no surrogates, nothing above U+10FFFF. The maximal subpart is the longest
 * prefix that could begin a well-formed sequence (what Python's errors="replace" replaces by
 * one U+FFFD). */
ekv_utf8_unit ekv_utf8_next(const unsigned char *s, size_t n, uint32_t *cp, size_t *len);

#endif
