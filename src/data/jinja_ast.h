// The Jinja interpreter's front end: the lexer (jinja_lexer.cpp) cuts a template into text and
// tag tokens as jinja2 does with trim_blocks and lstrip_blocks on (transformers' settings), and
// the parser (jinja_parser.cpp) builds the statement tree that jinja_eval.cpp runs. Both throw
// jinja::Error with the template line. Internal to src/data's Jinja files.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/jinja_value.h"

namespace strata::model::jinja {

// Hostile templates: the parser refuses nesting deeper than this (each level recurses).
inline constexpr int kMaxParseDepth = 200;

struct Token {
  enum class Type : uint8_t { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp };
  Type type;
  std::string text;  // kText: the text; kName, kOp: the name or operator; kString: the value
  int64_t i = 0;     // kInt
  double f = 0;      // kFloat
  int line = 1;
};

// The tokens of a template, whitespace control applied (see jinja_lexer.cpp).
std::vector<Token> lex(std::string_view source);

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Op : uint8_t {
    kLiteral,  // value
    kName,     // name
    kAttr,     // kids[0].name
    kItem,     // kids[0][kids[1]]
    kSlice,    // kids[0][kids[1]:kids[2]:kids[3]], each bound may be null
    kCall,     // kids[0](kids[1..1+positional), keyword kids after them, named by keywords)
    kFilter,   // kids[0] | name(args as in kCall, from kids[1])
    kTest,     // kids[0] is [not] name(args from kids[1]); negated
    kNeg,
    kPos,
    kNot,
    kAnd,
    kOr,
    kBinary,   // kids[0] name kids[1]: + - * / // % ** ~
    kCompare,  // kids[0] ops[0] kids[1] ops[1] kids[2] ...: == != < > <= >= in "not in"
    kCond,     // kids[1] if kids[0] else kids[2] (kids[2] null: undefined)
    kList,     // [kids...] and tuples; name "*": a call's *kids[0] argument
    kDict,     // {keys[i]: kids[i]}
  };
  Op op;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> kids;
  std::vector<std::string> keywords;  // kCall/kFilter/kTest: the names of the trailing keyword arguments
  std::vector<std::string> ops;       // kCompare
  std::vector<std::string> keys;      // kDict
  size_t positional = 0;              // kCall/kFilter/kTest: positional arguments after the callee/operand
  bool negated = false;               // kTest
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind : uint8_t {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // branches (cond, body)..., else_body
    kFor,          // for targets in expr [if cond]: body, else_body
    kSet,          // set name[.attr] = expr
    kSetBlock,     // set name %} body {% endset
    kMacro,        // macro name(params = defaults): body
    kCallBlock,    // call [(params)] expr: body, the macro's caller()
    kFilterBlock,  // filter name(args): body; expr is the filter with a null operand
    kBreak,
    kContinue,
    kGeneration,   // generation: body (rendered as it is; transformers marks assistant text with it)
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::vector<std::string> targets;
  std::string name;
  std::string attr;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param, null when it has none
};

// The statement tree of a template. Throws Error naming the line of anything outside the
// subset (see jinja.h).
Body parse(std::string_view source);

}  // namespace strata::model::jinja
