// The filters of the Jinja interpreter, each as jinja2 defines it (and tojson as transformers
// overrides it: json.dumps with ensure_ascii=False, no HTML escaping).
#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdlib>

#include "data/jinja_builtins.h"

namespace strata::model::jinja {
namespace {

// The value at a dotted attribute path ("function.name"), looked up as items first, as
// jinja2's attribute filters do.
Value attribute_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (cur.is_undefined()) return cur;
    const bool numeric = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
    cur = numeric ? get_item(cur, Value::integer(std::stoll(part))) : get_item(cur, Value::string(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return cur;
}

// select/reject(test, args...) and selectattr/rejectattr(attribute, test, args...).
Value select(const Value& seq, CallArgs& args, bool by_attribute, bool keep_matching) {
  size_t next = 0;
  std::string attr;
  if (by_attribute) attr = expect_string(argument(args, next++, "attribute", Value()), "selectattr");
  const Value test = argument(args, next++, "test", Value());
  CallArgs test_args;
  test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(std::min(next, args.positional.size())),
                              args.positional.end());
  List out;
  for (const Value& item : iterate(seq)) {
    const Value subject = by_attribute ? attribute_path(item, attr) : item;
    const bool hit = test.is_undefined() ? truthy(subject) : call_test(expect_string(test, "select's test"), subject, test_args);
    if (hit == keep_matching) out.push_back(item);
  }
  return Value::make_list(std::move(out));
}

// map(attribute='x', default=d) or map('filter', args...).
Value map(const Value& seq, CallArgs& args) {
  const Value attr = argument(args, 99, "attribute", Value());
  List out;
  if (attr.is_string()) {
    const Value fallback = argument(args, 99, "default", Value());
    for (const Value& item : iterate(seq)) {
      Value v = attribute_path(item, attr.s);
      out.push_back(v.is_undefined() && !fallback.is_undefined() ? fallback : v);
    }
    return Value::make_list(std::move(out));
  }
  const std::string name = expect_string(argument(args, 0, "filter", Value()), "map's filter");
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keyword = args.keyword;
  for (const Value& item : iterate(seq)) out.push_back(call_filter(name, item, rest));
  return Value::make_list(std::move(out));
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string indent(const std::string& s, const Value& width, bool first, bool blank) {
  const std::string pad = width.is_string() ? width.s : std::string(static_cast<size_t>(std::max<int64_t>(0, int_arg(width, "indent"))), ' ');
  std::vector<std::string> lines;
  size_t start = 0;
  while (true) {
    const size_t nl = s.find('\n', start);
    if (nl == std::string::npos) {
      lines.push_back(s.substr(start));
      break;
    }
    lines.push_back(s.substr(start, nl - start));
    start = nl + 1;
  }
  if (lines.size() > 1 && lines.back().empty()) lines.pop_back();  // Python's splitlines after s + "\n"
  std::string out = lines[0];
  for (size_t i = 1; i < lines.size(); ++i) out += "\n" + (lines[i].empty() && !blank ? std::string() : pad + lines[i]);
  return first ? pad + out : out;
}

// Sorting key for sort/unique/dictsort: strings lower-cased unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  return v.is_string() && !case_sensitive ? Value::string(py_lower(v.s)) : v;
}

Value sorted(const Value& seq, CallArgs& args) {
  const bool reverse = truthy(argument(args, 0, "reverse", Value::boolean(false)));
  const bool cs = truthy(argument(args, 1, "case_sensitive", Value::boolean(false)));
  const Value attr = argument(args, 2, "attribute", Value());
  List items = iterate(seq);
  auto key = [&](const Value& v) { return sort_key(attr.is_string() ? attribute_path(v, attr.s) : v, cs); };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? less(key(b), key(a)) : less(key(a), key(b));
  });
  return Value::make_list(std::move(items));
}

Value to_int(const Value& v, const Value& fallback) {
  switch (v.kind) {
    case Kind::kInt: return v;
    case Kind::kBool: return Value::integer(v.b);
    case Kind::kFloat:
      if (std::isfinite(v.f) && std::fabs(v.f) < 9.2e18) return Value::integer(static_cast<int64_t>(v.f));
      return fallback;
    case Kind::kString: {
      const std::string t = strip(v.s, Value::none(), true, true);
      char* end = nullptr;
      errno = 0;
      const long long i = std::strtoll(t.c_str(), &end, 10);
      if (!t.empty() && *end == '\0' && errno == 0) return Value::integer(i);
      const double f = std::strtod(t.c_str(), &end);
      if (!t.empty() && *end == '\0' && std::isfinite(f) && std::fabs(f) < 9.2e18) return Value::integer(static_cast<int64_t>(f));
      return fallback;
    }
    default: return fallback;
  }
}

Value to_float(const Value& v, const Value& fallback) {
  if (v.is_number()) return Value::number(v.as_double());
  if (v.is_string()) {
    const std::string t = strip(v.s, Value::none(), true, true);
    char* end = nullptr;
    const double f = std::strtod(t.c_str(), &end);
    if (!t.empty() && *end == '\0') return Value::number(f);
  }
  return fallback;
}

Value round_value(const Value& v, CallArgs& args) {
  if (!v.is_number()) throw Error(std::string("round needs a number, got ") + type_name(v));
  const int64_t precision = int_arg(argument(args, 0, "precision", Value::integer(0)), "round's precision");
  const std::string method = expect_string(argument(args, 1, "method", Value::string("common")), "round's method");
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * scale;
  double r;
  if (method == "ceil") r = std::ceil(x);
  else if (method == "floor") r = std::floor(x);
  else if (method == "common") r = std::nearbyint(x);  // Python's round(): half to even
  else throw Error("round's method must be common, ceil or floor");
  return Value::number(r / scale);
}

Value extreme(const Value& seq, CallArgs& args, bool want_max) {
  const bool cs = truthy(argument(args, 0, "case_sensitive", Value::boolean(false)));
  const Value attr = argument(args, 1, "attribute", Value());
  List items = iterate(seq);
  if (items.empty()) return Value::undefined("min/max of an empty sequence");
  auto key = [&](const Value& v) { return sort_key(attr.is_string() ? attribute_path(v, attr.s) : v, cs); };
  Value best = items[0];
  for (const Value& v : items) {
    if (want_max ? less(key(best), key(v)) : less(key(v), key(best))) best = v;
  }
  return best;
}

JsonStyle json_style(CallArgs& args) {
  JsonStyle style;
  const Value ind = argument(args, 0, "indent", Value::none());
  if (!ind.is_none()) style.indent = static_cast<int>(std::clamp<int64_t>(int_arg(ind, "tojson's indent"), 0, 64));
  style.item_separator = style.indent >= 0 ? "," : ", ";
  style.key_separator = ": ";
  const Value seps = argument(args, 99, "separators", Value::none());
  if (seps.is_list() && seps.list->size() == 2) {
    style.item_separator = expect_string((*seps.list)[0], "tojson's separators");
    style.key_separator = expect_string((*seps.list)[1], "tojson's separators");
  }
  style.sort_keys = truthy(argument(args, 99, "sort_keys", Value::boolean(false)));
  if (truthy(argument(args, 99, "ensure_ascii", Value::boolean(false)))) {
    throw Error("tojson(ensure_ascii=true) is outside the subset strata renders");
  }
  return style;
}

}  // namespace

Value call_filter(const std::string& name, const Value& v, CallArgs& args) {
  if (name == "trim") return Value::string(strip(to_str(v), argument(args, 0, "chars", Value::none()), true, true));
  if (name == "tojson") return Value::string(to_json(v, json_style(args)));
  if (name == "length" || name == "count") return Value::integer(length(v));
  if (name == "string") return Value::string(to_str(v));
  if (name == "safe") return v;
  if (name == "e" || name == "escape") return Value::string(html_escape(to_str(v)));
  if (name == "lower") return Value::string(py_lower(to_str(v)));
  if (name == "upper") return Value::string(py_upper(to_str(v)));
  if (name == "capitalize") return Value::string(py_capitalize(to_str(v)));
  if (name == "title") return Value::string(py_title(to_str(v)));
  if (name == "replace") {
    return Value::string(replace(to_str(v), to_str(argument(args, 0, "old", Value())), to_str(argument(args, 1, "new", Value())),
                                 int_arg(argument(args, 2, "count", Value::integer(-1)), "replace's count")));
  }
  if (name == "default" || name == "d") {
    const bool boolean = truthy(argument(args, 1, "boolean", Value::boolean(false)));
    const bool use_default = v.is_undefined() || (boolean && !truthy(v));
    return use_default ? argument(args, 0, "default_value", Value::string("")) : v;
  }
  if (name == "first" || name == "last") {
    List items = iterate(v);
    if (items.empty()) return Value::undefined(name + " of an empty sequence");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const std::string sep = to_str(argument(args, 0, "d", Value::string("")));
    const Value attr = argument(args, 1, "attribute", Value());
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      if (!first) out += sep;
      out += to_str(attr.is_string() ? attribute_path(item, attr.s) : item);
      first = false;
    }
    return Value::string(std::move(out));
  }
  if (name == "list") return Value::make_list(iterate(v));
  if (name == "items") {
    if (v.is_undefined()) return Value::make_list();
    if (!v.is_dict()) throw Error(std::string("items needs a mapping, got ") + type_name(v));
    List out;
    for (const auto& [k, val] : v.dict->items) out.push_back(Value::make_list({Value::string(k), val}));
    return Value::make_list(std::move(out));
  }
  if (name == "dictsort") {
    if (!v.is_dict()) throw Error(std::string("dictsort needs a mapping, got ") + type_name(v));
    const bool cs = truthy(argument(args, 0, "case_sensitive", Value::boolean(false)));
    List out;
    for (const auto& [k, val] : v.dict->items) out.push_back(Value::make_list({Value::string(k), val}));
    std::stable_sort(out.begin(), out.end(), [&](const Value& a, const Value& b) {
      return less(sort_key((*a.list)[0], cs), sort_key((*b.list)[0], cs));
    });
    return Value::make_list(std::move(out));
  }
  if (name == "int") return to_int(v, argument(args, 0, "default", Value::integer(0)));
  if (name == "float") return to_float(v, argument(args, 0, "default", Value::number(0)));
  if (name == "abs") {
    if (v.kind == Kind::kFloat) return Value::number(std::fabs(v.f));
    const int64_t i = int_arg(v, "abs");
    if (i == INT64_MIN) throw Error("integer arithmetic overflows 64 bits");
    return Value::integer(std::llabs(i));
  }
  if (name == "round") return round_value(v, args);
  if (name == "select" || name == "reject") return select(v, args, false, name == "select");
  if (name == "selectattr" || name == "rejectattr") return select(v, args, true, name == "selectattr");
  if (name == "map") return map(v, args);
  if (name == "reverse") {
    if (v.is_string()) {
      std::u32string t = decode(v.s);
      std::reverse(t.begin(), t.end());
      return Value::string(encode(t));
    }
    List items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "sort") return sorted(v, args);
  if (name == "unique") {
    const bool cs = truthy(argument(args, 0, "case_sensitive", Value::boolean(false)));
    List out;
    List keys;
    for (const Value& item : iterate(v)) {
      const Value k = sort_key(item, cs);
      if (std::none_of(keys.begin(), keys.end(), [&](const Value& seen) { return equal(seen, k); })) {
        keys.push_back(k);
        out.push_back(item);
      }
    }
    return Value::make_list(std::move(out));
  }
  if (name == "sum") {
    const Value attr = argument(args, 0, "attribute", Value());
    Value total = argument(args, 1, "start", Value::integer(0));
    for (const Value& item : iterate(v)) {
      const Value x = attr.is_string() ? attribute_path(item, attr.s) : item;
      if (!x.is_number() || !total.is_number()) throw Error("sum needs numbers");
      if (x.kind == Kind::kFloat || total.kind == Kind::kFloat) {
        total = Value::number(total.as_double() + x.as_double());
      } else {
        int64_t r;
        if (__builtin_add_overflow(int_arg(total, "sum"), int_arg(x, "sum"), &r)) throw Error("integer arithmetic overflows 64 bits");
        total = Value::integer(r);
      }
    }
    return total;
  }
  if (name == "max" || name == "min") return extreme(v, args, name == "max");
  if (name == "indent") {
    return Value::string(indent(to_str(v), argument(args, 0, "width", Value::integer(4)),
                                truthy(argument(args, 1, "first", Value::boolean(false))),
                                truthy(argument(args, 2, "blank", Value::boolean(false)))));
  }
  if (name == "wordcount") {
    int64_t words = 0;
    bool in_word = false;
    for (char32_t c : decode(to_str(v))) {
      const bool word_char = c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
      if (word_char && !in_word) ++words;
      in_word = word_char && !is_py_space(c);
    }
    return Value::integer(words);
  }
  throw Error("filter '" + name + "' is outside the Jinja subset strata renders");
}

}  // namespace strata::model::jinja
