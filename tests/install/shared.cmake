# A shared libshmcast: configure and build the library alone, install it,
# build tests/install against it, run it, and check that the .so exports the
# public API only (no shmcast::detail, no Boost). At -O0: what is exported
# is the visibility's doing, not the optimizer's, and -O0 leaves every
# inline function out of line for the check to see. As a unity build: the
# library's 49 files parse the same Boost and standard headers, and in a
# few unity files they do it a few times instead of 49 (here 30 against 86
# CPU-s, the same 130 exported symbols; this test was the longest of a cold
# tiers stage). Should two files ever clash in one unity file, the build
# runs again file by file and says so: the check never fails for it.
file(REMOVE_RECURSE ${WORK})
foreach(unity ON OFF)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC} -B ${WORK}/lib -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
                          "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" -DCMAKE_UNITY_BUILD=${unity}
                          -DSHMCAST_BUILD_TESTS=OFF -DSHMCAST_BUILD_TOOLS=OFF -DSHMCAST_BUILD_BENCH=OFF
                          -DSHMCAST_BUILD_PYTHON=OFF -DSHMCAST_WITH_CUDA=OFF RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "configuring a shared libshmcast failed")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/lib -j2 RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE out)
  if(NOT rc)
    break()
  endif()
  if(unity)
    message(WARNING "the unity build of the shared libshmcast failed; building it file by file:\n${out}")
  else()
    message(FATAL_ERROR "building a shared libshmcast failed:\n${out}")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WORK}/lib --prefix ${WORK}/prefix RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "installing the shared libshmcast failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC}/tests/install -B ${WORK}/build -DCMAKE_PREFIX_PATH=${WORK}/prefix
                        -DCMAKE_BUILD_RPATH=${WORK}/prefix/lib RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configure against the installed shared package failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "build against the installed shared package failed")
endif()
file(GLOB so ${WORK}/prefix/lib*/libshmcast.so ${WORK}/prefix/lib*/*/libshmcast.so)
list(GET so 0 so)
get_filename_component(libdir ${so} DIRECTORY)
execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${libdir} ${WORK}/build/install_check
                RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(rc OR NOT out MATCHES "installed")
  message(FATAL_ERROR "install_check against the shared library failed: ${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${libdir} ${WORK}/build/fileio_check
                RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(rc OR NOT out MATCHES "fileio installed")
  message(FATAL_ERROR "fileio_check (static shmcast::fileio on the shared libshmcast) failed: ${out}")
endif()
execute_process(COMMAND nm -D -C --defined-only ${so} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "nm -D ${so} failed")
endif()
string(REGEX MATCHALL "[^\n]*(shmcast::detail|boost::)[^\n]*" leaked "${syms}")
list(LENGTH leaked n)
if(n GREATER 0)
  list(SUBLIST leaked 0 5 first)
  message(FATAL_ERROR "${so} exports ${n} internal symbols, e.g. ${first}")
endif()
string(REGEX MATCHALL "[^\n]* T [^\n]*shmcast::[^\n]*" api "${syms}")
list(LENGTH api napi)
message(STATUS "shared libshmcast: ${napi} exported shmcast:: functions, no shmcast::detail or boost:: symbols")
