#!/usr/bin/env bash
# android/finish.sh ARTIFACT_DIR: link an `edgekv compile --target android-cpu` (or `--target opencl`)
# artifact's model.tar into model.so for Android phones, then check the result.
#
# With ANDROID_NDK_HOME set the NDK's clang links it; without an NDK, Debian's clang/lld link it
# freestanding against the same bionic link stubs as the app's libraries (android/native/stubs.sh),
# with -Wl,--no-undefined: every function the kernels import must be one bionic exports. Either
# way `python -m edgekv.compiler.backend.finish` does the linking; for Android targets it also
# links in the small error shim the app needs (edgekv/compiler/backend/finish.py, ERROR_SHIM_SOURCE).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
MIN_SDK=24
[ $# -eq 1 ] && [ -d "$1" ] || { echo "usage: android/finish.sh ARTIFACT_DIR" >&2; exit 2; }
ART=$1
PY=${PYTHON:-python3}
if [ -n "${ANDROID_NDK_HOME:-}" ]; then
  CC="$ANDROID_NDK_HOME/toolchains/llvm/prebuilt/linux-x86_64/bin/aarch64-linux-android$MIN_SDK-clang -Wl,-z,max-page-size=16384"
else
  for t in clang ld.lld llvm-readelf; do
    command -v $t >/dev/null 2>&1 || { echo "android/finish.sh: $t is missing: apt-get install -y clang lld llvm" >&2; exit 2; }
  done
  STUBS=${EDGEKV_ANDROID_OUT:-$REPO/build/android}/finish-stubs
  "$HERE/native/stubs.sh" "$STUBS" $MIN_SDK
  CC="clang --target=aarch64-linux-android$MIN_SDK -nostdlib -fuse-ld=lld -Wl,-z,max-page-size=16384 -Wl,--hash-style=both -Wl,--no-undefined -L$STUBS -lc -lm"
fi
TVM_NDK_CC="$CC" PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m edgekv.compiler.backend.finish "$ART"
if command -v llvm-readelf >/dev/null 2>&1; then
  echo "model.so needs: $(llvm-readelf -d "$ART/model.so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
fi
