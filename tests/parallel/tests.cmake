# The multi-process Comm tests: test_parallel (comm_test.cpp) starts several copies of this
# worker, one per rank. Its source lives in a subfolder so that test_parallel's glob skips it.
add_executable(parallel_comm_worker ${CMAKE_CURRENT_LIST_DIR}/comm_worker/main.cpp)
target_link_libraries(parallel_comm_worker PRIVATE strata_parallel)
if(TARGET test_parallel)
  add_dependencies(test_parallel parallel_comm_worker)
  target_compile_definitions(test_parallel PRIVATE STRATA_COMM_WORKER="$<TARGET_FILE:parallel_comm_worker>")
endif()
