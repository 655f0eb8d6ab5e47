# The CLI tests run the strata binary; build it first.
if(TARGET test_tools)
  add_dependencies(test_tools strata)
endif()
