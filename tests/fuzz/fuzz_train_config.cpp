// Fuzzes the training YAML (`strata train run.yaml`): Config::parse against the train schema,
// then make_train_config's cross-key checks. The last line of the input, when it holds '=',
// is also tried as a command-line override.
#include <cstdlib>
#include <vector>

#include "core/config.h"
#include "fuzz_util.h"
#include "train/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::string text(fuzz::as_view(data, size));
  fuzz::scratch_dir();  // quiets logging
  std::vector<std::string> overrides;
  const size_t last_line = text.rfind('\n');
  if (last_line != std::string::npos && text.find('=', last_line) != std::string::npos) {
    overrides.push_back(text.substr(last_line + 1));
  }
  auto config = Config::parse(train_schema(), text, "fuzz.yaml", overrides);
  if (!config.ok()) return 0;
  // What was accepted must print as YAML that parses to the same values.
  const std::string yaml = config->to_yaml();
  auto again = Config::parse(train_schema(), yaml, "round trip");
  if (!again.ok() || again->to_yaml() != yaml) abort();
  (void)make_train_config(*config);
  return 0;
}
