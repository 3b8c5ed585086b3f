# The delta codec's CUDA part, included from lib/CMakeLists.txt.
#
# With the CUDA engine (cuda.h found) the codec's host side is
# core/engine/delta_cuda.cpp. Its kernels (kernels/delta.cu) are compiled to PTX by
# nvcc for SHMCAST_DELTA_PTX_ARCH, a virtual architecture (the driver
# compiles the PTX for the GPU it runs on, at first use, and caches it), and
# embedded as bytes (embed_ptx.cmake), so the library still links no CUDA
# library. Without nvcc the library has no kernels (kernels/delta_ptx_none.cpp)
# and every CUDA delta call says so (Errc::kCudaUnavailable). Without cuda.h
# there is no CUDA delta code at all (core/engine/delta_cuda_none.cpp).
#
# The PTX's ISA version is the nvcc's: a driver older than that nvcc's CUDA
# version cannot load it (the error says so); build with the oldest toolkit
# your drivers support.
set(SHMCAST_DELTA_PTX_ARCH "compute_75" CACHE STRING "Virtual GPU architecture of the delta kernels' PTX")
set(SHMCAST_DELTA_KERNELS AUTO CACHE STRING "Build the delta codec's CUDA kernels with nvcc: ON, OFF or AUTO (when nvcc is found)")
set(SHMCAST_DELTA_HAVE_KERNELS OFF)
if(SHMCAST_HAVE_CUDA)
  target_sources(shmcast PRIVATE core/engine/delta_cuda.cpp)
  set(_delta_nvcc "")
  if(NOT SHMCAST_DELTA_KERNELS STREQUAL "OFF" AND CUDAToolkit_NVCC_EXECUTABLE AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
    set(_delta_nvcc "${CUDAToolkit_NVCC_EXECUTABLE}")
  endif()
  if(_delta_nvcc)
    set(_delta_dir ${CMAKE_CURRENT_SOURCE_DIR}/core/engine/kernels)
    set(_delta_ptx ${CMAKE_CURRENT_BINARY_DIR}/delta.ptx)
    set(_delta_cpp ${CMAKE_CURRENT_BINARY_DIR}/delta_ptx.cpp)
    add_custom_command(OUTPUT ${_delta_ptx}
      COMMAND ${_delta_nvcc} -ptx -arch=${SHMCAST_DELTA_PTX_ARCH} -std=c++17 -O3
              -I${CMAKE_CURRENT_SOURCE_DIR}/core -o ${_delta_ptx} ${_delta_dir}/delta.cu
      DEPENDS ${_delta_dir}/delta.cu ${_delta_dir}/delta_batch.cuh ${CMAKE_CURRENT_SOURCE_DIR}/core/protocol/delta_format.hpp
      COMMENT "nvcc: delta kernels to PTX (${SHMCAST_DELTA_PTX_ARCH})" VERBATIM)
    add_custom_command(OUTPUT ${_delta_cpp}
      COMMAND ${CMAKE_COMMAND} -DIN=${_delta_ptx} -DOUT=${_delta_cpp} -P ${_delta_dir}/embed_ptx.cmake
      DEPENDS ${_delta_ptx} ${_delta_dir}/embed_ptx.cmake
      COMMENT "Embedding the delta kernels' PTX" VERBATIM)
    target_sources(shmcast PRIVATE ${_delta_cpp})
    set(SHMCAST_DELTA_HAVE_KERNELS ON)
  elseif(SHMCAST_DELTA_KERNELS STREQUAL "ON")
    message(FATAL_ERROR "SHMCAST_DELTA_KERNELS=ON but nvcc was not found (set CUDAToolkit_ROOT)")
  else()
    target_sources(shmcast PRIVATE core/engine/kernels/delta_ptx_none.cpp)
  endif()
else()
  target_sources(shmcast PRIVATE core/engine/delta_cuda_none.cpp)
endif()
message(STATUS "shmcast: delta CUDA kernels ${SHMCAST_DELTA_HAVE_KERNELS}")
