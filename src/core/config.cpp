#include "core/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "core/units.h"

namespace strata {
namespace {

const char* type_name(ConfigType type) {
  switch (type) {
    case ConfigType::kInt: return "integer";
    case ConfigType::kFloat: return "number";
    case ConfigType::kBool: return "boolean";
    case ConfigType::kString: return "string";
    case ConfigType::kBytes: return "size (e.g. 24GiB)";
    case ConfigType::kStringList: return "list of strings";
  }
  return "?";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

bool parse_int(const std::string& s, int64_t* out) {
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && p == end && !s.empty();
}

bool parse_float(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(s.c_str(), &end);
  return errno == 0 && end == s.c_str() + s.size() && std::isfinite(*out);
}

bool parse_bool(const std::string& s, bool* out) {
  std::string l = s;
  std::transform(l.begin(), l.end(), l.begin(), ::tolower);
  if (l == "true" || l == "yes" || l == "on") *out = true;
  else if (l == "false" || l == "no" || l == "off") *out = false;
  else return false;
  return true;
}

std::string format_number(double v) { return format_shortest(v); }

std::string where_of(const std::string& source, const YAML::Node& node) {
  if (node.Mark().is_null()) return source;
  return source + ":" + std::to_string(node.Mark().line + 1);
}

}  // namespace

// ---------------------------------------------------------------------------------- schema

ConfigSchema& ConfigSchema::add(ConfigKey key) {
  CHECK_MSG(find(key.name) == nullptr, "duplicate config key " + key.name);
  keys_.push_back(std::move(key));
  return *this;
}

const ConfigKey* ConfigSchema::find(const std::string& name) const {
  for (const auto& k : keys_)
    if (k.name == name) return &k;
  return nullptr;
}

std::string ConfigSchema::suggest(const std::string& name) const {
  std::string best;
  size_t best_d = std::max<size_t>(3, name.size() / 3) + 1;
  for (const auto& k : keys_) {
    size_t d = edit_distance(name, k.name);
    // A key with the same last component in another section is a likely mix-up too.
    std::string leaf = k.name.substr(k.name.rfind('.') + 1);
    std::string given_leaf = name.substr(name.rfind('.') + 1);
    if (leaf == given_leaf) d = std::min<size_t>(d, 2);
    if (d < best_d) best_d = d, best = k.name;
  }
  return best;
}

std::string ConfigSchema::help_text() const {
  size_t width = 0;
  for (const auto& k : keys_) width = std::max(width, k.name.size());
  std::ostringstream os;
  std::string section;
  for (const auto& k : keys_) {
    std::string s = k.name.substr(0, k.name.find('.'));
    if (s != section) {
      section = s;
      os << "\n";
    }
    os << "  " << k.name << std::string(width + 2 - k.name.size(), ' ') << k.help;
    os << " [" << type_name(k.type);
    if (!k.choices.empty()) {
      os << ": ";
      for (size_t i = 0; i < k.choices.size(); ++i) os << (i ? "|" : "") << k.choices[i];
    }
    os << "; default " << (k.default_value.empty() ? "\"\"" : k.default_value) << "]\n";
  }
  return os.str();
}

// ---------------------------------------------------------------------------------- config

Status Config::assign(const ConfigKey& key, const std::string& text, bool is_sequence,
                      const std::vector<std::string>& items, const std::string& where) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument(where + ": key '" + key.name + "': " + why);
  };
  auto check_range = [&](double v) -> Status {
    if ((key.min && v < *key.min) || (key.max && v > *key.max)) {
      std::string range = key.min && key.max ? "between " + format_number(*key.min) + " and " + format_number(*key.max)
                          : key.min           ? "at least " + format_number(*key.min)
                                              : "at most " + format_number(*key.max);
      return bad("value " + text + " is out of range; it must be " + range);
    }
    return Status::OK();
  };
  // Every value is one line of text. A control character (a stray carriage return from an
  // editor, a NUL) would be kept by the parser but lost or changed when the config is written
  // back into the run dir, so it is refused here rather than resumed differently.
  auto control_char = [](const std::string& s) -> std::string {
    for (size_t i = 0; i < s.size(); ++i) {
      const auto c = static_cast<unsigned char>(s[i]);
      if ((c < 0x20 && c != '\t') || c == 0x7f) {
        char hex[8];
        snprintf(hex, sizeof hex, "0x%02x", c);
        return "byte " + std::to_string(i) + " is the control character " + hex;
      }
    }
    return "";
  };
  if (const std::string why = control_char(text); !why.empty())
    return bad(why + "; values are single lines of text (check the file's line endings)");
  for (size_t i = 0; i < items.size(); ++i) {
    // Named by position: the item's text holds the character and is not echoed.
    if (const std::string why = control_char(items[i]); !why.empty())
      return bad("list item " + std::to_string(i + 1) + ": " + why + "; values are single lines of text");
  }
  Entry e{key.type, {}, where, true};
  if (is_sequence && key.type != ConfigType::kStringList)
    return bad("expected a " + std::string(type_name(key.type)) + ", got a list");
  switch (key.type) {
    case ConfigType::kInt: {
      int64_t v;
      if (!parse_int(text, &v)) return bad("expected an integer, got '" + text + "'");
      RETURN_IF_ERROR(check_range(static_cast<double>(v)));
      e.value = v;
      break;
    }
    case ConfigType::kFloat: {
      double v;
      if (!parse_float(text, &v)) return bad("expected a number, got '" + text + "'");
      RETURN_IF_ERROR(check_range(v));
      e.value = v;
      break;
    }
    case ConfigType::kBool: {
      bool v;
      if (!parse_bool(text, &v)) return bad("expected true or false, got '" + text + "'");
      e.value = v;
      break;
    }
    case ConfigType::kString: {
      if (!key.choices.empty() &&
          std::find(key.choices.begin(), key.choices.end(), text) == key.choices.end()) {
        std::string all;
        for (const auto& c : key.choices) all += (all.empty() ? "" : ", ") + c;
        return bad("'" + text + "' is not one of: " + all);
      }
      e.value = text;
      break;
    }
    case ConfigType::kBytes: {
      Result<uint64_t> v = parse_bytes(text);
      if (!v.ok()) return bad(v.status().message());
      RETURN_IF_ERROR(check_range(static_cast<double>(*v)));
      e.value = static_cast<int64_t>(*v);
      break;
    }
    case ConfigType::kStringList: {
      e.value = is_sequence ? items : (text.empty() ? std::vector<std::string>{} : std::vector<std::string>{text});
      break;
    }
  }
  entries_[key.name] = std::move(e);
  return Status::OK();
}

Status Config::apply_yaml(const ConfigSchema& schema, const YAML::Node& root, const std::string& source) {
  // Walks nested maps; a dotted path that is a schema key takes the node as its value.
  std::vector<std::pair<std::string, YAML::Node>> stack;
  if (root && root.IsMap()) stack.emplace_back("", root);
  // Dotted names (sections and keys) already seen, with their line: yaml-cpp keeps a repeated
  // key in the map, and the later value would silently win.
  std::map<std::string, std::string> seen;
  while (!stack.empty()) {
    auto [prefix, node] = stack.back();
    stack.pop_back();
    for (auto it = node.begin(); it != node.end(); ++it) {
      // Copies: it->first and it->second are members of the iterator's temporary proxy, which
      // is gone after this statement; a reference bound to them would dangle.
      const YAML::Node key_node = it->first;
      const YAML::Node value = it->second;
      std::string where = where_of(source, key_node);
      if (!key_node.IsScalar())
        return Status::InvalidArgument(where + ": a setting's name must be a plain word, not a list or map" +
                                       (prefix.empty() ? "" : " (in section '" + prefix + "')"));
      const std::string name = prefix.empty() ? key_node.Scalar() : prefix + "." + key_node.Scalar();
      if (auto [first, inserted] = seen.emplace(name, where); !inserted)
        return Status::InvalidArgument(where + ": '" + name + "' is set twice (first at " + first->second +
                                       "); keep one");
      const ConfigKey* key = schema.find(name);
      if (key == nullptr) {
        bool is_section = false;
        for (const auto& k : schema.keys())
          if (k.name.rfind(name + ".", 0) == 0) is_section = true;
        if (is_section && value.IsMap()) {
          stack.emplace_back(name, value);
          continue;
        }
        if (is_section)
          return Status::InvalidArgument(where + ": '" + name + "' is a section; it takes a map of settings");
        std::string hint = schema.suggest(name);
        return Status::InvalidArgument(where + ": unknown key '" + name + "'" +
                                       (hint.empty() ? "" : " (did you mean '" + hint + "'?)") +
                                       "; `strata train --help` lists every key");
      }
      if (value.IsMap()) return Status::InvalidArgument(where + ": key '" + name + "': expected a " + type_name(key->type) + ", got a map");
      if (value.IsNull() && key->type != ConfigType::kString && key->type != ConfigType::kStringList)
        return Status::InvalidArgument(where + ": key '" + name + "' has no value");
      std::vector<std::string> items;
      if (value.IsSequence()) {
        for (const auto& item : value) {
          if (!item.IsScalar())
            return Status::InvalidArgument(where_of(source, item) + ": key '" + name + "': list items must be plain strings");
          items.push_back(item.as<std::string>());
        }
      }
      std::string text = value.IsScalar() ? value.as<std::string>() : "";
      RETURN_IF_ERROR(assign(*key, text, value.IsSequence(), items, where));
    }
  }
  return Status::OK();
}

Result<Config> Config::parse(const ConfigSchema& schema, const std::string& yaml_text,
                             const std::string& source, const std::vector<std::string>& overrides) {
  Config config;
  // Defaults first, so every key holds a valid value.
  for (const auto& key : schema.keys()) {
    config.order_.push_back(key.name);
    std::vector<std::string> items;
    bool seq = false;
    if (key.type == ConfigType::kStringList) {
      YAML::Node n = YAML::Load(key.default_value.empty() ? "[]" : key.default_value);
      for (const auto& it : n) items.push_back(it.as<std::string>());
      seq = true;
    }
    Status st = config.assign(key, key.default_value, seq, items, "default");
    CHECK_MSG(st.ok(), "bad default in schema: " + st.message());
    config.entries_[key.name].set = false;
  }

  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + (e.mark.is_null() ? "" : ":" + std::to_string(e.mark.line + 1)) +
                                   ": not valid YAML: " + e.msg);
  }
  if (root && !root.IsNull() && !root.IsMap())
    return Status::InvalidArgument(source + ": expected a map of settings at the top level");

  // The walk reads nodes with yaml-cpp conversions, which throw; none should escape, but any
  // that does becomes a message naming the file and line instead of an abort.
  try {
    RETURN_IF_ERROR(config.apply_yaml(schema, root, source));
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + (e.mark.is_null() ? "" : ":" + std::to_string(e.mark.line + 1)) +
                                   ": cannot read this setting: " + e.msg);
  }

  for (const auto& ov : overrides) {
    size_t eq = ov.find('=');
    if (eq == std::string::npos || eq == 0)
      return Status::InvalidArgument("command line: '" + ov + "' is not key=value (e.g. optim.lr=3e-4)");
    std::string name = ov.substr(0, eq), text = ov.substr(eq + 1);
    const ConfigKey* key = schema.find(name);
    if (key == nullptr) {
      std::string hint = schema.suggest(name);
      return Status::InvalidArgument("command line: unknown key '" + name + "'" +
                                     (hint.empty() ? "" : " (did you mean '" + hint + "'?)"));
    }
    std::vector<std::string> items;
    bool seq = false;
    if (key->type == ConfigType::kStringList) {
      if (!text.empty() && text.front() == '[') {
        try {
          YAML::Node n = YAML::Load(text);
          for (const auto& item : n) items.push_back(item.as<std::string>());
          seq = true;
        } catch (const YAML::Exception& e) {
          return Status::InvalidArgument("command line: key '" + name + "': not a valid list: " + e.msg);
        }
      }
    }
    RETURN_IF_ERROR(config.assign(*key, text, seq, items, "command line"));
  }
  return config;
}

Result<Config> Config::load_file(const ConfigSchema& schema, const std::string& path,
                                 const std::vector<std::string>& overrides) {
  // A directory opens as a stream that reads nothing, which would silently mean "all defaults".
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return Status::InvalidArgument("config file '" + path + "' is a directory; pass the YAML file inside it");
  std::ifstream in(path);
  if (!in) return Status::NotFound("config file '" + path + "' cannot be opened: " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::IOError("config file '" + path + "' could not be read: " + std::strerror(errno));
  return parse(schema, ss.str(), path, overrides);
}

const Config::Entry& Config::entry(const std::string& name, ConfigType type) const {
  auto it = entries_.find(name);
  CHECK_MSG(it != entries_.end(), "config key not in schema: " + name);
  CHECK_MSG(it->second.type == type, "config key read with the wrong type: " + name);
  return it->second;
}

int64_t Config::get_int(const std::string& name) const { return std::get<int64_t>(entry(name, ConfigType::kInt).value); }
double Config::get_float(const std::string& name) const { return std::get<double>(entry(name, ConfigType::kFloat).value); }
bool Config::get_bool(const std::string& name) const { return std::get<bool>(entry(name, ConfigType::kBool).value); }
const std::string& Config::get_string(const std::string& name) const {
  return std::get<std::string>(entry(name, ConfigType::kString).value);
}
uint64_t Config::get_bytes(const std::string& name) const {
  return static_cast<uint64_t>(std::get<int64_t>(entry(name, ConfigType::kBytes).value));
}
const std::vector<std::string>& Config::get_list(const std::string& name) const {
  return std::get<std::vector<std::string>>(entry(name, ConfigType::kStringList).value);
}
bool Config::is_set(const std::string& name) const {
  auto it = entries_.find(name);
  CHECK_MSG(it != entries_.end(), "config key not in schema: " + name);
  return it->second.set;
}
std::string Config::origin(const std::string& name) const {
  auto it = entries_.find(name);
  CHECK_MSG(it != entries_.end(), "config key not in schema: " + name);
  return it->second.origin;
}

namespace {

// Emits the keys in `names` (all sharing `prefix`) as nested maps, first-seen section order.
void emit_section(YAML::Emitter& out, const std::vector<std::string>& names, size_t prefix_len,
                  const std::function<void(YAML::Emitter&, const std::string&)>& emit_value) {
  out << YAML::BeginMap;
  std::vector<std::string> done;
  for (const auto& name : names) {
    std::string rest = name.substr(prefix_len);
    size_t dot = rest.find('.');
    if (dot == std::string::npos) {
      out << YAML::Key << rest << YAML::Value;
      emit_value(out, name);
      continue;
    }
    std::string section = rest.substr(0, dot);
    if (std::find(done.begin(), done.end(), section) != done.end()) continue;
    done.push_back(section);
    std::string sub_prefix = name.substr(0, prefix_len) + section + ".";
    std::vector<std::string> sub;
    for (const auto& n : names)
      if (n.rfind(sub_prefix, 0) == 0) sub.push_back(n);
    out << YAML::Key << section << YAML::Value;
    emit_section(out, sub, sub_prefix.size(), emit_value);
  }
  out << YAML::EndMap;
}

}  // namespace

std::string Config::to_yaml() const {
  YAML::Emitter out;
  emit_section(out, order_, 0, [this](YAML::Emitter& o, const std::string& name) {
    const Entry& e = entries_.at(name);
    std::visit([&](const auto& v) {
      using V = std::decay_t<decltype(v)>;
      if constexpr (std::is_same_v<V, std::vector<std::string>>) {
        o << YAML::Flow << YAML::BeginSeq;
        for (const auto& s : v) o << s;
        o << YAML::EndSeq;
      } else if constexpr (std::is_same_v<V, int64_t>) {
        if (e.type == ConfigType::kBytes) o << format_bytes(static_cast<uint64_t>(v));
        else o << v;
      } else if constexpr (std::is_same_v<V, double>) {
        o << format_shortest(v);  // 3e-3 prints as 0.003, and reads back as the same double
      } else {
        o << v;
      }
    }, e.value);
  });
  return out.c_str();
}

}  // namespace strata
