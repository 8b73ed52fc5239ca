/* A small JSON writer for the --report file (objects, arrays, escaped strings, numbers). */
#ifndef EKV_CLI_JSON_H
#define EKV_CLI_JSON_H

#include <stdint.h>
#include <stdio.h>

typedef struct {
  FILE *f;
  int depth;
  int first[32]; /* per nesting level: no comma before the next item */
} json_writer;

void json_begin(json_writer *w, FILE *f);
void json_object(json_writer *w, const char *key); /* key NULL inside arrays / at the top */
void json_array(json_writer *w, const char *key);
void json_end_object(json_writer *w);
void json_end_array(json_writer *w);
void json_string(json_writer *w, const char *key, const char *value);
void json_string_n(json_writer *w, const char *key, const char *value, size_t len);
void json_int(json_writer *w, const char *key, int64_t value);
void json_uint(json_writer *w, const char *key, uint64_t value);
void json_double(json_writer *w, const char *key, double value); /* null when not finite */
void json_null(json_writer *w, const char *key);

#endif
