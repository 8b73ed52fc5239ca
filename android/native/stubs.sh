#!/usr/bin/env bash
# android/native/stubs.sh OUT_DIR MIN_SDK: the link stubs libc.so, libm.so and libdl.so for the
# freestanding Android build (build.sh, finish.sh). Each defines exactly the symbols that
# bionic-symbols.txt lists for that library at an API level <= MIN_SDK, so DT_NEEDED names
# bionic's libraries and a link with -Wl,--no-undefined fails on anything not listed. Never
# shipped: on the phone the symbols resolve to bionic's own.
set -euo pipefail
out=$1
api=$2
list=$(cd "$(dirname "$0")" && pwd)/bionic-symbols.txt
mkdir -p "$out"
for L in c m dl; do : > "$out/lib$L.c"; done
awk -v api="$api" -v out="$out" '!/^#/ && NF >= 4 && $3 + 0 <= api + 0 {
    lib = $2; sub(/^lib/, "", lib)
    if ($4 == "object") print "char " $1 "[8];" >> (out "/lib" lib ".c")
    else print "void " $1 "(void) {}" >> (out "/lib" lib ".c") }' "$list"
for L in c m dl; do
  clang --target=aarch64-linux-android"$api" -w -ffreestanding -fno-builtin -nostdlib -shared -fPIC -fuse-ld=lld \
        -Wl,-soname,lib$L.so -o "$out/lib$L.so" "$out/lib$L.c"
done
