// YAML configuration checked against a schema. Every key a program accepts is declared once
// (type, default, allowed range or choices, one line of help); loading a file rejects unknown
// keys, keys given twice, wrong types and out-of-range values with a message naming the key, the
// file and the line. `key=value` overrides from the command line go through the same checks.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/status.h"

namespace YAML {
class Node;
}

namespace strata {

enum class ConfigType { kInt, kFloat, kBool, kString, kBytes, kStringList };

struct ConfigKey {
  std::string name;  // dotted path: "optim.lr" is `optim: {lr: ...}` in YAML
  ConfigType type = ConfigType::kString;
  std::string default_value;         // YAML text; empty list is "[]"
  std::optional<double> min, max;    // inclusive bounds for kInt, kFloat and kBytes
  std::vector<std::string> choices;  // allowed values for kString (empty = any)
  std::string help;
};

// The set of keys a program accepts. Keys are listed in --help in insertion order.
class ConfigSchema {
 public:
  ConfigSchema& add(ConfigKey key);
  const ConfigKey* find(const std::string& name) const;
  const std::vector<ConfigKey>& keys() const { return keys_; }
  // Closest key name by edit distance, for "did you mean" hints; empty when none is close.
  std::string suggest(const std::string& name) const;
  // One line per key: name, type, default, help.
  std::string help_text() const;

 private:
  std::vector<ConfigKey> keys_;
};

using ConfigValue = std::variant<int64_t, double, bool, std::string, std::vector<std::string>>;

// Validated values for every key of a schema. Copyable.
class Config {
 public:
  // `source` names the YAML text in messages (a path, or "<embedded default>"). `overrides`
  // are "key=value" strings applied after the YAML, in order.
  static Result<Config> parse(const ConfigSchema& schema, const std::string& yaml_text,
                              const std::string& source,
                              const std::vector<std::string>& overrides = {});
  // Reads `path` and parses it; a missing or unreadable file, or a directory, is an error naming it.
  static Result<Config> load_file(const ConfigSchema& schema, const std::string& path,
                                  const std::vector<std::string>& overrides = {});

  // REQUIRES: `name` is in the schema with the matching type (programmer error otherwise).
  int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  uint64_t get_bytes(const std::string& name) const;
  const std::vector<std::string>& get_list(const std::string& name) const;
  // True when the YAML or an override set the key (false when it holds its default).
  bool is_set(const std::string& name) const;
  // Where a key's value came from ("run.yaml:12", "command line", "default").
  std::string origin(const std::string& name) const;
  // The effective configuration as YAML (nested maps), for logs and run directories.
  std::string to_yaml() const;

 private:
  struct Entry {
    ConfigType type;
    ConfigValue value;
    std::string origin;
    bool set = false;
  };
  Status assign(const ConfigKey& key, const std::string& text, bool is_sequence,
                const std::vector<std::string>& items, const std::string& where);
  // Assigns every key of a parsed YAML document; refuses unknown, repeated and non-scalar keys.
  Status apply_yaml(const ConfigSchema& schema, const YAML::Node& root, const std::string& source);
  const Entry& entry(const std::string& name, ConfigType type) const;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;
};

}  // namespace strata
