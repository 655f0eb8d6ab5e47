// The parser: jinja2's grammar for the statements and expressions of the subset (jinja.h).
// Precedence, loosest first: x if c else y; or; and; not; comparisons and in; + -; ~; * / // %;
// **; unary - +; then postfix .attr [item] (call), filters | and tests `is`.
#include <set>

#include "data/jinja_ast.h"

namespace strata::model::jinja {
namespace {

using Type = Token::Type;

// The filters and tests jinja_builtins.cpp implements; jinja2 too refuses an unknown one when
// it compiles the template, not when it runs it.
const std::set<std::string>& known_filters() {
  static const std::set<std::string> k = {
      "abs",    "capitalize", "count",   "d",       "default",    "dictsort", "e",         "escape", "first",
      "float",  "indent",     "int",     "items",   "join",       "last",     "length",    "list",   "lower",
      "map",    "max",        "min",     "reject",  "rejectattr", "replace",  "reverse",   "round",  "safe",
      "select", "selectattr", "sort",    "string",  "sum",        "title",    "tojson",    "trim",   "unique",
      "upper",  "wordcount"};
  return k;
}
const std::set<std::string>& known_tests() {
  static const std::set<std::string> k = {
      "boolean", "callable", "defined", "divisibleby", "eq",     "equalto", "even",     "false",   "float",
      "ge",      "gt",       "in",      "integer",     "iterable", "le",     "lower",    "lt",      "mapping",
      "ne",      "none",     "number",  "odd",         "sameas", "sequence", "string",  "true",    "undefined",
      "upper",   "=="};
  return k;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body run() {
    Body body = parse_body({});
    if (pos_ < t_.size()) fail("unexpected '" + block_name() + "' with no statement it closes");
    return body;
  }

 private:
  // ---- token access ----
  const Token& cur() const {
    static const Token kEnd{Type::kBlockEnd, "end of template", 0, 0, 0};
    return pos_ < t_.size() ? t_[pos_] : kEnd;
  }
  int line() const { return pos_ < t_.size() ? t_[pos_].line : (t_.empty() ? 1 : t_.back().line); }
  [[noreturn]] void fail(const std::string& what) const { throw Error(what, line()); }
  bool at_op(std::string_view op) const { return cur().type == Type::kOp && cur().text == op; }
  bool at_name(std::string_view name) const { return cur().type == Type::kName && cur().text == name; }
  void expect_op(std::string_view op) {
    if (!at_op(op)) fail("expected '" + std::string(op) + "', found " + describe(cur()));
    ++pos_;
  }
  std::string expect_name() {
    if (cur().type != Type::kName) fail("expected a name, found " + describe(cur()));
    return t_[pos_++].text;
  }
  void expect_block_end() {
    if (cur().type != Type::kBlockEnd) fail("expected the end of the statement (%}), found " + describe(cur()));
    ++pos_;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Type::kName: return "'" + t.text + "'";
      case Type::kOp: return "'" + t.text + "'";
      case Type::kString: return "a string";
      case Type::kInt:
      case Type::kFloat: return "a number";
      case Type::kVarEnd: return "'}}'";
      case Type::kBlockEnd: return t.text.empty() ? "'%}'" : t.text;
      default: return "text";
    }
  }
  // At "{% name": the name, without consuming.
  std::string block_name() const {
    if (cur().type != Type::kBlockBegin || pos_ + 1 >= t_.size() || t_[pos_ + 1].type != Type::kName) return {};
    return t_[pos_ + 1].text;
  }

  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p(p) {
      if (++p->depth_ > kMaxParseDepth) p->fail("the template nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
    }
    ~DepthGuard() { --p->depth_; }
    Parser* p;
  };

  // ---- statements ----
  // Parses nodes until a block whose name is in `stops` (left unconsumed) or the end.
  Body parse_body(const std::set<std::string>& stops) {
    DepthGuard guard(this);
    Body body;
    while (pos_ < t_.size()) {
      const Token& tok = cur();
      if (tok.type == Type::kText) {
        auto n = node(Node::Kind::kText);
        n->text = tok.text;
        body.push_back(std::move(n));
        ++pos_;
      } else if (tok.type == Type::kVarBegin) {
        auto n = node(Node::Kind::kOutput);
        ++pos_;
        n->expr = expression();
        if (cur().type != Type::kVarEnd) fail("expected the end of the expression (}}), found " + describe(cur()));
        ++pos_;
        body.push_back(std::move(n));
      } else if (tok.type == Type::kBlockBegin) {
        const std::string name = block_name();
        if (stops.count(name)) return body;
        body.push_back(statement());
      } else {
        fail("unexpected " + describe(tok));
      }
    }
    if (!stops.empty()) fail("the template ends inside a block: expected {% " + *stops.rbegin() + " %}");
    return body;
  }

  NodePtr node(Node::Kind kind) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = line();
    return n;
  }

  // Consumes "{% name" of an end/else tag and its "%}".
  void close_block(const std::string& name) {
    if (block_name() != name) fail("expected {% " + name + " %}");
    pos_ += 2;
    expect_block_end();
  }

  NodePtr statement() {
    ++pos_;  // {%
    const std::string name = expect_name();
    if (name == "if") return if_statement();
    if (name == "for") return for_statement();
    if (name == "set") return set_statement();
    if (name == "macro") return macro_statement();
    if (name == "call") return call_statement();
    if (name == "filter") return filter_statement();
    if (name == "generation") {
      auto n = node(Node::Kind::kGeneration);
      expect_block_end();
      n->body = parse_body({"endgeneration"});
      close_block("endgeneration");
      return n;
    }
    if (name == "break" || name == "continue") {
      auto n = node(name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue);
      expect_block_end();
      return n;
    }
    --pos_;
    fail("statement '" + name + "' is outside the Jinja subset strata renders (for, if, set, macro, call, filter, "
         "break, continue, generation)");
  }

  NodePtr if_statement() {
    auto n = node(Node::Kind::kIf);
    ExprPtr cond = expression();
    expect_block_end();
    while (true) {
      Body body = parse_body({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(body));
      const std::string name = block_name();
      pos_ += 2;
      if (name == "elif") {
        cond = expression();
        expect_block_end();
        continue;
      }
      expect_block_end();
      if (name == "else") {
        n->else_body = parse_body({"endif"});
        close_block("endif");
      }
      return n;
    }
  }

  NodePtr for_statement() {
    auto n = node(Node::Kind::kFor);
    n->targets.push_back(expect_name());
    while (at_op(",")) {
      ++pos_;
      n->targets.push_back(expect_name());
    }
    if (!at_name("in")) fail("expected 'in' in the for statement, found " + describe(cur()));
    ++pos_;
    n->expr = or_expression();  // `if` here filters the loop, it is no conditional expression
    if (at_name("if")) {
      ++pos_;
      n->cond = expression();
    }
    if (at_name("recursive")) fail("recursive for loops are outside the Jinja subset strata renders");
    expect_block_end();
    n->body = parse_body({"else", "endfor"});
    if (block_name() == "else") {
      pos_ += 2;
      expect_block_end();
      n->else_body = parse_body({"endfor"});
    }
    close_block("endfor");
    return n;
  }

  NodePtr set_statement() {
    const std::string target = expect_name();
    if (at_op(",")) fail("set with several targets is outside the Jinja subset strata renders");
    if (cur().type == Type::kBlockEnd) {
      auto n = node(Node::Kind::kSetBlock);
      n->name = target;
      ++pos_;
      n->body = parse_body({"endset"});
      close_block("endset");
      return n;
    }
    auto n = node(Node::Kind::kSet);
    n->name = target;
    if (at_op(".")) {
      ++pos_;
      n->attr = expect_name();
    }
    expect_op("=");
    n->expr = expression();
    expect_block_end();
    return n;
  }

  void parameters(Node* n) {
    expect_op("(");
    while (!at_op(")")) {
      n->params.push_back(expect_name());
      if (at_op("=")) {
        ++pos_;
        n->defaults.push_back(expression());
      } else {
        n->defaults.push_back(nullptr);
      }
      if (!at_op(",")) break;
      ++pos_;
    }
    expect_op(")");
  }

  NodePtr macro_statement() {
    auto n = node(Node::Kind::kMacro);
    n->name = expect_name();
    parameters(n.get());
    expect_block_end();
    n->body = parse_body({"endmacro"});
    close_block("endmacro");
    return n;
  }

  NodePtr call_statement() {
    auto n = node(Node::Kind::kCallBlock);
    if (at_op("(")) parameters(n.get());
    n->expr = expression();
    if (n->expr->op != Expr::Op::kCall) fail("{% call %} needs a macro call");
    expect_block_end();
    n->body = parse_body({"endcall"});
    close_block("endcall");
    return n;
  }

  NodePtr filter_statement() {
    auto n = node(Node::Kind::kFilterBlock);
    n->expr = filter(nullptr);
    expect_block_end();
    n->body = parse_body({"endfilter"});
    close_block("endfilter");
    return n;
  }

  // ---- expressions ----
  ExprPtr make(Expr::Op op, int line) {
    auto e = std::make_unique<Expr>();
    e->op = op;
    e->line = line;
    return e;
  }

  ExprPtr expression() {
    DepthGuard guard(this);
    ExprPtr e = or_expression();
    while (at_name("if")) {
      auto c = make(Expr::Op::kCond, line());
      ++pos_;
      ExprPtr cond = or_expression();
      ExprPtr otherwise;
      if (at_name("else")) {
        ++pos_;
        otherwise = expression();
      }
      c->kids.push_back(std::move(cond));
      c->kids.push_back(std::move(e));
      c->kids.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary_chain(Expr::Op op, std::string_view word, ExprPtr (Parser::*next)()) {
    ExprPtr e = (this->*next)();
    while (at_name(word)) {
      auto b = make(op, line());
      ++pos_;
      b->kids.push_back(std::move(e));
      b->kids.push_back((this->*next)());
      e = std::move(b);
    }
    return e;
  }
  ExprPtr or_expression() { return binary_chain(Expr::Op::kOr, "or", &Parser::and_expression); }
  ExprPtr and_expression() { return binary_chain(Expr::Op::kAnd, "and", &Parser::not_expression); }

  ExprPtr not_expression() {
    if (at_name("not")) {
      DepthGuard guard(this);
      auto n = make(Expr::Op::kNot, line());
      ++pos_;
      n->kids.push_back(not_expression());
      return n;
    }
    return compare();
  }

  ExprPtr compare() {
    ExprPtr first = arithmetic({"+", "-"}, &Parser::concat);
    ExprPtr c;
    while (true) {
      std::string op;
      if (cur().type == Type::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                      cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        ++pos_;
      } else if (at_name("in")) {
        op = "in";
        ++pos_;
      } else if (at_name("not") && pos_ + 1 < t_.size() && t_[pos_ + 1].type == Type::kName && t_[pos_ + 1].text == "in") {
        op = "not in";
        pos_ += 2;
      } else {
        break;
      }
      if (!c) {
        c = make(Expr::Op::kCompare, line());
        c->kids.push_back(std::move(first));
      }
      c->ops.push_back(op);
      c->kids.push_back(arithmetic({"+", "-"}, &Parser::concat));
    }
    return c ? std::move(c) : std::move(first);
  }

  ExprPtr arithmetic(const std::set<std::string>& ops, ExprPtr (Parser::*next)()) {
    ExprPtr e = (this->*next)();
    while (cur().type == Type::kOp && ops.count(cur().text)) {
      auto b = make(Expr::Op::kBinary, line());
      b->name = t_[pos_++].text;
      b->kids.push_back(std::move(e));
      b->kids.push_back((this->*next)());
      e = std::move(b);
    }
    return e;
  }
  ExprPtr concat() { return arithmetic({"~"}, &Parser::product); }
  ExprPtr product() { return arithmetic({"*", "/", "//", "%"}, &Parser::power); }
  ExprPtr power() { return arithmetic({"**"}, &Parser::unary_filtered); }
  ExprPtr unary_filtered() { return unary(true); }

  ExprPtr unary(bool with_filter) {
    DepthGuard guard(this);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      e = make(at_op("-") ? Expr::Op::kNeg : Expr::Op::kPos, line());
      ++pos_;
      e->kids.push_back(unary(false));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    return with_filter ? filters_and_tests(std::move(e)) : std::move(e);
  }

  ExprPtr primary() {
    const Token& tok = cur();
    const int ln = tok.line;
    switch (tok.type) {
      case Type::kName: {
        ++pos_;
        if (tok.text == "true" || tok.text == "True") return literal(Value::boolean(true), ln);
        if (tok.text == "false" || tok.text == "False") return literal(Value::boolean(false), ln);
        if (tok.text == "none" || tok.text == "None") return literal(Value::none(), ln);
        auto n = make(Expr::Op::kName, ln);
        n->name = tok.text;
        return n;
      }
      case Type::kString: {
        std::string s;
        while (cur().type == Type::kString) s += t_[pos_++].text;  // adjacent literals join
        return literal(Value::string(std::move(s)), ln);
      }
      case Type::kInt: ++pos_; return literal(Value::integer(tok.i), ln);
      case Type::kFloat: ++pos_; return literal(Value::number(tok.f), ln);
      case Type::kOp:
        if (tok.text == "(") return parenthesised();
        if (tok.text == "[") return list_literal();
        if (tok.text == "{") return dict_literal();
        [[fallthrough]];
      default: fail("unexpected " + describe(tok) + " in an expression");
    }
  }

  ExprPtr literal(Value v, int ln) {
    auto e = make(Expr::Op::kLiteral, ln);
    e->value = std::move(v);
    return e;
  }

  ExprPtr parenthesised() {
    const int ln = line();
    ++pos_;
    if (at_op(")")) {
      ++pos_;
      return make(Expr::Op::kList, ln);
    }
    ExprPtr e = expression();
    if (!at_op(",")) {
      expect_op(")");
      return e;
    }
    auto tuple = make(Expr::Op::kList, ln);
    tuple->kids.push_back(std::move(e));
    while (at_op(",")) {
      ++pos_;
      if (at_op(")")) break;
      tuple->kids.push_back(expression());
    }
    expect_op(")");
    return tuple;
  }

  ExprPtr list_literal() {
    auto l = make(Expr::Op::kList, line());
    ++pos_;
    while (!at_op("]")) {
      l->kids.push_back(expression());
      if (!at_op(",")) break;
      ++pos_;
    }
    expect_op("]");
    return l;
  }

  ExprPtr dict_literal() {
    auto d = make(Expr::Op::kDict, line());
    ++pos_;
    while (!at_op("}")) {
      if (cur().type != Type::kString) fail("dict literal keys must be strings in the subset strata renders");
      d->keys.push_back(t_[pos_++].text);
      expect_op(":");
      d->kids.push_back(expression());
      if (!at_op(",")) break;
      ++pos_;
    }
    expect_op("}");
    return d;
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      if (at_op(".")) {
        auto a = make(Expr::Op::kAttr, line());
        ++pos_;
        if (cur().type == Type::kInt) {  // x.0 is x[0]
          a->op = Expr::Op::kItem;
          a->kids.push_back(std::move(e));
          a->kids.push_back(literal(Value::integer(t_[pos_++].i), a->line));
        } else {
          a->name = expect_name();
          a->kids.push_back(std::move(e));
        }
        e = std::move(a);
      } else if (at_op("[")) {
        e = subscript(std::move(e));
      } else if (at_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr obj) {
    const int ln = line();
    ++pos_;
    ExprPtr bounds[3];
    int colons = 0;
    while (!at_op("]")) {
      if (at_op(":")) {
        if (++colons > 2) fail("a slice takes at most start:stop:step");
        ++pos_;
        continue;
      }
      if (bounds[colons]) fail("expected ':' or ']' in a subscript, found " + describe(cur()));
      bounds[colons] = expression();
    }
    ++pos_;
    auto e = make(colons ? Expr::Op::kSlice : Expr::Op::kItem, ln);
    e->kids.push_back(std::move(obj));
    if (!colons && !bounds[0]) fail("an empty subscript []");
    e->kids.push_back(std::move(bounds[0]));
    if (colons) {
      e->kids.push_back(std::move(bounds[1]));
      e->kids.push_back(std::move(bounds[2]));
    }
    return e;
  }

  // "(args)" after a callee, filter or test: positional arguments, then name=value ones.
  void arguments(Expr* e) {
    expect_op("(");
    while (!at_op(")")) {
      if (cur().type == Type::kName && pos_ + 1 < t_.size() && t_[pos_ + 1].type == Type::kOp && t_[pos_ + 1].text == "=") {
        e->keywords.push_back(t_[pos_].text);
        pos_ += 2;
        e->kids.push_back(expression());
      } else {
        if (!e->keywords.empty()) fail("a positional argument after a keyword argument");
        if (at_op("*")) {  // f(*args): the list's items as positional arguments
          auto splat = make(Expr::Op::kList, line());
          splat->name = "*";
          ++pos_;
          splat->kids.push_back(expression());
          e->kids.push_back(std::move(splat));
        } else {
          e->kids.push_back(expression());
        }
        ++e->positional;
      }
      if (!at_op(",")) break;
      ++pos_;
    }
    expect_op(")");
  }

  ExprPtr call(ExprPtr callee) {
    auto c = make(Expr::Op::kCall, line());
    c->kids.push_back(std::move(callee));
    arguments(c.get());
    return c;
  }

  ExprPtr filter(ExprPtr operand) {
    auto f = make(Expr::Op::kFilter, line());
    f->name = expect_name();
    while (at_op(".")) {  // dotted filter names
      ++pos_;
      f->name += "." + expect_name();
    }
    if (!known_filters().count(f->name)) {
      fail("filter '" + f->name + "' is outside the Jinja subset strata renders");
    }
    f->kids.push_back(std::move(operand));
    if (at_op("(")) arguments(f.get());
    return f;
  }

  ExprPtr filters_and_tests(ExprPtr e) {
    while (true) {
      if (at_op("|")) {
        ++pos_;
        e = filter(std::move(e));
      } else if (at_name("is")) {
        e = test(std::move(e));
      } else if (at_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr test(ExprPtr operand) {
    auto t = make(Expr::Op::kTest, line());
    ++pos_;  // is
    if (at_name("not")) {
      t->negated = true;
      ++pos_;
    }
    if (at_op("==")) {
      t->name = "==";
      ++pos_;
    } else {
      t->name = expect_name();
    }
    if (!known_tests().count(t->name)) fail("test '" + t->name + "' is outside the Jinja subset strata renders");
    t->kids.push_back(std::move(operand));
    if (at_op("(")) {
      arguments(t.get());
    } else if (takes_bare_argument()) {  // `x is divisibleby 3`, `x is sameas false`
      t->kids.push_back(unary(false));
      t->positional = 1;
    }
    return t;
  }

  bool takes_bare_argument() const {
    const Token& tok = cur();
    if (tok.type == Type::kString || tok.type == Type::kInt || tok.type == Type::kFloat) return true;
    if (tok.type == Type::kOp) return tok.text == "[" || tok.text == "{" || tok.text == "-";
    if (tok.type != Type::kName) return false;
    static const std::set<std::string> stops = {"else", "or", "and", "if", "in", "not", "is", "recursive"};
    return !stops.count(tok.text);
  }

  std::vector<Token> t_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

Body parse(std::string_view source) { return Parser(lex(source)).run(); }

}  // namespace strata::model::jinja
