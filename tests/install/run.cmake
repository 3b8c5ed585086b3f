# cmake --install the build into a scratch prefix, then configure, build and
# run tests/install against it with find_package(shmcast CONFIG).
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BIN} --prefix ${WORK}/prefix --component Unspecified
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC}/tests/install -B ${WORK}/build -DCMAKE_PREFIX_PATH=${WORK}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configure against the installed package failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "build against the installed package failed")
endif()
execute_process(COMMAND ${WORK}/build/install_check RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(rc OR NOT out MATCHES "installed")
  message(FATAL_ERROR "install_check failed: ${out}")
endif()
