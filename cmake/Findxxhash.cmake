# Findxxhash — locate the xxHash header (and, where it has one, the library's
# runtime SIMD dispatch).
#
# Lynx uses xxHash (XXH3-64 segment checksums) with `#define XXH_INLINE_ALL`
# before `#include <xxhash.h>`, so the header is all it needs. The inline XXH3
# is compiled for the flags of the including file, which for a portable build is
# SSE2: about 5 GB/s on segments of a few MiB on an AVX-512 machine, against
# 30-75 GB/s for the AVX2/AVX-512 code that libxxhash picks at run time
# (XXH3_64bits_withSeed_dispatch, in Debian's libxxhash on x86-64). Where that
# symbol links, lynx::xxhash also links the library and defines
# LYNX_XXH3_DISPATCH=1, and segment checksums go through it (same hash values).
# Provides the IMPORTED INTERFACE target lynx::xxhash.
#
# Result variables: xxhash_FOUND, XXHASH_INCLUDE_DIR (cache), xxhash_VERSION,
# XXHASH_LIBRARY (cache; optional), XXHASH_HAS_DISPATCH.
# Hints: XXHASH_ROOT / xxhash_ROOT, or CMAKE_PREFIX_PATH.
#
# Installed next to lynx-config.cmake, which re-runs it through find_dependency.

find_path(XXHASH_INCLUDE_DIR xxhash.h
  HINTS ${XXHASH_ROOT} ENV XXHASH_ROOT
  PATH_SUFFIXES include
  DOC "Directory containing xxhash.h")

if(XXHASH_INCLUDE_DIR AND EXISTS "${XXHASH_INCLUDE_DIR}/xxhash.h")
  file(STRINGS "${XXHASH_INCLUDE_DIR}/xxhash.h" _xxh_version_lines
    REGEX "^#define XXH_VERSION_(MAJOR|MINOR|RELEASE)[ \t]+[0-9]+")
  foreach(_part MAJOR MINOR RELEASE)
    string(REGEX MATCH "XXH_VERSION_${_part}[ \t]+([0-9]+)" _m "${_xxh_version_lines}")
    set(_xxh_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _xxh_MAJOR STREQUAL "")
    set(xxhash_VERSION "${_xxh_MAJOR}.${_xxh_MINOR}.${_xxh_RELEASE}")
  endif()
  unset(_xxh_version_lines)
  unset(_m)
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(xxhash
  REQUIRED_VARS XXHASH_INCLUDE_DIR
  VERSION_VAR xxhash_VERSION
  REASON_FAILURE_MESSAGE "install libxxhash-dev (Debian/Ubuntu) or xxhash-devel, or set XXHASH_ROOT")
mark_as_advanced(XXHASH_INCLUDE_DIR)

find_library(XXHASH_LIBRARY xxhash
  HINTS ${XXHASH_ROOT} ENV XXHASH_ROOT
  PATH_SUFFIXES lib
  DOC "libxxhash (optional: its run-time SIMD dispatch of XXH3)")
mark_as_advanced(XXHASH_LIBRARY)

set(XXHASH_HAS_DISPATCH FALSE)
if(xxhash_FOUND AND XXHASH_LIBRARY)
  get_property(_xxh_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
  if("CXX" IN_LIST _xxh_languages)
    include(CheckCXXSourceCompiles)
    include(CMakePushCheckState)
    cmake_push_check_state(RESET)
    set(CMAKE_REQUIRED_LIBRARIES "${XXHASH_LIBRARY}")
    set(CMAKE_REQUIRED_QUIET TRUE)
    check_cxx_source_compiles([=[
#include <cstddef>
#include <cstdint>
extern "C" std::uint64_t XXH3_64bits_withSeed_dispatch(const void*, std::size_t, std::uint64_t);
int main() { return static_cast<int>(XXH3_64bits_withSeed_dispatch("lynx", 4, 1) & 1); }
]=] LYNX_XXH3_DISPATCH_LINKS)
    cmake_pop_check_state()
    if(LYNX_XXH3_DISPATCH_LINKS)
      set(XXHASH_HAS_DISPATCH TRUE)
    endif()
  endif()
  unset(_xxh_languages)
endif()

if(xxhash_FOUND AND NOT TARGET lynx::xxhash)
  add_library(lynx::xxhash INTERFACE IMPORTED)
  set_target_properties(lynx::xxhash PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${XXHASH_INCLUDE_DIR}")
  if(XXHASH_HAS_DISPATCH)
    set_target_properties(lynx::xxhash PROPERTIES
      INTERFACE_LINK_LIBRARIES "${XXHASH_LIBRARY}"
      INTERFACE_COMPILE_DEFINITIONS "LYNX_XXH3_DISPATCH=1")
  endif()
endif()
