# Quantize-on-send's CUDA part (engine/fp8_cuda.cpp, kernels/fp8.cu), included
# from lib/CMakeLists.txt; built like the delta kernels (delta_kernels.cmake:
# PTX for a virtual architecture, embedded with embed_ptx.cmake, loaded
# through the dlopened driver), with its own switch and symbol.
set(SHMCAST_FP8_KERNELS AUTO CACHE STRING "Build the FP8 quantize kernels with nvcc: ON, OFF or AUTO (when nvcc is found)")
set(SHMCAST_FP8_HAVE_KERNELS OFF)
if(SHMCAST_HAVE_CUDA)
  target_sources(shmcast PRIVATE core/engine/fp8_cuda.cpp)
  set(_fp8_nvcc "")
  if(NOT SHMCAST_FP8_KERNELS STREQUAL "OFF" AND CUDAToolkit_NVCC_EXECUTABLE AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
    set(_fp8_nvcc "${CUDAToolkit_NVCC_EXECUTABLE}")
  endif()
  if(_fp8_nvcc)
    set(_fp8_dir ${CMAKE_CURRENT_SOURCE_DIR}/core/engine/kernels)
    set(_fp8_ptx ${CMAKE_CURRENT_BINARY_DIR}/fp8.ptx)
    set(_fp8_cpp ${CMAKE_CURRENT_BINARY_DIR}/fp8_ptx.cpp)
    add_custom_command(OUTPUT ${_fp8_ptx}
      COMMAND ${_fp8_nvcc} -ptx -arch=${SHMCAST_DELTA_PTX_ARCH} -std=c++17 -O3 -o ${_fp8_ptx} ${_fp8_dir}/fp8.cu
      DEPENDS ${_fp8_dir}/fp8.cu
      COMMENT "nvcc: FP8 quantize kernels to PTX (${SHMCAST_DELTA_PTX_ARCH})" VERBATIM)
    add_custom_command(OUTPUT ${_fp8_cpp}
      COMMAND ${CMAKE_COMMAND} -DIN=${_fp8_ptx} -DOUT=${_fp8_cpp} -DSYMBOL=kFp8Ptx -DNS=shmcast::detail::quant
              -DSOURCE=fp8.cu -P ${_fp8_dir}/embed_ptx.cmake
      DEPENDS ${_fp8_ptx} ${_fp8_dir}/embed_ptx.cmake
      COMMENT "Embedding the FP8 quantize kernels' PTX" VERBATIM)
    target_sources(shmcast PRIVATE ${_fp8_cpp})
    set(SHMCAST_FP8_HAVE_KERNELS ON)
  elseif(SHMCAST_FP8_KERNELS STREQUAL "ON")
    message(FATAL_ERROR "SHMCAST_FP8_KERNELS=ON but nvcc was not found (set CUDAToolkit_ROOT)")
  else()
    target_sources(shmcast PRIVATE core/engine/kernels/fp8_ptx_none.cpp)
  endif()
else()
  target_sources(shmcast PRIVATE core/engine/fp8_cuda_none.cpp)
endif()
message(STATUS "shmcast: FP8 quantize CUDA kernels ${SHMCAST_FP8_HAVE_KERNELS}")
