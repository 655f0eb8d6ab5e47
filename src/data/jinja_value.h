// Values of the Jinja interpreter (jinja.h): what a chat template computes with. They behave as
// the Python objects jinja2 hands a template: lists and dicts are shared by reference (a slice of
// `messages` holds the same message dicts), strings are indexed by code point, and printing,
// `string` and `~` give Python's str() (True, None, ['a', 1]).
// Internal to src/data's Jinja files.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace strata::model::jinja {

// What the interpreter throws inside a render; jinja.cpp turns it into a Status naming the line.
// line 0: not known where it is raised (the evaluator adds the line of the node it was in).
struct Error : std::runtime_error {
  Error(std::string message, int line = 0) : std::runtime_error(std::move(message)), line(line) {}
  int line;
};

struct Value;
struct Dict;
using List = std::vector<Value>;

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};
// A macro, a global (range, namespace, ...) or a method bound to its object (s.strip).
struct Function {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                    // kString; kUndefined: the name that was not found
  std::shared_ptr<List> list;       // kList (tuples too)
  std::shared_ptr<Dict> dict;       // kDict (namespaces too)
  std::shared_ptr<Function> func;   // kFunction

  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value make_list(List items = {});
  static Value make_dict();
  static Value function(std::string name, std::function<Value(CallArgs&)> call);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  double as_double() const { return kind == Kind::kFloat ? f : static_cast<double>(kind == Kind::kBool ? b : i); }
};

// Keys keep their insertion order, as Python's dict does.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;

  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};

// Python's truth value.
bool truthy(const Value& v);
// Python's type names, for messages: "str", "list", "dict", "undefined", ...
const char* type_name(const Value& v);
// Python's str(): strings as they are, None as "None", lists and dicts as their repr.
std::string to_str(const Value& v);
// Python's repr(): 'a', ['a', 1], {'k': True}.
std::string to_repr(const Value& v);
// Python's float repr: 1.0, 0.1, 1e+16, 1e-05.
std::string float_repr(double v);
// ==, as Python compares (1 == 1.0 == True; lists and dicts element by element).
bool equal(const Value& a, const Value& b);

// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=sort_keys), as
// transformers' tojson filter calls it: separators (", ", ": ") without an indent and
// (",", ": ") with one, unless given. indent < 0: none.
struct JsonStyle {
  int indent = -1;
  std::string item_separator;
  std::string key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);

// A JSON document as template values (objects become dicts in the document's key order, arrays
// lists). Ordered: Python keeps a dict's insertion order, and tojson writes keys in it.
Value from_json(const nlohmann::ordered_json& j);

// UTF-8 text as code points and back: Python indexes strings by code point.
std::u32string decode(std::string_view s);
std::string encode(std::u32string_view s);
// Python's str.isspace() for one code point.
bool is_py_space(char32_t c);

}  // namespace strata::model::jinja
