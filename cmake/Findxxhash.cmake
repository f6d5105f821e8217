# Findxxhash — locate the xxHash header for header-only use.
#
# Lynx uses xxHash (XXH3-64 segment checksums) with `#define XXH_INLINE_ALL`
# before `#include <xxhash.h>`, so only the header is needed: no library is
# linked. Provides the IMPORTED INTERFACE target lynx::xxhash.
#
# Result variables: xxhash_FOUND, XXHASH_INCLUDE_DIR (cache), xxhash_VERSION.
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

if(xxhash_FOUND AND NOT TARGET lynx::xxhash)
  add_library(lynx::xxhash INTERFACE IMPORTED)
  set_target_properties(lynx::xxhash PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${XXHASH_INCLUDE_DIR}")
endif()
