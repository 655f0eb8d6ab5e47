#include "tools/strata/run_args.h"

#include <cstdio>

namespace strata::tools {

int parse_run_args(const std::vector<std::string>& args, const char* command, const char* usage, int64_t min_steps,
                   RunArgs* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      return 0;
    } else if (a == "--steps" || a.rfind("--steps=", 0) == 0) {
      const std::string text = a == "--steps" ? (i + 1 < args.size() ? args[++i] : "") : a.substr(8);
      size_t used = 0;
      try {
        out->steps = std::stoll(text, &used);
      } catch (...) {
        used = 0;
      }
      if (used == 0 || used != text.size() || out->steps < min_steps) {
        std::fprintf(stderr, "%s: error: --steps needs a whole number >= %lld, not '%s'\n", command,
                     static_cast<long long>(min_steps), text.c_str());
        return 2;
      }
    } else if (a.find('=') != std::string::npos && a[0] != '-') {
      out->overrides.push_back(a);
    } else if (!a.empty() && a[0] != '-' && out->config_path.empty()) {
      out->config_path = a;
    } else {
      std::fprintf(stderr, "%s: error: unexpected argument '%s' (see %s --help)\n", command, a.c_str(), command);
      return 2;
    }
  }
  return -1;
}

}  // namespace strata::tools
