// The Jinja evaluator: runs the statement tree of jinja_parser.cpp. Scoping follows jinja2: a
// for-loop body and a macro body are scopes of their own (a `set` inside a loop does not leak
// out, which is why templates use namespace()), `if` is not.
#include <cmath>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "data/jinja.h"
#include "data/jinja_ast.h"
#include "data/jinja_builtins.h"

namespace strata::model {
namespace jinja {
namespace {

using Frame = std::unordered_map<std::string, Value>;
enum class Flow : uint8_t { kNormal, kBreak, kContinue };

// Python's integer arithmetic on int64, refusing what would overflow.
int64_t checked_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw Error("integer arithmetic overflows 64 bits");
  return r;
}
int64_t checked_sub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) throw Error("integer arithmetic overflows 64 bits");
  return r;
}
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Error("integer arithmetic overflows 64 bits");
  return r;
}

class Evaluator {
 public:
  Evaluator(const JinjaOptions& options, std::string* out) : options_(options), out_(out), root_(out) {
    now_ = options.now ? *options.now : std::time(nullptr);
    frames_.emplace_back();
  }

  void define(const std::string& name, Value v) { frames_.front()[name] = std::move(v); }
  void track(const Value& list, std::vector<ByteSpan>* spans) {
    spans->assign(list.list->size(), ByteSpan{0, 0});
    for (size_t i = 0; i < list.list->size(); ++i) {
      if ((*list.list)[i].is_dict()) tracked_[(*list.list)[i].dict.get()] = i;
    }
    spans_ = spans;
  }
  int line() const { return line_; }

  Flow exec(const Body& body) {
    for (const NodePtr& n : body) {
      const Flow f = exec(*n);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

 private:
  // ---- statements ----
  Flow exec(const Node& n) {
    line_ = n.line;
    step();
    switch (n.kind) {
      case Node::Kind::kText: write(n.text); break;
      case Node::Kind::kOutput: write(to_str(eval(*n.expr))); break;
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches) {
          if (truthy(eval(*cond))) return exec(body);
          line_ = n.line;
        }
        return exec(n.else_body);
      case Node::Kind::kFor: for_loop(n); break;
      case Node::Kind::kSet: assign(n); break;
      case Node::Kind::kSetBlock: frames_.back()[n.name] = Value::string(capture(n.body)); break;
      case Node::Kind::kMacro: frames_.back()[n.name] = macro(n, nullptr); break;
      case Node::Kind::kCallBlock: call_block(n); break;
      case Node::Kind::kFilterBlock: {
        CallArgs args = arguments(*n.expr, 1);
        write(to_str(call_filter(n.expr->name, Value::string(capture(n.body)), args)));
        break;
      }
      case Node::Kind::kBreak: return Flow::kBreak;
      case Node::Kind::kContinue: return Flow::kContinue;
      case Node::Kind::kGeneration: return exec(n.body);
    }
    return Flow::kNormal;
  }

  void write(const std::string& s) {
    total_ += s.size();
    if (total_ > options_.max_output_bytes) {
      throw Error("the output passes the limit of " + std::to_string(options_.max_output_bytes) + " bytes");
    }
    out_->append(s);
  }

  void step() {
    if (++steps_ > options_.max_steps) {
      throw Error("the template takes more than " + std::to_string(options_.max_steps) +
                  " steps (a loop too long for a chat template?)");
    }
  }

  // Renders body into a string of its own (set blocks, macros, caller()).
  std::string capture(const Body& body) {
    std::string buffer;
    std::string* saved = out_;
    out_ = &buffer;
    try {
      exec(body);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buffer;
  }

  void assign(const Node& n) {
    Value v = eval(*n.expr);
    if (n.attr.empty()) {
      frames_.back()[n.name] = std::move(v);
      return;
    }
    Value ns = lookup(n.name);
    if (!ns.is_dict() || !ns.dict->is_namespace) {
      throw Error("set " + n.name + "." + n.attr + ": " + n.name + " is not a namespace() (it is " + type_name(ns) + ")");
    }
    ns.dict->set(n.attr, std::move(v));
  }

  Value lookup(const std::string& name) {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto found = it->find(name);
      if (found != it->end()) return found->second;
    }
    static const char* const kGlobals[] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};
    for (const char* g : kGlobals) {
      if (name == g) return global_function(name, now_);
    }
    return Value::undefined(name);
  }

  void for_loop(const Node& n) {
    List items = iterate(eval(*n.expr));
    if (n.cond) {  // the filter sees each item bound to the targets, as jinja2's does
      List kept;
      for (const Value& item : items) {
        frames_.emplace_back();
        bind(n, item);
        const bool keep = truthy(eval(*n.cond));
        frames_.pop_back();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(n.else_body);
      return;
    }
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < count; ++i) {
      step();
      frames_.emplace_back();
      bind(n, items[static_cast<size_t>(i)]);
      frames_.back()["loop"] = loop_value(items, i);
      const size_t begin = out_->size();
      const Flow f = exec(n.body);
      record(items[static_cast<size_t>(i)], begin);
      frames_.pop_back();
      if (f == Flow::kBreak) break;
    }
  }

  void bind(const Node& n, const Value& item) {
    if (n.targets.size() == 1) {
      frames_.back()[n.targets[0]] = item;
      return;
    }
    List parts = iterate(item);
    if (parts.size() != n.targets.size()) {
      throw Error("for " + std::to_string(n.targets.size()) + " names: an item has " + std::to_string(parts.size()) +
                  " values to unpack");
    }
    for (size_t k = 0; k < parts.size(); ++k) frames_.back()[n.targets[k]] = parts[k];
  }

  Value loop_value(const List& items, int64_t i) {
    const int64_t count = static_cast<int64_t>(items.size());
    Value loop = Value::make_dict();
    Dict& d = *loop.dict;
    d.set("index", Value::integer(i + 1));
    d.set("index0", Value::integer(i));
    d.set("revindex", Value::integer(count - i));
    d.set("revindex0", Value::integer(count - i - 1));
    d.set("first", Value::boolean(i == 0));
    d.set("last", Value::boolean(i == count - 1));
    d.set("length", Value::integer(count));
    d.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("loop.previtem"));
    d.set("nextitem", i + 1 < count ? items[static_cast<size_t>(i + 1)] : Value::undefined("loop.nextitem"));
    return loop;
  }

  // The output of one iteration over a tracked dict, when written at the top level.
  void record(const Value& item, size_t begin) {
    if (!spans_ || out_ != root_ || !item.is_dict() || out_->size() == begin) return;
    auto it = tracked_.find(item.dict.get());
    if (it != tracked_.end()) (*spans_)[it->second] = {static_cast<uint32_t>(begin), static_cast<uint32_t>(out_->size())};
  }

  Value macro(const Node& n, const Body* caller_body) {
    const Node* def = &n;
    return Value::function(n.name, [this, def, caller_body](CallArgs& args) { return call_macro(*def, args, caller_body); });
  }

  Value call_macro(const Node& def, CallArgs& args, const Body* caller_body) {
    if (++call_depth_ > options_.max_call_depth) {
      throw Error("macro calls nest deeper than " + std::to_string(options_.max_call_depth));
    }
    Frame frame;
    if (args.positional.size() > def.params.size()) {
      throw Error("macro " + def.name + " takes " + std::to_string(def.params.size()) + " arguments, given " +
                  std::to_string(args.positional.size()));
    }
    for (size_t k = 0; k < def.params.size(); ++k) {
      Value v = argument(args, k, def.params[k].c_str(), Value::undefined(def.params[k]));
      if (v.is_undefined() && def.defaults[k]) v = eval(*def.defaults[k]);
      frame[def.params[k]] = std::move(v);
    }
    if (caller_body) {  // caller() runs its body in the scope of the {% call %}, as a closure
      auto scope = std::make_shared<std::vector<Frame>>(frames_);
      frame["caller"] = Value::function("caller", [this, caller_body, scope](CallArgs&) {
        frames_.swap(*scope);
        std::string text;
        try {
          text = capture(*caller_body);
        } catch (...) {
          frames_.swap(*scope);
          throw;
        }
        frames_.swap(*scope);
        return Value::string(std::move(text));
      });
    }
    // A macro sees the template's top-level variables and its own, not its caller's locals.
    std::vector<Frame> saved;
    saved.swap(frames_);
    frames_.push_back(saved.front());
    frames_.push_back(std::move(frame));
    std::string text;
    try {
      text = capture(def.body);
    } catch (...) {
      frames_.swap(saved);
      --call_depth_;
      throw;
    }
    frames_.swap(saved);
    --call_depth_;
    return Value::string(std::move(text));
  }

  void call_block(const Node& n) {
    const Expr& call = *n.expr;
    Value callee = eval(*call.kids[0]);
    if (callee.kind != Kind::kFunction) throw Error("{% call %} of something that is not a macro");
    CallArgs args = arguments(call, 1);
    Value with_caller = macro_with_caller(callee, n);
    write(to_str(with_caller.func->call(args)));
  }

  // The macro callee again, now giving its body `caller`.
  Value macro_with_caller(const Value& callee, const Node& call_node) {
    auto found = macros_by_name(callee.func->name);
    if (!found) throw Error("{% call %} of '" + callee.func->name + "', which is not a macro of this template");
    const Node* def = found;
    const Body* body = &call_node.body;
    return Value::function(def->name, [this, def, body](CallArgs& args) { return call_macro(*def, args, body); });
  }

 public:
  void register_macros(const Body& body) {
    for (const NodePtr& n : body) {
      if (n->kind == Node::Kind::kMacro) macro_defs_[n->name] = n.get();
    }
  }

 private:
  const Node* macros_by_name(const std::string& name) const {
    auto it = macro_defs_.find(name);
    return it == macro_defs_.end() ? nullptr : it->second;
  }

  // ---- expressions ----
  CallArgs arguments(const Expr& e, size_t first) {
    CallArgs args;
    for (size_t k = 0; k < e.positional; ++k) {
      const Expr& arg = *e.kids[first + k];
      if (arg.op == Expr::Op::kList && arg.name == "*") {
        for (Value& v : iterate(eval(*arg.kids[0]))) args.positional.push_back(std::move(v));
      } else {
        args.positional.push_back(eval(arg));
      }
    }
    for (size_t k = 0; k < e.keywords.size(); ++k) {
      args.keyword.emplace_back(e.keywords[k], eval(*e.kids[first + e.positional + k]));
    }
    return args;
  }

  Value eval(const Expr& e) {
    step();
    if (++depth_ > kMaxParseDepth * 4) throw Error("expressions nest too deeply");
    struct Leave {
      int* d;
      ~Leave() { --*d; }
    } leave{&depth_};
    line_ = e.line;
    switch (e.op) {
      case Expr::Op::kLiteral: return e.value;  // scalars only: list and dict literals are kList/kDict
      case Expr::Op::kName: return lookup(e.name);
      case Expr::Op::kAttr: return get_attr(eval(*e.kids[0]), e.name);
      case Expr::Op::kItem: return get_item(eval(*e.kids[0]), eval(*e.kids[1]));
      case Expr::Op::kSlice: {
        Value obj = eval(*e.kids[0]);
        auto bound = [&](size_t k) { return e.kids[k] ? eval(*e.kids[k]) : Value::none(); };
        return slice(obj, bound(1), bound(2), bound(3));
      }
      case Expr::Op::kCall: return call(e);
      case Expr::Op::kFilter: {
        Value operand = eval(*e.kids[0]);
        CallArgs args = arguments(e, 1);
        return call_filter(e.name, operand, args);
      }
      case Expr::Op::kTest: {
        Value operand = eval(*e.kids[0]);
        CallArgs args = arguments(e, 1);
        return Value::boolean(call_test(e.name, operand, args) != e.negated);
      }
      case Expr::Op::kNeg: return negate(eval(*e.kids[0]));
      case Expr::Op::kPos: return eval(*e.kids[0]);
      case Expr::Op::kNot: return Value::boolean(!truthy(eval(*e.kids[0])));
      case Expr::Op::kAnd: {
        Value l = eval(*e.kids[0]);
        return truthy(l) ? eval(*e.kids[1]) : l;
      }
      case Expr::Op::kOr: {
        Value l = eval(*e.kids[0]);
        return truthy(l) ? l : eval(*e.kids[1]);
      }
      case Expr::Op::kBinary: return binary(e.name, eval(*e.kids[0]), eval(*e.kids[1]));
      case Expr::Op::kCompare: return compare(e);
      case Expr::Op::kCond:
        if (truthy(eval(*e.kids[0]))) return eval(*e.kids[1]);
        return e.kids[2] ? eval(*e.kids[2]) : Value::undefined();
      case Expr::Op::kList: {
        List items;
        for (const ExprPtr& k : e.kids) items.push_back(eval(*k));
        return Value::make_list(std::move(items));
      }
      case Expr::Op::kDict: {
        Value d = Value::make_dict();
        for (size_t k = 0; k < e.keys.size(); ++k) d.dict->set(e.keys[k], eval(*e.kids[k]));
        return d;
      }
    }
    return Value::undefined();
  }

  Value call(const Expr& e) {
    Value callee = eval(*e.kids[0]);
    if (callee.kind != Kind::kFunction) {
      std::string what = e.kids[0]->op == Expr::Op::kName ? "'" + e.kids[0]->name + "'"
                         : e.kids[0]->op == Expr::Op::kAttr ? "method '" + e.kids[0]->name + "'"
                                                            : "this";
      if (callee.is_undefined()) throw Error("function " + what + " is outside the Jinja subset strata renders");
      throw Error(what + " is a " + type_name(callee) + ", not something to call");
    }
    CallArgs args = arguments(e, 1);
    return callee.func->call(args);
  }

  static Value negate(const Value& v) {
    if (v.kind == Kind::kFloat) return Value::number(-v.f);
    if (v.kind == Kind::kInt || v.kind == Kind::kBool) {
      return Value::integer(checked_sub(0, v.kind == Kind::kInt ? v.i : v.b));
    }
    throw Error(std::string("bad operand type for unary -: '") + type_name(v) + "'");
  }

  Value binary(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") return Value::string(to_str(a) + to_str(b));
    if (op == "+" && a.is_string() && b.is_string()) return Value::string(a.s + b.s);
    if (op == "+" && a.is_list() && b.is_list()) {
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return Value::make_list(std::move(items));
    }
    if (op == "*" && ((a.is_string() && b.kind == Kind::kInt) || (a.kind == Kind::kInt && b.is_string()))) {
      const Value& s = a.is_string() ? a : b;
      const int64_t n = a.is_string() ? b.i : a.i;
      if (n > 0 && s.s.size() * static_cast<size_t>(n) > options_.max_output_bytes) {
        throw Error("a string repeated past the output limit");
      }
      std::string r;
      for (int64_t k = 0; k < n; ++k) r += s.s;
      return Value::string(std::move(r));
    }
    if (!a.is_number() || !b.is_number()) {
      throw Error("unsupported operand types for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
    }
    return arithmetic(op, a, b);
  }

  static Value arithmetic(const std::string& op, const Value& a, const Value& b) {
    const bool ints = a.kind != Kind::kFloat && b.kind != Kind::kFloat;
    const int64_t x = a.kind == Kind::kBool ? a.b : a.i;
    const int64_t y = b.kind == Kind::kBool ? b.b : b.i;
    const double fx = a.as_double(), fy = b.as_double();
    if (op == "+") return ints ? Value::integer(checked_add(x, y)) : Value::number(fx + fy);
    if (op == "-") return ints ? Value::integer(checked_sub(x, y)) : Value::number(fx - fy);
    if (op == "*") return ints ? Value::integer(checked_mul(x, y)) : Value::number(fx * fy);
    if ((op == "/" || op == "//" || op == "%") && (ints ? y == 0 : fy == 0)) throw Error("division by zero");
    if (op == "/") return Value::number(fx / fy);
    if (op == "//") {
      if (!ints) return Value::number(std::floor(fx / fy));
      if (x == INT64_MIN && y == -1) throw Error("integer arithmetic overflows 64 bits");
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return Value::integer(q);
    }
    if (op == "%") {
      if (!ints) {
        double m = std::fmod(fx, fy);
        if (m != 0 && ((m < 0) != (fy < 0))) m += fy;
        return Value::number(m);
      }
      if (y == -1) return Value::integer(0);
      int64_t m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value::integer(m);
    }
    // **
    if (ints && y >= 0) {
      int64_t acc = 1;
      for (int64_t k = 0; k < y; ++k) {
        acc = checked_mul(acc, x);
        if (acc == 0 || acc == 1) break;
      }
      return Value::integer(acc);
    }
    return Value::number(std::pow(fx, fy));
  }

  Value compare(const Expr& e) {
    Value left = eval(*e.kids[0]);
    for (size_t k = 0; k < e.ops.size(); ++k) {
      Value right = eval(*e.kids[k + 1]);
      const std::string& op = e.ops[k];
      bool r;
      if (op == "==") r = equal(left, right);
      else if (op == "!=") r = !equal(left, right);
      else if (op == "<") r = less(left, right);
      else if (op == ">") r = less(right, left);
      else if (op == "<=") r = !less(right, left);
      else if (op == ">=") r = !less(left, right);
      else if (op == "in") r = contains(right, left);
      else r = !contains(right, left);
      if (!r) return Value::boolean(false);
      left = std::move(right);
    }
    return Value::boolean(true);
  }

  const JinjaOptions& options_;
  std::string* out_;
  std::string* root_;
  std::vector<Frame> frames_;
  std::unordered_map<std::string, const Node*> macro_defs_;
  std::unordered_map<const Dict*, size_t> tracked_;
  std::vector<ByteSpan>* spans_ = nullptr;
  std::time_t now_;
  size_t total_ = 0;
  int64_t steps_ = 0;
  int depth_ = 0;
  int call_depth_ = 0;
  int line_ = 1;
};

void collect_macros(const Body& body, Evaluator* ev) {
  ev->register_macros(body);
  for (const NodePtr& n : body) {
    for (const auto& [cond, b] : n->branches) collect_macros(b, ev);
    collect_macros(n->body, ev);
    collect_macros(n->else_body, ev);
  }
}

}  // namespace
}  // namespace jinja

Result<JinjaTemplate> JinjaTemplate::parse(std::string_view source) {
  JinjaTemplate t;
  try {
    t.body_ = std::make_shared<const jinja::Body>(jinja::parse(source));
  } catch (const jinja::Error& e) {
    return Status::InvalidArgument("line " + std::to_string(e.line) + ": " + e.what());
  }
  return t;
}

Result<JinjaOutput> JinjaTemplate::render_values(const std::vector<std::pair<std::string, jinja::Value>>& variables,
                                                 const jinja::Value& tracked, const JinjaOptions& options) const {
  JinjaOutput out;
  jinja::Evaluator ev(options, &out.text);
  for (const auto& [name, value] : variables) ev.define(name, value);
  if (tracked.is_list()) ev.track(tracked, &out.item_spans);
  try {
    jinja::collect_macros(*body_, &ev);
    ev.exec(*body_);
  } catch (const jinja::Error& e) {
    return Status::InvalidArgument("line " + std::to_string(e.line ? e.line : ev.line()) + ": " + e.what());
  }
  return out;
}

Result<std::string> JinjaTemplate::render(const nlohmann::ordered_json& variables, const JinjaOptions& options) const {
  std::vector<std::pair<std::string, jinja::Value>> values;
  if (variables.is_object()) {
    for (auto it = variables.begin(); it != variables.end(); ++it) values.emplace_back(it.key(), jinja::from_json(it.value()));
  }
  ASSIGN_OR_RETURN(JinjaOutput out, render_values(values, jinja::Value(), options));
  return std::move(out.text);
}

}  // namespace strata::model
