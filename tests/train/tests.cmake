# Chaos mode (STRATA_STREAM_CHAOS=SEED, core/cpu_device.h): the paging-invariance tests of the
# training state (tight budgets through host and nvme, expert paging, the fp8 and bf16 recipes,
# optimizer overlap, offloaded activations), ZeRO-2 and 3's collectives on the communication
# stream against the same collectives in line, and a save taken during training, again with every
# stream task (the model's compute stream's included) delayed at random and every device slot a
# chunk leaves poisoned with NaN. They must stay bitwise equal to the roomy runs.
# tests/memory's ChunkSpaceChaos.AMissingWaitIsCaught and
# PagedStateChaosTest.AMissingWaitForAMoveBreaksTheTightRunUnderChaos show that a removed wait
# fails this way. Release suite only (label slow): delays and sanitizers together would take most
# of CI's time. The suite runs seed 1, about four minutes of a core; STRATA_CHAOS_SEEDS="1;2;3"
# adds seeds (past the first without the NVMe-for-every-kind and expert-group runs, the longest),
# about three minutes each.
set(STRATA_CHAOS_SEEDS "1" CACHE STRING "Chaos-mode seeds the suite runs (a list, e.g. 1;2;3)")
if(TARGET test_train)
  foreach(seed ${STRATA_CHAOS_SEEDS})
    # The NVMe-for-every-kind runs under bf16 only: the fp32 runs page the same chunks, twice
    # the bytes. The fp8 recipe tests run the fp8 and bf16 recipes with int8 moments (as under
    # ThreadSanitizer): the streams and waits are the same code under every recipe.
    set(filter *Bitwise*:*SaveDuringTraining*:*OverlappedCollectives*:OverlappedExpertGroups.*-*NvmeEveryKindTest.*/fp32:*Fp8RecipeTest.*/fp8_bf16:*Fp8RecipeTest.*/fp32_bf16:*Fp8RecipeTest.*/fp8_fp32)
    if(NOT seed EQUAL 1)
      set(filter ${filter}:*NvmeEveryKindTest.*:OverlappedExpertGroups.*)
    endif()
    add_test(NAME chaos_paging_seed_${seed} COMMAND test_train --gtest_filter=${filter})
    # COST (about its seconds in the release suite): ctest -j starts the longest tests first, so
    # they run beside the many short ones instead of alone at the end.
    set(cost 160)
    if(NOT seed EQUAL 1)
      set(cost 110)
    endif()
    set_tests_properties(chaos_paging_seed_${seed} PROPERTIES
      LABELS "slow;chaos" TIMEOUT 600 COST ${cost} ENVIRONMENT "STRATA_STREAM_CHAOS=${seed}")
  endforeach()
endif()

# A 32K-token sequence through a small model on a small device (mlp_tiles_budget_test.cpp): about
# a minute and a half in the release suite, so release only (label slow), started first.
if(TARGET test_train)
  add_test(NAME long_sequence_32k COMMAND test_train --gtest_filter=MlpTilesBudget.A32KTokenSequence*)
  set_tests_properties(long_sequence_32k PROPERTIES
    LABELS slow TIMEOUT 600 COST 100 ENVIRONMENT "STRATA_CACHE_DIR=")
endif()
