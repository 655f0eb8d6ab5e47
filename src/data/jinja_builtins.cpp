// Attribute and item access, Python's str/dict/list methods, tests and globals of the Jinja
// interpreter. Filters are in jinja_filters.cpp.
#include "data/jinja_builtins.h"

#include <algorithm>

namespace strata::model::jinja {

char ascii_upper(char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c; }
char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }

std::string py_upper(std::string s) {
  for (char& c : s) c = ascii_upper(c);
  return s;
}
std::string py_lower(std::string s) {
  for (char& c : s) c = ascii_lower(c);
  return s;
}

bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || static_cast<unsigned char>(c) >= 0x80; }

// str.title(): a letter after a non-letter is upper-cased, others lower-cased.
std::string py_title(const std::string& s) {
  std::string out;
  bool prev_letter = false;
  for (char c : s) {
    out += prev_letter ? ascii_lower(c) : ascii_upper(c);
    prev_letter = is_alpha(c);
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::string out = py_lower(s);
  if (!out.empty()) out[0] = ascii_upper(out[0]);
  return out;
}

const std::string& expect_string(const Value& v, const char* what) {
  if (!v.is_string()) throw Error(std::string(what) + " needs a string, got " + type_name(v));
  return v.s;
}

// str.strip/lstrip/rstrip: Unicode whitespace, or the characters of `chars`.
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::u32string text = decode(s);
  const std::u32string set = chars.is_string() ? decode(chars.s) : std::u32string();
  auto strip_it = [&](char32_t c) { return chars.is_string() ? set.find(c) != std::u32string::npos : is_py_space(c); };
  size_t b = 0, e = text.size();
  while (left && b < e && strip_it(text[b])) ++b;
  while (right && e > b && strip_it(text[e - 1])) --e;
  return encode(std::u32string_view(text).substr(b, e - b));
}

// str.split(sep=None, maxsplit=-1) and rsplit.
List split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  List parts;
  if (sep.is_none() || sep.is_undefined()) {  // runs of whitespace, none at the ends
    const std::u32string text = decode(s);
    std::vector<std::u32string> words;
    std::u32string word;
    for (char32_t c : text) {
      if (is_py_space(c)) {
        if (!word.empty()) words.push_back(std::move(word));
        word.clear();
      } else {
        word += c;
      }
    }
    if (!word.empty()) words.push_back(std::move(word));
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
      throw Error("split() with no separator and a maxsplit is outside the subset strata renders");
    }
    for (const auto& w : words) parts.push_back(Value::string(encode(w)));
    return parts;
  }
  const std::string& delim = expect_string(sep, "split's separator");
  if (delim.empty()) throw Error("split(): empty separator");
  std::vector<std::string> pieces;
  if (!from_right) {
    size_t start = 0;
    while (true) {
      const size_t at = s.find(delim, start);
      if (at == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(pieces.size()) >= maxsplit)) break;
      pieces.push_back(s.substr(start, at - start));
      start = at + delim.size();
    }
    pieces.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    std::vector<std::string> rev;
    while (true) {
      if (end < delim.size()) break;
      const size_t at = s.rfind(delim, end - delim.size());
      if (at == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(rev.size()) >= maxsplit)) break;
      rev.push_back(s.substr(at + delim.size(), end - at - delim.size()));
      end = at;
    }
    rev.push_back(s.substr(0, end));
    pieces.assign(rev.rbegin(), rev.rend());
  }
  for (auto& p : pieces) parts.push_back(Value::string(std::move(p)));
  return parts;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) throw Error("replace() with an empty pattern is outside the subset strata renders");
  std::string out;
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t at = s.find(from, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += to;
    start = at + from.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

bool affix(const std::string& s, const Value& arg, bool prefix) {
  auto one = [&](const std::string& a) {
    if (a.size() > s.size()) return false;
    return prefix ? s.compare(0, a.size(), a) == 0 : s.compare(s.size() - a.size(), a.size(), a) == 0;
  };
  if (arg.is_list()) {
    for (const Value& v : *arg.list) {
      if (one(expect_string(v, prefix ? "startswith" : "endswith"))) return true;
    }
    return false;
  }
  return one(expect_string(arg, prefix ? "startswith" : "endswith"));
}

int64_t int_arg(const Value& v, const char* what) {
  if (v.kind == Kind::kInt) return v.i;
  if (v.kind == Kind::kBool) return v.b;
  throw Error(std::string(what) + " needs an integer, got " + type_name(v));
}

// "{}".format(a, b): positional {} and {0} fields only.
std::string format(const std::string& f, const CallArgs& args) {
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] == '{' && i + 1 < f.size() && f[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (f[i] == '}' && i + 1 < f.size() && f[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (f[i] == '{') {
      const size_t close = f.find('}', i);
      if (close == std::string::npos) throw Error("format(): a '{' is never closed");
      const std::string field = f.substr(i + 1, close - i - 1);
      size_t index = next++;
      if (!field.empty()) {
        if (field.find_first_not_of("0123456789") != std::string::npos) {
          throw Error("format() field {" + field + "} is outside the subset strata renders (positional fields only)");
        }
        index = std::stoul(field);
      }
      if (index >= args.positional.size()) throw Error("format(): no argument for field " + std::to_string(index));
      out += to_str(args.positional[index]);
      i = close;
    } else {
      out += f[i];
    }
  }
  return out;
}

Value string_method(const Value& obj, const std::string& name) {
  const std::string s = obj.s;
  auto method = [&](std::function<Value(CallArgs&)> fn) { return Value::function(name, std::move(fn)); };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const bool l = name != "rstrip", r = name != "lstrip";
    return method([s, l, r](CallArgs& a) { return Value::string(strip(s, argument(a, 0, "chars", Value::none()), l, r)); });
  }
  if (name == "upper") return method([s](CallArgs&) { return Value::string(py_upper(s)); });
  if (name == "lower") return method([s](CallArgs&) { return Value::string(py_lower(s)); });
  if (name == "title") return method([s](CallArgs&) { return Value::string(py_title(s)); });
  if (name == "capitalize") return method([s](CallArgs&) { return Value::string(py_capitalize(s)); });
  if (name == "startswith" || name == "endswith") {
    const bool prefix = name == "startswith";
    return method([s, prefix](CallArgs& a) { return Value::boolean(affix(s, argument(a, 0, "prefix", Value::string("")), prefix)); });
  }
  if (name == "split" || name == "rsplit") {
    const bool right = name == "rsplit";
    return method([s, right](CallArgs& a) {
      return Value::make_list(split(s, argument(a, 0, "sep", Value::none()), int_arg(argument(a, 1, "maxsplit", Value::integer(-1)), "maxsplit"), right));
    });
  }
  if (name == "splitlines") {
    return method([s](CallArgs&) {
      List lines = split(s, Value::string("\n"), -1, false);
      if (!lines.empty() && lines.back().s.empty()) lines.pop_back();
      for (Value& l : lines) {
        if (!l.s.empty() && l.s.back() == '\r') l.s.pop_back();
      }
      return Value::make_list(std::move(lines));
    });
  }
  if (name == "replace") {
    return method([s](CallArgs& a) {
      return Value::string(replace(s, expect_string(argument(a, 0, "old", Value()), "replace"), expect_string(argument(a, 1, "new", Value()), "replace"),
                                   int_arg(argument(a, 2, "count", Value::integer(-1)), "replace's count")));
    });
  }
  if (name == "find" || name == "count") {
    const bool find = name == "find";
    return method([s, find](CallArgs& a) {
      const std::string sub = expect_string(argument(a, 0, "sub", Value()), find ? "find" : "count");
      if (find) {
        const size_t at = s.find(sub);
        return Value::integer(at == std::string::npos ? -1 : static_cast<int64_t>(decode(s.substr(0, at)).size()));
      }
      if (sub.empty()) return Value::integer(static_cast<int64_t>(decode(s).size()) + 1);
      int64_t n = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value::integer(n);
    });
  }
  if (name == "format") return method([s](CallArgs& a) { return Value::string(format(s, a)); });
  return Value::undefined(name);
}

Value dict_method(const Value& obj, const std::string& name) {
  auto d = obj.dict;
  if (name == "get") {
    return Value::function(name, [d](CallArgs& a) {
      const Value key = argument(a, 0, "key", Value());
      const Value* v = key.is_string() ? d->find(key.s) : nullptr;
      return v ? *v : argument(a, 1, "default", Value::none());
    });
  }
  if (name == "items" || name == "keys" || name == "values") {
    return Value::function(name, [d, name](CallArgs&) {
      List out;
      for (const auto& [k, v] : d->items) {
        if (name == "items") out.push_back(Value::make_list({Value::string(k), v}));
        else out.push_back(name == "keys" ? Value::string(k) : v);
      }
      return Value::make_list(std::move(out));
    });
  }
  return Value::undefined(name);
}

Value list_method(const Value& obj, const std::string& name) {
  auto l = obj.list;
  if (name == "index" || name == "count") {
    return Value::function(name, [l, name](CallArgs& a) {
      const Value x = argument(a, 0, "value", Value());
      int64_t n = 0;
      for (size_t i = 0; i < l->size(); ++i) {
        if (!equal((*l)[i], x)) continue;
        if (name == "index") return Value::integer(static_cast<int64_t>(i));
        ++n;
      }
      if (name == "index") throw Error(to_repr(x) + " is not in the list");
      return Value::integer(n);
    });
  }
  static const char* const kMutating[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update"};
  for (const char* m : kMutating) {
    if (name == m) throw Error("method '" + name + "' changes its object, which transformers' sandbox refuses too");
  }
  return Value::undefined(name);
}

// Python's index rules for one position: negative counts from the end.
int64_t normalise_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

Value argument(CallArgs& args, size_t index, const char* name, Value fallback) {
  if (index < args.positional.size()) return args.positional[index];
  for (const auto& [k, v] : args.keyword) {
    if (k == name) return v;
  }
  return fallback;
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Kind::kUndefined:
      throw Error("'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined (reading ." + name + " of it)");
    case Kind::kString: return string_method(obj, name);
    case Kind::kDict: {
      if (!obj.dict->is_namespace) {
        Value m = dict_method(obj, name);
        if (!m.is_undefined()) return m;
      }
      const Value* v = obj.dict->find(name);
      return v ? *v : Value::undefined(name);
    }
    case Kind::kList: return list_method(obj, name);
    default: return Value::undefined(name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) {
    throw Error("'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined (reading [" + to_repr(key) + "] of it)");
  }
  if (obj.is_dict()) {
    if (key.is_string()) {
      const Value* v = obj.dict->find(key.s);
      if (v) return *v;
      return obj.dict->is_namespace ? Value::undefined(key.s) : get_attr(obj, key.s).kind == Kind::kFunction ? get_attr(obj, key.s) : Value::undefined(key.s);
    }
    return Value::undefined(to_str(key));
  }
  if ((obj.is_list() || obj.is_string()) && (key.kind == Kind::kInt || key.kind == Kind::kBool)) {
    const int64_t n = length(obj);
    const int64_t i = normalise_index(key.kind == Kind::kInt ? key.i : key.b, n);
    if (i < 0 || i >= n) return Value::undefined("index " + std::to_string(key.i));
    if (obj.is_list()) return (*obj.list)[static_cast<size_t>(i)];
    return Value::string(encode(decode(obj.s).substr(static_cast<size_t>(i), 1)));
  }
  if (key.is_string()) return get_attr(obj, key.s);
  return Value::undefined(to_str(key));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step_v) {
  if (!obj.is_list() && !obj.is_string()) throw Error(std::string("cannot slice a ") + type_name(obj));
  const int64_t n = length(obj);
  const int64_t step = step_v.is_none() ? 1 : int_arg(step_v, "a slice step");
  if (step == 0) throw Error("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt, int64_t lo, int64_t hi) {
    if (v.is_none()) return dflt;
    int64_t i = normalise_index(int_arg(v, "a slice bound"), n);
    return std::clamp(i, lo, hi);
  };
  const int64_t b = step > 0 ? clamp(start, 0, 0, n) : clamp(start, n - 1, -1, n - 1);
  const int64_t e = step > 0 ? clamp(stop, n, 0, n) : clamp(stop, -1, -1, n - 1);
  std::vector<size_t> picks;
  for (int64_t i = b; step > 0 ? i < e : i > e; i += step) picks.push_back(static_cast<size_t>(i));
  if (obj.is_list()) {
    List out;
    for (size_t i : picks) out.push_back((*obj.list)[i]);
    return Value::make_list(std::move(out));
  }
  const std::u32string text = decode(obj.s);
  std::u32string out;
  for (size_t i : picks) out += text[i];
  return Value::string(encode(out));
}

List iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return {};
    case Kind::kList: return *v.list;
    case Kind::kDict: {
      List keys;
      for (const auto& [k, unused] : v.dict->items) keys.push_back(Value::string(k));
      return keys;
    }
    case Kind::kString: {
      List chars;
      for (char32_t c : decode(v.s)) chars.push_back(Value::string(encode(std::u32string(1, c))));
      return chars;
    }
    default: throw Error(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return static_cast<int64_t>(decode(v.s).size());
    case Kind::kList: return static_cast<int64_t>(v.list->size());
    case Kind::kDict: return static_cast<int64_t>(v.dict->items.size());
    default: throw Error(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return decode(a.s) < decode(b.s);
  if (a.is_list() && b.is_list()) {
    return std::lexicographical_compare(a.list->begin(), a.list->end(), b.list->begin(), b.list->end(), less);
  }
  throw Error(std::string("'<' not supported between '") + type_name(a) + "' and '" + type_name(b) + "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kString: return container.s.find(expect_string(item, "'in <string>'")) != std::string::npos;
    case Kind::kList:
      return std::any_of(container.list->begin(), container.list->end(), [&](const Value& v) { return equal(v, item); });
    case Kind::kDict: return item.is_string() && container.dict->find(item.s) != nullptr;
    case Kind::kUndefined: return false;
    default: throw Error(std::string("argument of type '") + type_name(container) + "' is not iterable");
  }
}

bool call_test(const std::string& name, const Value& v, CallArgs& args) {
  const Value arg = argument(args, 0, "value", Value());
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string();
  if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind == Kind::kInt;
  if (name == "float") return v.kind == Kind::kFloat;
  if (name == "boolean") return v.kind == Kind::kBool;
  if (name == "true") return v.kind == Kind::kBool && v.b;
  if (name == "false") return v.kind == Kind::kBool && !v.b;
  if (name == "callable") return v.kind == Kind::kFunction;
  if (name == "lower") return v.is_string() && py_lower(v.s) == v.s;
  if (name == "upper") return v.is_string() && py_upper(v.s) == v.s;
  if (name == "odd" || name == "even") return (int_arg(v, name.c_str()) % 2 != 0) == (name == "odd");
  if (name == "divisibleby") {
    const int64_t d = int_arg(arg, "divisibleby");
    return d != 0 && int_arg(v, "divisibleby") % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg);
  if (name == "ne") return !equal(v, arg);
  if (name == "lt") return less(v, arg);
  if (name == "gt") return less(arg, v);
  if (name == "le") return !less(arg, v);
  if (name == "ge") return !less(v, arg);
  if (name == "in") return contains(arg, v);
  if (name == "sameas") {
    if (v.kind != arg.kind) return false;
    if (v.is_list()) return v.list == arg.list;
    if (v.is_dict()) return v.dict == arg.dict;
    return equal(v, arg);
  }
  throw Error("test '" + name + "' is outside the Jinja subset strata renders");
}

Value global_function(const std::string& name, std::time_t now) {
  if (name == "raise_exception") {
    return Value::function(name, [](CallArgs& a) -> Value {
      throw Error("the template raised an exception: " + to_str(argument(a, 0, "message", Value::string(""))));
    });
  }
  if (name == "strftime_now") {
    return Value::function(name, [now](CallArgs& a) {
      const std::string fmt = expect_string(argument(a, 0, "format", Value()), "strftime_now");
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
  }
  if (name == "range") {
    return Value::function(name, [](CallArgs& a) {
      int64_t start = 0, stop, step = 1;
      if (a.positional.size() == 1) {
        stop = int_arg(a.positional[0], "range");
      } else if (a.positional.size() >= 2) {
        start = int_arg(a.positional[0], "range");
        stop = int_arg(a.positional[1], "range");
        if (a.positional.size() > 2) step = int_arg(a.positional[2], "range");
      } else {
        throw Error("range() needs a stop");
      }
      if (step == 0) throw Error("range() step must not be zero");
      constexpr int64_t kMaxRange = 1'000'000;
      const int64_t count = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                                     : (start > stop ? (start - stop - step - 1) / -step : 0);
      if (count > kMaxRange) throw Error("range() of " + std::to_string(count) + " numbers, more than the limit of 1000000");
      List out;
      for (int64_t i = 0; i < count; ++i) out.push_back(Value::integer(start + i * step));
      return Value::make_list(std::move(out));
    });
  }
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Value::function(name, [ns](CallArgs& a) {
      Value d = Value::make_dict();
      d.dict->is_namespace = ns;
      for (const Value& p : a.positional) {
        if (!p.is_dict()) throw Error(std::string(ns ? "namespace" : "dict") + "() takes a dict or name=value arguments");
        for (const auto& [k, v] : p.dict->items) d.dict->set(k, v);
      }
      for (const auto& [k, v] : a.keyword) d.dict->set(k, v);
      return d;
    });
  }
  return Value::undefined(name);
}

}  // namespace strata::model::jinja
