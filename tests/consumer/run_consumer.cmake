# Builds and runs tests/consumer against Lynx in one of three ways (cmake -P):
#
#   find_package      cmake --install <LYNX_BINARY_DIR> into WORK_DIR/prefix, then
#                     find_package(lynx CONFIG REQUIRED) with CMAKE_PREFIX_PATH
#   find_package_cuda the same, plus a .cu linked to lynx::cuda (COMPONENTS cuda)
#   add_subdirectory  add_subdirectory(<LYNX_SOURCE_DIR>)
#   fetchcontent      FetchContent_Declare(GIT_REPOSITORY file://...) redirected
#                     to the local source with FETCHCONTENT_SOURCE_DIR_LYNX
#
# Inputs: MODE LYNX_SOURCE_DIR LYNX_BINARY_DIR WORK_DIR GENERATOR CXX_COMPILER BUILD_TYPE
#         CUDA_COMPILER CUDA_ARCHITECTURES (find_package_cuda only)
#         CXX_FLAGS EXE_LINKER_FLAGS (the build's own, passed on to the consumer)
#         EXPECT_KERNELS EXPECT_UCX (find_package: the build had lynx::kernels / lynx::ucx,
#         so the install must provide them)
cmake_minimum_required(VERSION 3.25)

foreach(var MODE LYNX_SOURCE_DIR LYNX_BINARY_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${var} is not set")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

function(run_step what)
  message(STATUS "[consumer.${MODE}] ${what}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[consumer.${MODE}] ${what} failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(build_dir "${WORK_DIR}/build")
set(configure_args
  -S "${LYNX_SOURCE_DIR}/tests/consumer" -B "${build_dir}" -G "${GENERATOR}"
  "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
  "-DLYNX_CONSUMER_MODE=${MODE}"
  # the flags of the build under test (a sanitized lynx::kernels needs a sanitized link)
  "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${EXE_LINKER_FLAGS}")

if(MODE MATCHES "^find_package")
  set(prefix "${WORK_DIR}/prefix")
  run_step("install" "${CMAKE_COMMAND}" --install "${LYNX_BINARY_DIR}" --prefix "${prefix}"
    --config "${BUILD_TYPE}")
  if(NOT EXISTS "${prefix}/include/lynx/lynx.hpp")
    message(FATAL_ERROR "[consumer.${MODE}] install did not place include/lynx/lynx.hpp")
  endif()
  # Only the prefix may provide lynx (not the build tree's own export).
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${prefix}"
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
  if(MODE STREQUAL "find_package")
    list(APPEND configure_args "-DLYNX_EXPECT_KERNELS=${EXPECT_KERNELS}"
      "-DLYNX_EXPECT_UCX=${EXPECT_UCX}")
  endif()
  if(MODE STREQUAL "find_package_cuda")
    # One architecture is enough to prove the target works; keep nvcc time low.
    list(GET CUDA_ARCHITECTURES 0 arch)
    list(APPEND configure_args "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}"
      "-DCMAKE_CUDA_ARCHITECTURES=${arch}" -DLYNX_CONSUMER_CUDA=ON)
  endif()
# The source-tree modes skip the CUDA probe to stay fast; lynx::cuda from an
# install is covered by find_package (when this build has CUDA).
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND configure_args "-DLYNX_SOURCE_DIR=${LYNX_SOURCE_DIR}" -DLYNX_ENABLE_CUDA=OFF)
elseif(MODE STREQUAL "fetchcontent")
  list(APPEND configure_args "-DLYNX_SOURCE_DIR=${LYNX_SOURCE_DIR}"
    "-DFETCHCONTENT_SOURCE_DIR_LYNX=${LYNX_SOURCE_DIR}" -DLYNX_ENABLE_CUDA=OFF)
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()

run_step("configure" "${CMAKE_COMMAND}" ${configure_args})
run_step("build" "${CMAKE_COMMAND}" --build "${build_dir}" --config "${BUILD_TYPE}")
set(exes consumer)
if(MODE STREQUAL "find_package_cuda")
  list(APPEND exes consumer_cuda)
endif()
if(MODE STREQUAL "find_package" AND EXPECT_KERNELS)
  list(APPEND exes consumer_kernels)
endif()
if(MODE STREQUAL "find_package" AND EXPECT_UCX)
  list(APPEND exes consumer_ucx)
endif()
foreach(exe IN LISTS exes)
  find_program(exe_path_${exe} ${exe} PATHS "${build_dir}" "${build_dir}/${BUILD_TYPE}"
    NO_DEFAULT_PATH NO_CACHE REQUIRED)
  # consumer_cuda runs host code only (no kernel launch), so it needs no GPU.
  run_step("run ${exe}" "${exe_path_${exe}}")
endforeach()
message(STATUS "[consumer.${MODE}] OK")
