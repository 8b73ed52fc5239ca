#include "json.h"

#include <math.h>

static void item(json_writer *w, const char *key) {
  if (w->depth > 0) {
    if (!w->first[w->depth]) fputc(',', w->f);
    w->first[w->depth] = 0;
    fputc('\n', w->f);
    for (int i = 0; i < w->depth; i++) fputs("  ", w->f);
  }
  if (key != NULL) {
    json_string_n(&(json_writer){w->f, 0, {0}}, NULL, key, (size_t)-1);
    fputs(": ", w->f);
  }
}

void json_begin(json_writer *w, FILE *f) {
  w->f = f;
  w->depth = 0;
}

static void open_scope(json_writer *w, const char *key, char c) {
  item(w, key);
  fputc(c, w->f);
  if (w->depth < 31) w->depth++;
  w->first[w->depth] = 1;
}

static void close_scope(json_writer *w, char c) {
  int empty = w->first[w->depth];
  if (w->depth > 0) w->depth--;
  if (!empty) {
    fputc('\n', w->f);
    for (int i = 0; i < w->depth; i++) fputs("  ", w->f);
  }
  fputc(c, w->f);
  if (w->depth == 0) fputc('\n', w->f);
}

void json_object(json_writer *w, const char *key) { open_scope(w, key, '{'); }
void json_array(json_writer *w, const char *key) { open_scope(w, key, '['); }
void json_end_object(json_writer *w) { close_scope(w, '}'); }
void json_end_array(json_writer *w) { close_scope(w, ']'); }

void json_string_n(json_writer *w, const char *key, const char *s, size_t len) {
  if (w->depth > 0 || key != NULL) item(w, key);
  fputc('"', w->f);
  for (size_t i = 0; len == (size_t)-1 ? s[i] != '\0' : i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') fprintf(w->f, "\\%c", c);
    else if (c == '\n') fputs("\\n", w->f);
    else if (c == '\r') fputs("\\r", w->f);
    else if (c == '\t') fputs("\\t", w->f);
    else if (c < 0x20) fprintf(w->f, "\\u%04x", c);
    else fputc(c, w->f); /* UTF-8 passes through (the text is whole characters) */
  }
  fputc('"', w->f);
}

void json_string(json_writer *w, const char *key, const char *value) { json_string_n(w, key, value, (size_t)-1); }

void json_int(json_writer *w, const char *key, int64_t v) {
  item(w, key);
  fprintf(w->f, "%lld", (long long)v);
}

void json_uint(json_writer *w, const char *key, uint64_t v) {
  item(w, key);
  fprintf(w->f, "%llu", (unsigned long long)v);
}

void json_double(json_writer *w, const char *key, double v) {
  item(w, key);
  if (isfinite(v)) fprintf(w->f, "%.6g", v);
  else fputs("null", w->f);
}

void json_null(json_writer *w, const char *key) {
  item(w, key);
  fputs("null", w->f);
}
