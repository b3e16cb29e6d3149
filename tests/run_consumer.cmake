# ctest driver (cmake -P): installs the build tree into BUILD_DIR/_install, then configures, builds
# and runs examples/consumer against that prefix only. Every step starts clean so a stale install
# or cache cannot hide a packaging bug.
foreach(var BUILD_DIR CONSUMER_SOURCE_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake needs -D${var}=...")
  endif()
endforeach()
set(prefix "${BUILD_DIR}/_install")
set(consumer_build "${BUILD_DIR}/_consumer")
if("${CONFIG}" STREQUAL "")
  set(CONFIG Release)
endif()

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "step failed (${rc}): ${cmd}")
  endif()
endfunction()

file(REMOVE_RECURSE "${prefix}" "${consumer_build}")
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}" --config "${CONFIG}")
step(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${consumer_build}" -G "${GENERATOR}"
     "-DCMAKE_BUILD_TYPE=${CONFIG}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
     "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"
     "-DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF")
step(${CMAKE_COMMAND} --build "${consumer_build}" --config "${CONFIG}")
find_program(consumer_exe consumer PATHS "${consumer_build}" "${consumer_build}/${CONFIG}"
             NO_DEFAULT_PATH REQUIRED)
# The installed library has no RPATH to its own runtime dependencies (e.g. libcudart); the
# consumer's RPATH covers only the prefix, so name the toolkit's library directory explicitly.
set(ld_path "${RUNTIME_DIRS}")
if(DEFINED ENV{LD_LIBRARY_PATH} AND NOT "$ENV{LD_LIBRARY_PATH}" STREQUAL "")
  set(ld_path "${ld_path}:$ENV{LD_LIBRARY_PATH}")
endif()
step(${CMAKE_COMMAND} -E env "LD_LIBRARY_PATH=${ld_path}" "${consumer_exe}")
