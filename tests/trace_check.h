// Checks a Chrome trace-event JSON document the way a viewer reads it: the shape of every
// event, timestamps, the nesting of complete spans on each thread's track, counters, and the
// pairing of asynchronous begin/end events. Returns the first problem found, empty when none.
#pragma once

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata::testing {

inline std::string check_trace_json(const nlohmann::json& doc) {
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array())
    return "no traceEvents array";
  struct Span {
    double ts, end;
    std::string name;
  };
  std::map<int, std::vector<Span>> spans;  // tid -> complete spans
  std::set<int> named;                     // tids with a thread_name
  std::set<int> used;
  std::map<std::pair<std::string, std::string>, double> open;  // (cat, id) -> begin ts
  for (const auto& e : doc["traceEvents"]) {
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string()) return "an event without ph: " + e.dump();
    const std::string ph = e["ph"];
    if (!e.contains("pid") || !e["pid"].is_number_integer() || !e.contains("tid") || !e["tid"].is_number_integer())
      return "an event without integer pid/tid: " + e.dump();
    if (!e.contains("name") || !e["name"].is_string()) return "an event without a name: " + e.dump();
    const int tid = e["tid"];
    if (ph == "M") {
      if (e["name"] == "thread_name") {
        if (!e.contains("args") || !e["args"].contains("name") || !e["args"]["name"].is_string())
          return "thread_name without args.name: " + e.dump();
        named.insert(tid);
      }
      continue;
    }
    if (!e.contains("ts") || !e["ts"].is_number()) return "an event without a numeric ts: " + e.dump();
    const double ts = e["ts"];
    if (!(ts >= 0)) return "a negative timestamp: " + e.dump();
    used.insert(tid);
    if (ph == "X") {
      if (!e.contains("dur") || !e["dur"].is_number() || !(e["dur"].get<double>() >= 0))
        return "a complete span without a duration >= 0: " + e.dump();
      spans[tid].push_back(Span{ts, ts + e["dur"].get<double>(), e["name"]});
    } else if (ph == "C") {
      if (!e.contains("args") || !e["args"].is_object() || e["args"].empty()) return "a counter without values: " + e.dump();
      for (const auto& [key, value] : e["args"].items())
        if (!value.is_number()) return "a counter value that is not a number (" + key + "): " + e.dump();
    } else if (ph == "b" || ph == "e") {
      if (!e.contains("id") || !e.contains("cat")) return "an async event without id/cat: " + e.dump();
      const auto key = std::make_pair(e["cat"].get<std::string>(), e["id"].dump());
      if (ph == "b") {
        if (open.count(key)) return "an async span begun twice: " + e.dump();
        open[key] = ts;
      } else {
        auto it = open.find(key);
        if (it == open.end()) return "an async end without a begin: " + e.dump();
        if (!(ts >= it->second)) return "an async span that ends before it begins: " + e.dump();
        open.erase(it);
      }
    } else if (ph != "i") {
      return "an unexpected phase '" + ph + "'";
    }
  }
  if (!open.empty()) return "an async span that never ends (cat " + open.begin()->first.first + ")";
  for (int tid : used)
    if (!named.count(tid)) return "thread " + std::to_string(tid) + " has events but no thread_name";
  // Spans on one track nest: each one lies inside the enclosing open one or after it.
  // Timestamps carry nanoseconds as microseconds with 3 decimals; allow that rounding.
  constexpr double kSlack = 0.0015;
  for (auto& [tid, list] : spans) {
    std::stable_sort(list.begin(), list.end(), [](const Span& a, const Span& b) {
      return a.ts != b.ts ? a.ts < b.ts : a.end > b.end;  // the enclosing span first
    });
    std::vector<Span> stack;
    for (const Span& s : list) {
      while (!stack.empty() && s.ts >= stack.back().end - kSlack) stack.pop_back();
      if (!stack.empty() && s.end > stack.back().end + kSlack)
        return "spans overlap without nesting on thread " + std::to_string(tid) + ": '" + stack.back().name +
               "' and '" + s.name + "'";
      stack.push_back(s);
    }
  }
  return "";
}

}  // namespace strata::testing
