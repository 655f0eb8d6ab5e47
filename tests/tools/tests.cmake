# The CLI tests run the strata binary; build it first.
if(TARGET test_tools)
  add_dependencies(test_tools strata)
endif()

# The README's training command lines, run against a tiny model and tokenizer. Whole runs the
# release suite covers: labelled slow, so the sanitizer run (ctest -LE slow), where they took
# eight of its ten minutes' timeout, leaves them out.
add_test(NAME readme_examples
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/readme_examples.sh ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
# COST: started among the first (tests/train/tests.cmake says why).
set_tests_properties(readme_examples PROPERTIES LABELS "slow" TIMEOUT 600 COST 80 ENVIRONMENT "STRATA_CACHE_DIR=")

# tools/gpu_check.sh's dry run: its groups, timeouts, budget and summary, without a GPU.
add_test(NAME gpu_check_dry_run
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/gpu_check_test.sh ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
set_tests_properties(gpu_check_dry_run PROPERTIES LABELS "tools" TIMEOUT 120)

# Chaos mode (tests/train/tests.cmake) for what runs whole processes: data parallelism at world 2
# and 4 against one process, collectives overlapped on the communication stream against the same
# collectives in line (ZeRO-0 to 3), and resume bit for bit on other budgets and across recipes.
# One seed: each run starts strata several times.
if(TARGET test_tools)
  add_test(NAME chaos_cli_seed_1 COMMAND test_tools
           --gtest_filter=DataParallelTest.WorldTwoAndFourTrainTheOneProcessRunsGlobalBatch:DataParallelTest.OverlappedCollectivesAreTheBitsOfCollectivesInLine:CliTest.ResumeIsBitExactEvenWithOtherBudgets:CliTest.Bf16RecipeResumesBitExactlyAndAcrossRecipes)
  set_tests_properties(chaos_cli_seed_1 PROPERTIES
    LABELS "slow;chaos" TIMEOUT 600 COST 35 ENVIRONMENT "STRATA_STREAM_CHAOS=1")
endif()
