// The commands of the strata tool. Each returns the process exit code: 0 on success, 1 when
// the work failed (the reason printed as one line), 2 for a usage error.
#pragma once

#include <string>
#include <vector>

#include "core/version.h"

namespace strata::tools {

inline constexpr const char* kVersion = kStrataVersion;

int train_command(const std::vector<std::string>& args);
int bench_command(const std::vector<std::string>& args);
int convert_command(const std::vector<std::string>& args);
int plan_command(const std::vector<std::string>& args);
int profile_command(const std::vector<std::string>& args);
int data_command(const std::vector<std::string>& args);
int plot_command(const std::vector<std::string>& args);
int generate_command(const std::vector<std::string>& args);

}  // namespace strata::tools
