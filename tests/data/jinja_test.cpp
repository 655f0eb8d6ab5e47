// The Jinja interpreter construct by construct (each expectation is what jinja2 3.1 renders
// with trim_blocks and lstrip_blocks, as transformers sets it up), and hostile templates
// refused with a message naming the limit or construct and the line.
#include "data/jinja.h"

#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

namespace strata::model {
namespace {

using ordered_json = nlohmann::ordered_json;

std::string render(const std::string& source, const ordered_json& vars = ordered_json::object(), const JinjaOptions& options = {}) {
  Result<JinjaTemplate> t = JinjaTemplate::parse(source);
  if (!t.ok()) return "PARSE ERROR: " + t.status().message();
  Result<std::string> out = t->render(vars, options);
  return out.ok() ? *out : "ERROR: " + out.status().message();
}

struct Case {
  const char* source;
  const char* vars;
  const char* want;
};

void check(const std::vector<Case>& cases) {
  for (const Case& c : cases) EXPECT_EQ(render(c.source, ordered_json::parse(c.vars)), c.want) << c.source;
}

TEST(JinjaTest, ForLoopsAndTheirLoopVariable) {
  check({
      {"{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
       R"({"xs": ["a", "b"]})", "10TrueFalse2;21FalseTrue2;"},
      {"{% for x in xs %}{{ loop.revindex }}{{ loop.revindex0 }}{% endfor %}", R"({"xs": [1, 2, 3]})", "322110"},
      {"{% for x in xs %}{{ loop.previtem is defined }}{{ loop.nextitem | default('-') }} {% endfor %}",
       R"({"xs": [1, 2]})", "False2 True- "},
      {"{% for x in xs if x > 1 %}{{ x }}{{ loop.length }}{% else %}none{% endfor %}", R"({"xs": [1, 2, 3]})", "2232"},
      {"{% for x in xs %}{{ x }}{% else %}empty{% endfor %}", R"({"xs": []})", "empty"},
      {"{% for k, v in d | items %}{{ k }}={{ v }},{% endfor %}", R"({"d": {"b": 1, "a": 2}})", "b=1,a=2,"},
      {"{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
       R"({"xs": [1, 2, 3, 4, 5]})", "13"},
      {"{% for c in 'héllo' %}{{ c }}.{% endfor %}", "{}", "h.é.l.l.o."},
  });
}

TEST(JinjaTest, ConditionalsSetAndNamespaces) {
  check({
      {"{% if a %}A{% elif b %}B{% else %}C{% endif %}", R"({"b": 1})", "B"},
      {"{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", "{}", "2"},
      {"{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}", "{}", "1"},  // loops are scopes
      {"{% set ns = namespace(n=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", "{}", "6"},
      {"{% set block %}in {{ 1 + 1 }}{% endset %}[{{ block }}]", "{}", "[in 2]"},
      {"{{ 'y' if x else 'n' }}{{ 'z' if not x }}", R"({"x": false})", "nz"},
  });
}

TEST(JinjaTest, MacrosAndCallBlocks) {
  check({
      {"{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', punct='?') }}",
       "{}", "Hi Ann! Hi Bo?"},
      {"{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold{% endcall %}", "{}",
       "<b>bold</b>"},
      {"{% macro f() %}{{ top }}{% endmacro %}{% set top = 'seen' %}{{ f() }}", "{}", "seen"},
  });
}

TEST(JinjaTest, ExpressionsOperatorsAndLiterals) {
  check({
      {"{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 1.5 + 1 }}", "{}",
       "7 3 -4 1 2 1024 3.5 2.5"},
      {"{{ 'a' ~ 1 ~ none ~ true }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ '-' * 3 }}", "{}", "a1NoneTrue ab [1, 2] ---"},
      {"{{ 1 < 2 < 3 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} {{ 'x' in 'xyz' }} {{ 2 not in [1] }} {{ 'k' in {'k': 1} }}", "{}",
       "True True True True True True"},
      {"{{ a and b }} {{ a or b }} {{ not a }}", R"({"a": 0, "b": "s"})", "0 s True"},
      {"{{ {'a': [1, 'x', True, None, 1.0]} }} {{ (1, 2) }} {{ True }} {{ none }}", "{}",
       "{'a': [1, 'x', True, None, 1.0]} [1, 2] True None"},
      {"{{ d.k }} {{ d['k'] }} {{ xs[0] }} {{ xs[-1] }} {{ xs.1 }} {{ d.missing is defined }}",
       R"({"d": {"k": "v"}, "xs": [1, 2]})", "v v 1 2 2 False"},
      {"{{ s[1:3] }} {{ s[::-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ s[-2:] }} {{ 'äöü'[1] }}", R"({"s": "abcd", "xs": [1, 2, 3]})",
       "bc dcba [2, 3] [1, 2] cd ö"},
      {"{{ '\\n' | length }} {{ \"it's\" }} {{ 'a' 'b' }} {{ '\\u00e9' }}", "{}", "1 it's ab é"},
  });
}

TEST(JinjaTest, Tests) {
  check({
      {"{{ x is defined }} {{ y is undefined }} {{ n is none }} {{ s is string }} {{ d is mapping }} {{ xs is iterable }}",
       R"({"x": 1, "n": null, "s": "", "d": {}, "xs": []})", "True True True True True True"},
      {"{{ xs is sequence }} {{ 1 is number }} {{ s is number }} {{ t is true }} {{ t is false }} {{ 4 is divisibleby 2 }}",
       R"({"xs": [], "s": "1", "t": true})", "True True False True False True"},
      {"{{ x is not none }} {{ 3 is odd }} {{ 'a' is equalto 'a' }} {{ x is eq 1 }}", R"({"x": 1})", "True True True True"},
  });
}

TEST(JinjaTest, Filters) {
  check({
      {"[{{ '  a b \\n' | trim }}] {{ 'Ab' | lower }}{{ 'Ab' | upper }} {{ 'hello world' | capitalize }} {{ 'a-b c' | title }}",
       "{}", "[a b] abAB Hello world A-B C"},
      {"{{ xs | length }} {{ xs | first }} {{ xs | last }} {{ xs | join(', ') }} {{ 'ab' | list }} {{ xs | reverse | list }}",
       R"({"xs": [1, 2, 3]})", "3 1 3 1, 2, 3 ['a', 'b'] [3, 2, 1]"},
      {"{{ 'aXa' | replace('a', 'b') }} {{ u | default('d') }} {{ '' | default('e', true) }} {{ '3' | int + 1 }} {{ 2 | string }}",
       "{}", "bXb d e 4 2"},
      {"{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | join }} {{ ms | rejectattr('role', 'eq', 'user') | list | length }}",
       R"({"ms": [{"role": "user", "c": "u1"}, {"role": "bot", "c": "b"}, {"role": "user", "c": "u2"}]})", "u1u2 1"},
      {"{{ ms | map(attribute='f.name') | join(',') }} {{ ['a', 'b'] | map('upper') | join }}",
       R"({"ms": [{"f": {"name": "x"}}, {"f": {"name": "y"}}]})", "x,y AB"},
      {"{{ [3, 1, 2] | sort | list }} {{ [1, 2, 1] | unique | list }} {{ [1, 2] | sum }} {{ [1, 5] | max }} {{ 'a\\nb' | indent(2) }}",
       "{}", "[1, 2, 3] [1, 2] 3 5 a\n  b"},
  });
}

TEST(JinjaTest, ToJsonMatchesPythonJsonDumps) {
  const ordered_json vars = ordered_json::parse(R"({"v": {"s": "é\"\n<>&", "n": [1, 2.5, 1.0, 1e20, 0.0001, true, null], "e": {}, "l": []}})");
  EXPECT_EQ(render("{{ v | tojson }}", vars),
            R"({"s": "é\"\n<>&", "n": [1, 2.5, 1.0, 1e+20, 0.0001, true, null], "e": {}, "l": []})");
  EXPECT_EQ(render("{{ v.n[:2] | tojson(indent=2) }}", vars), "[\n  1,\n  2.5\n]");
  EXPECT_EQ(render("{{ {'b': 1, 'a': {'c': []}} | tojson(indent=4) }}"), "{\n    \"b\": 1,\n    \"a\": {\n        \"c\": []\n    }\n}");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=(',', ':')) }}"), R"({"a":2,"b":1})");
}

TEST(JinjaTest, StringDictAndListMethods) {
  check({
      {"[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ 'xxaxx'.strip('x') }}]", R"({"s": " a "})", "[a][a ][ a][a]"},
      {"{{ 'a<b>c'.split('<') }} {{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }}", "{}",
       "['a', 'b>c'] ['a', 'b'] ['a', 'b,c'] ['a,b', 'c']"},
      {"{{ s.startswith('ab') }} {{ s.endswith(('x', 'd')) }} {{ s.upper() }} {{ s.replace('b', '') }} {{ 'hi there'.title() }}",
       R"({"s": "abcd"})", "True True ABCD acd Hi There"},
      {"{{ d.get('a') }} {{ d.get('z', 0) }} {{ d.get('z') }} {{ d.keys() | list }} {{ d.values() | list }} {% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}",
       R"({"d": {"a": 1}})", "1 0 None ['a'] [1] a1"},
      {"{{ '{} and {}'.format(1, 'x') }} {{ [1, 2, 1].count(1) }}", "{}", "1 and x 2"},
  });
}

TEST(JinjaTest, GlobalsRaiseExceptionAndStrftimeNow) {
  EXPECT_EQ(render("{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ dict(a=1) }}"), "[0, 1, 2] [1, 3, 5] {'a': 1}");
  JinjaOptions o;
  o.now = 86400 * 365;  // 1971-01-01
  ::setenv("TZ", "UTC", 1);
  ::tzset();
  EXPECT_EQ(render("{{ strftime_now('%d %b %Y') }}", ordered_json::object(), o), "01 Jan 1971");
  EXPECT_EQ(render("line 1\n{{ raise_exception('Roles must alternate') }}"),
            "ERROR: line 2: the template raised an exception: Roles must alternate");
}

TEST(JinjaTest, WhitespaceControlAsTransformersSetsItUp) {
  // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before it.
  EXPECT_EQ(render("{% for x in xs %}\n    {% if x %}\n{{ x }}\n    {% endif %}\n{% endfor %}\n", ordered_json::parse(R"({"xs": [1, 2]})")),
            "1\n2\n");
  EXPECT_EQ(render("a  {{- ' b ' -}}  c\n  {%- if true %} d {% endif -%}\n e"), "a b c d e");
  EXPECT_EQ(render("x\n  {%+ if true %}y{% endif %}"), "x\n  y");  // {%+ keeps the indentation
  EXPECT_EQ(render("{# comment #}\n{{ 1 }}\n"), "1");           // one trailing newline is dropped
  EXPECT_EQ(render("a\r\nb"), "a\nb");
}

TEST(JinjaTest, UndefinedBehavesAsInJinja2) {
  EXPECT_EQ(render("[{{ nothing }}][{{ nothing | length }}][{% for x in nothing %}x{% endfor %}][{{ d.none_here }}]",
                   ordered_json::parse(R"({"d": {}})")),
            "[][0][][]");
  EXPECT_EQ(render("{{ nothing.attr }}"), "ERROR: line 1: 'nothing' is undefined (reading .attr of it)");
}

TEST(JinjaTest, ConstructsOutsideTheSubsetAreRefusedNamingThemAndTheLine) {
  EXPECT_EQ(render("ok\n{{ x | frobnicate }}"), "PARSE ERROR: line 2: filter 'frobnicate' is outside the Jinja subset strata renders");
  EXPECT_EQ(render("\n\n{% include 'x.html' %}"),
            "PARSE ERROR: line 3: statement 'include' is outside the Jinja subset strata renders (for, if, set, macro, "
            "call, filter, break, continue, generation)");
  EXPECT_EQ(render("{{ x is frob }}"), "PARSE ERROR: line 1: test 'frob' is outside the Jinja subset strata renders");
  EXPECT_EQ(render("{{ cycler(1) }}"), "ERROR: line 1: function 'cycler' is outside the Jinja subset strata renders");
  EXPECT_EQ(render("{{ 'a'.zfill(3) }}"), "ERROR: line 1: function method 'zfill' is outside the Jinja subset strata renders");
  EXPECT_EQ(render("{{ xs.append(1) }}", ordered_json::parse(R"({"xs": []})")),
            "ERROR: line 1: method 'append' changes its object, which transformers' sandbox refuses too");
  EXPECT_EQ(render("{% if x %}never closed"), "PARSE ERROR: line 1: the template ends inside a block: expected {% endif %}");
  EXPECT_EQ(render("{{ 1 +  }}"), "PARSE ERROR: line 1: unexpected '}}' in an expression");
}

TEST(JinjaTest, HostileTemplatesHitLimitsWithClearErrors) {
  std::string deep;
  for (int i = 0; i < 500; ++i) deep += "{% if true %}";
  EXPECT_NE(render(deep).find("nests deeper than 200 levels"), std::string::npos);
  std::string parens(5000, '(');
  EXPECT_NE(render("{{ " + parens + "1" + std::string(5000, ')') + " }}").find("nests deeper"), std::string::npos);
  // The step limit, set low so that reaching it is quick under sanitizers too.
  JinjaOptions few_steps;
  few_steps.max_steps = 100'000;
  EXPECT_EQ(render("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}{% endfor %}{% endfor %}",
                   ordered_json::object(), few_steps),
            "ERROR: line 1: the template takes more than 100000 steps (a loop too long for a chat template?)");
  EXPECT_EQ(render("{{ range(10000000000) }}"), "ERROR: line 1: range() of 10000000000 numbers, more than the limit of 1000000");
  JinjaOptions small;
  small.max_output_bytes = 1000;
  EXPECT_EQ(render("{% for i in range(100) %}0123456789ABCDEF{% endfor %}", ordered_json::object(), small),
            "ERROR: line 1: the output passes the limit of 1000 bytes");
  EXPECT_EQ(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"), "ERROR: line 1: macro calls nest deeper than 64");
  EXPECT_EQ(render("{{ 2 ** 64 }}"), "ERROR: line 1: integer arithmetic overflows 64 bits");
  EXPECT_EQ(render("{{ 'x' * 100000000000 }}"), "ERROR: line 1: a string repeated past the output limit");
}

}  // namespace
}  // namespace strata::model
