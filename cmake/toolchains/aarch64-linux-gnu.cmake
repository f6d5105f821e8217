# Cross build for 64-bit ARM Linux with Debian's cross toolchain, the tests run
# under qemu user-mode emulation (ctest runs them through
# CMAKE_CROSSCOMPILING_EMULATOR). Used by the "aarch64" presets: it checks that
# the portable loops, the codecs and the attention give the same bits on ARM as
# on x86-64 (the golden tables), where char is unsigned, GCC contracts a * b + c
# into fmadd wherever it is allowed to, and no x86 path exists.
#   apt-get install g++-aarch64-linux-gnu qemu-user   (cmake/bootstrap.sh --aarch64)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(LYNX_CROSS_TRIPLE aarch64-linux-gnu)

set(CMAKE_C_COMPILER ${LYNX_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${LYNX_CROSS_TRIPLE}-g++)

# Libraries and headers of the target come from the cross sysroot; Debian's cross
# g++ also searches /usr/include last, where the header-only dependencies (doctest,
# xxhash.h) live, and CMake package configs (doctest's) are looked up on the host too.
set(CMAKE_FIND_ROOT_PATH /usr/${LYNX_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

find_program(LYNX_QEMU_AARCH64 qemu-aarch64)
if(NOT LYNX_QEMU_AARCH64)
  message(FATAL_ERROR "aarch64 toolchain: qemu-aarch64 not found (apt-get install qemu-user); "
                      "the cross-built tests could not run")
endif()
set(CMAKE_CROSSCOMPILING_EMULATOR "${LYNX_QEMU_AARCH64};-L;/usr/${LYNX_CROSS_TRIPLE}")
