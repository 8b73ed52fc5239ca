/* The artifact's manifest, checked minimally (keys: manifest_keys.h, generated from manifest.py): the native runtime's contract is program.ekv (validated whole,
 * every section CRC-checked), but an artifact whose manifest is cut off or damaged is a broken copy,
 * and the Python runtimes refuse it (edgekv/artifact/manifest.py, the typed reader) — so this one
 * does too, without a general JSON parser: the file must be one complete JSON object, and its
 * top-level format_version, budget and block must be integers equal to the program's. */
#include "manifest_check.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "manifest_keys.h"
#include "reader.h"

#define MAX_MANIFEST_BYTES ((size_t)64 << 20)

typedef struct {
  const char *key;
  const char *meaning;
  const char *value; /* the raw top-level value (points into the text) */
  size_t len;
} top_field;

static size_t skip_string(const char *t, size_t i, size_t n) { /* t[i] == '"'; returns the index after it */
  for (i++; i < n; i++) {
    if (t[i] == '\\') i++;
    else if (t[i] == '"') return i + 1;
  }
  return 0; /* unterminated */
}

/* one complete object; the raw values of the wanted top-level keys. Returns NULL or what is wrong. */
static const char *scan(const char *t, size_t n, top_field *fields, int n_fields) {
  size_t i = 0;
  while (i < n && strchr(" \t\r\n", t[i]) != NULL) i++;
  if (i == n || t[i] != '{') return "is not a JSON object";
  int depth = 0, expect_key = 0; /* at depth 1: the next string is a key (after '{' or ',') */
  const char *key = NULL;
  size_t key_len = 0, value_start = 0;
  top_field *pending = NULL;
  for (; i < n; i++) {
    char c = t[i];
    if (c == '"') {
      size_t end = skip_string(t, i, n);
      if (end == 0) return "is cut off (a string never ends)";
      if (depth == 1 && expect_key) {
        key = t + i + 1;
        key_len = end - i - 2;
        expect_key = 0;
      }
      i = end - 1;
      continue;
    }
    if (depth == 1 && c == ':' && key != NULL) {
      for (int f = 0; f < n_fields; f++)
        if (strlen(fields[f].key) == key_len && strncmp(fields[f].key, key, key_len) == 0) pending = &fields[f];
      key = NULL;
      value_start = i + 1;
      continue;
    }
    if (depth == 1 && (c == ',' || c == '}') && pending != NULL) {
      while (value_start < i && strchr(" \t\r\n", t[value_start]) != NULL) value_start++;
      size_t end = i;
      while (end > value_start && strchr(" \t\r\n", t[end - 1]) != NULL) end--;
      pending->value = t + value_start;
      pending->len = end - value_start;
      pending = NULL;
    }
    if (depth == 1 && c == ',') expect_key = 1;
    if (c == '{' || c == '[') expect_key = ++depth == 1;
    else if (c == '}' || c == ']') {
      if (--depth < 0) return "is not valid JSON (an unmatched bracket)";
      if (depth == 0) {
        for (i++; i < n && strchr(" \t\r\n", t[i]) != NULL; i++) {}
        return i == n ? NULL : "is not valid JSON (text after the object)";
      }
    }
  }
  return "is cut off (the object never closes)";
}

static int as_int(const top_field *f, long long *out) {
  if (f->value == NULL || f->len == 0 || f->len > 20) return 0;
  char buf[24];
  memcpy(buf, f->value, f->len);
  buf[f->len] = '\0';
  char *end;
  long long v = strtoll(buf, &end, 10);
  if (*end != '\0' || end == buf) return 0;
  *out = v;
  return 1;
}

ekv_status ekv_manifest_check(ekv_error *err, const char *dir, const ekv_program *prog) {
  char path[PATH_MAX];
  if (!ekv_path_join(path, sizeof path, dir, EKV_MANIFEST_FILE)) return EKV_OK;
  FILE *f = fopen(path, "rb");
  if (f == NULL) return EKV_OK; /* a program-only artifact (the native runtime needs no manifest) */
  char *text = malloc(MAX_MANIFEST_BYTES + 1);
  size_t n = text != NULL ? fread(text, 1, MAX_MANIFEST_BYTES + 1, f) : 0;
  fclose(f);
  if (text == NULL) return ekv_fail(err, EKV_ERR_NO_MEMORY, "cannot read %s: out of memory", path);
  const char *recompile = "the manifest is damaged or was not written by edgekv: recompile the artifact "
                          "(edgekv compile ... -o DIR), or copy it again";
  top_field fields[] = {{EKV_MANIFEST_FORMAT_VERSION, "the artifact format", NULL, 0},
                        {EKV_MANIFEST_BUDGET, "N: KV entries kept per layer and KV head", NULL, 0},
                        {EKV_MANIFEST_BLOCK, "B: prompt tokens per prefill step", NULL, 0}};
  const char *bad = n > MAX_MANIFEST_BYTES ? "is larger than 64 MiB" : scan(text, n, fields, 3);
  ekv_status st = EKV_OK;
  if (bad != NULL) {
    st = ekv_fail(err, EKV_ERR_FORMAT, "%s %s; %s", path, bad, recompile);
  } else {
    const long long want[3] = {EKV_ARTIFACT_VERSION, prog->budget, prog->block};
    for (int i = 0; i < 3 && st == EKV_OK; i++) {
      long long v;
      if (fields[i].value == NULL) {
        st = ekv_fail(err, EKV_ERR_FORMAT, "%s has no '%s' (%s); %s", path, fields[i].key, fields[i].meaning,
                      recompile);
      } else if (!as_int(&fields[i], &v)) {
        char shown[44]; /* the value on one line: whitespace between its tokens dropped */
        size_t k = 0;
        for (size_t j = 0; j < fields[i].len && k < 40; j++)
          if (strchr(" \t\r\n", fields[i].value[j]) == NULL) shown[k++] = fields[i].value[j];
        shown[k] = '\0';
        st = ekv_fail(err, EKV_ERR_FORMAT, "%s: '%s' is %s, expected an integer (%s); %s", path, fields[i].key, shown,
                      fields[i].meaning, recompile);
      } else if (v != want[i]) {
        st = i == 0 ? ekv_fail(err, EKV_ERR_FORMAT, "%s: artifact format version %lld is not supported by this "
                               "runtime (it reads %d); recompile the artifact with this edgekv", path, v,
                               EKV_ARTIFACT_VERSION)
                    : ekv_fail(err, EKV_ERR_MISMATCH, "%s: '%s' is %lld but program.ekv has %lld: the two files come "
                               "from different compiles; recompile the artifact", path, fields[i].key, v, want[i]);
      }
    }
  }
  free(text);
  return st;
}
