# libFuzzer targets, one per input format (README.md). Built only with STRATA_FUZZ=ON, which
# needs clang; the parsing layers (STRATA_FUZZ_LAYERS) are then compiled with coverage feedback.
if(NOT STRATA_FUZZ)
  return()
endif()

set(STRATA_FUZZ_TARGETS
  safetensors safetensors_index manifest train_config model_config tokenizer token_files)
foreach(name ${STRATA_FUZZ_TARGETS})
  add_executable(fuzz_${name} ${CMAKE_CURRENT_LIST_DIR}/fuzz_${name}.cpp)
  target_link_libraries(fuzz_${name} PRIVATE strata_train)
  target_compile_options(fuzz_${name} PRIVATE -fsanitize=fuzzer)
  target_link_options(fuzz_${name} PRIVATE -fsanitize=fuzzer)
  # The committed corpus (seeds and past crashes) runs once as part of the suite: a quick
  # regression check; tests/fuzz/run.sh does the time-boxed fuzzing.
  add_test(NAME fuzz_${name}_corpus
           COMMAND fuzz_${name} -runs=0 ${CMAKE_CURRENT_LIST_DIR}/${name})
  set_tests_properties(fuzz_${name}_corpus PROPERTIES LABELS "fuzz" TIMEOUT 300)
endforeach()
