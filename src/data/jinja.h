// A Jinja interpreter for the subset that Hugging Face chat templates use, rendering as jinja2
// does under transformers' settings (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
// loop controls, and the globals raise_exception and strftime_now).
//
// The subset:
//   statements   for (loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem,
//                else, a filter `if`), if/elif/else, set (namespace attributes too; block set),
//                macro, call with caller(), filter blocks, break, continue, generation;
//   expressions  and or not in `not in` is, == != < > <= >=, + - * / // % ** ~, x if c else y,
//                .attr, [item], [a:b:c] slices, calls with keyword arguments, literals (strings,
//                numbers, lists, tuples, dicts with string keys, true/false/none in either case);
//   tests        defined undefined none string mapping iterable sequence number integer float
//                boolean true false callable odd even divisibleby eq/equalto/== ne lt gt le ge
//                in sameas lower upper;
//   filters      abs capitalize count default/d dictsort escape/e first float indent int items
//                join last length list lower map max min reject rejectattr replace reverse round
//                safe select selectattr sort string sum title tojson trim unique upper wordcount;
//   methods      str: strip lstrip rstrip startswith endswith split rsplit upper lower replace
//                title capitalize find count splitlines format(positional {}); dict: get items
//                keys values; list: index count;
//   globals      range namespace dict raise_exception strftime_now.
// Case mapping (lower, upper, title, capitalize) maps ASCII letters only. HTML escaping is off,
// as in transformers. A construct outside the subset is refused when the template is parsed (a
// statement, filter or test) or when it runs (a method or function), naming it and the line.
//
// Bounded on hostile templates: output size, steps (expressions evaluated and loop iterations)
// and macro call depth have limits, and each is refused with a message naming it and the line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"
#include "data/jinja_value.h"
#include "data/tokenizer_split.h"

namespace strata::model {

namespace jinja {
struct Node;
}

struct JinjaOptions {
  size_t max_output_bytes = size_t{64} << 20;
  // A real chat template takes some thousands of steps per conversation; this bounds a hostile
  // one to a few seconds.
  int64_t max_steps = 5'000'000;
  int max_call_depth = 64;  // nested macro calls
  // The time strftime_now formats, in local time; the current time when unset.
  std::optional<std::time_t> now;
};

// What a render wrote, and where: for each dict of the tracked list, the output bytes of the
// last for-loop iteration over it (as the loop item, at the template's top level) that wrote
// something; {0, 0} when none did.
struct JinjaOutput {
  std::string text;
  std::vector<ByteSpan> item_spans;
};

// Immutable after parse: safe for concurrent renders. Copyable (shares the parsed tree).
class JinjaTemplate {
 public:
  // InvalidArgument "line N: ..." for a syntax error or a construct outside the subset.
  static Result<JinjaTemplate> parse(std::string_view source);

  // Renders with the members of `variables` (a JSON object) as the template's variables.
  // InvalidArgument "line N: ..." for an error while rendering (raise_exception's message, an
  // undefined attribute, a limit).
  Result<std::string> render(const nlohmann::ordered_json& variables, const JinjaOptions& options = {}) const;
  // As render, with variables as values and the item spans of `tracked`'s dicts (a list value).
  Result<JinjaOutput> render_values(const std::vector<std::pair<std::string, jinja::Value>>& variables,
                                    const jinja::Value& tracked, const JinjaOptions& options) const;

 private:
  std::shared_ptr<const std::vector<std::unique_ptr<jinja::Node>>> body_;
};

}  // namespace strata::model
