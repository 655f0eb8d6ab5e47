// The Jinja interpreter's library: attribute and item access (with Python's str/dict/list
// methods), filters, tests and the globals range/namespace/dict/raise_exception/strftime_now
// (jinja_builtins.cpp, jinja_filters.cpp). Each throws jinja::Error on misuse. Internal to
// src/data's Jinja files.
#pragma once

#include <ctime>
#include <string>
#include <vector>

#include "data/jinja_value.h"

namespace strata::model::jinja {

// a.name as jinja2 resolves it: Python attribute first (methods such as dict.items, str.strip,
// bound to a), then the item; Undefined when neither exists (an error on an undefined a).
Value get_attr(const Value& obj, const std::string& name);
// a[key]: the item first, then (for a string key) the attribute.
Value get_item(const Value& obj, const Value& key);
// a[start:stop:step], Python's rules, for strings (by code point) and lists.
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// The elements a for loop or filter walks: list items, dict keys, string characters.
List iterate(const Value& v);
// len(v).
int64_t length(const Value& v);
// a < b as Python orders numbers, strings (by code point) and lists.
bool less(const Value& a, const Value& b);
// `a in b`.
bool contains(const Value& container, const Value& item);

Value call_filter(const std::string& name, const Value& operand, CallArgs& args);
bool call_test(const std::string& name, const Value& operand, CallArgs& args);

// range, namespace, dict, raise_exception and strftime_now (formatting `now`, local time).
Value global_function(const std::string& name, std::time_t now);

// Python's str methods on UTF-8 text (case mapping of ASCII letters only; strip by Unicode
// whitespace or by the characters of `chars` when it is a string).
std::string py_upper(std::string s);
std::string py_lower(std::string s);
std::string py_title(const std::string& s);
std::string py_capitalize(const std::string& s);
std::string strip(const std::string& s, const Value& chars, bool left, bool right);
std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count);
// v as an integer / a string, else an error naming `what`.
int64_t int_arg(const Value& v, const char* what);
const std::string& expect_string(const Value& v, const char* what);

// The argument `name` at `index` or given by keyword, else `fallback`; an error naming `what`
// for an unknown keyword is left to the callers, which know their parameters.
Value argument(CallArgs& args, size_t index, const char* name, Value fallback);

}  // namespace strata::model::jinja
