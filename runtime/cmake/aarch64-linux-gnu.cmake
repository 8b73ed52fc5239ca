# CMake toolchain file: the edgekv runtime for aarch64 Linux (glibc), built on an x86_64 host.
#
#   cmake -S runtime -B build/runtime-aarch64 -G Ninja \
#         -DCMAKE_TOOLCHAIN_FILE=runtime/cmake/aarch64-linux-gnu.cmake \
#         -DEDGEKV_TVM_FFI_INCLUDE=$(python -c "import tvm_ffi.libinfo as l; print(l.find_include_path())")
#   ninja -C build/runtime-aarch64
#   qemu-aarch64-static -L /usr/aarch64-linux-gnu build/runtime-aarch64/edgekv-run <artifact> --check
#
# Compiler: Debian's cross gcc (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross) by
# default; -DEDGEKV_CROSS_COMPILER=clang uses `clang --target=aarch64-linux-gnu` with lld over the
# same cross sysroot (apt-get install clang lld). The TVM-FFI headers are plain C and
# architecture-neutral: pass the host wheel's include directory (the find-Python fallback in
# CMakeLists.txt also works, since it runs the build machine's Python).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(EDGEKV_CROSS_TRIPLE aarch64-linux-gnu)
set(EDGEKV_CROSS_COMPILER "gcc" CACHE STRING "gcc (aarch64-linux-gnu-gcc) or clang (clang --target=aarch64-linux-gnu)")
set(EDGEKV_CROSS_SYSROOT "/usr/${EDGEKV_CROSS_TRIPLE}" CACHE PATH "the target's headers and libraries (Debian: /usr/aarch64-linux-gnu)")

if(EDGEKV_CROSS_COMPILER STREQUAL "clang")
  set(CMAKE_C_COMPILER clang)
  set(CMAKE_C_COMPILER_TARGET ${EDGEKV_CROSS_TRIPLE})
  set(CMAKE_EXE_LINKER_FLAGS_INIT "-fuse-ld=lld")
  set(CMAKE_SHARED_LINKER_FLAGS_INIT "-fuse-ld=lld")
  set(CMAKE_MODULE_LINKER_FLAGS_INIT "-fuse-ld=lld")
  # Debian's multiarch cross packages put the target's glibc under /usr/aarch64-linux-gnu and
  # gcc's runtime (crtbegin.o, libgcc) under /usr/lib/gcc-cross: clang finds both itself when
  # given the triple, no --sysroot needed.
else()
  set(CMAKE_C_COMPILER ${EDGEKV_CROSS_TRIPLE}-gcc)
endif()

# look for libraries and headers in the target's tree only; programs on the build machine
set(CMAKE_FIND_ROOT_PATH ${EDGEKV_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# try_run of configure checks cannot execute aarch64 code directly: through qemu-user when present
find_program(EDGEKV_QEMU_AARCH64 NAMES qemu-aarch64-static qemu-aarch64)
if(EDGEKV_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${EDGEKV_QEMU_AARCH64} -L ${EDGEKV_CROSS_SYSROOT})
endif()
