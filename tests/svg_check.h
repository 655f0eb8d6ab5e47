// Reading back the SVG strata writes, so that tests need no parser: a small well-formedness
// check (one root element, tags that balance, quoted and unrepeated attributes, no raw '<' or
// bare '&' in text or attribute values; names are not checked against a schema), and the points
// of a series' path.
#pragma once

#include <cctype>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

namespace strata::testing {

// "" when `xml` is well-formed, else what is wrong and at which byte.
inline std::string xml_problem(const std::string& xml) {
  size_t i = 0;
  const size_t n = xml.size();
  std::vector<std::string> open;
  bool root_seen = false;
  auto at = [&](size_t p) { return " at byte " + std::to_string(p); };
  auto entity_ok = [&](size_t p) {  // xml[p] == '&'
    const size_t semi = xml.find(';', p);
    if (semi == std::string::npos || semi - p > 8) return false;
    const std::string name = xml.substr(p + 1, semi - p - 1);
    if (name == "amp" || name == "lt" || name == "gt" || name == "quot" || name == "apos") return true;
    if (name.size() >= 2 && name[0] == '#') {
      for (size_t k = 1; k < name.size(); ++k)
        if (!std::isdigit(static_cast<unsigned char>(name[k]))) return false;
      return true;
    }
    return false;
  };
  auto is_name = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ':' || c == '.';
  };
  while (i < n) {
    if (xml[i] != '<') {
      if (open.empty() && !std::isspace(static_cast<unsigned char>(xml[i])))
        return "text outside the root element" + at(i);
      if (xml[i] == '&' && !entity_ok(i)) return "a bare '&'" + at(i);
      ++i;
      continue;
    }
    if (xml.compare(i, 4, "<!--") == 0) {
      const size_t end = xml.find("-->", i + 4);
      if (end == std::string::npos) return "an unclosed comment" + at(i);
      i = end + 3;
      continue;
    }
    if (xml.compare(i, 2, "<?") == 0) {
      if (root_seen) return "a declaration after the root element" + at(i);
      const size_t end = xml.find("?>", i + 2);
      if (end == std::string::npos) return "an unclosed declaration" + at(i);
      i = end + 2;
      continue;
    }
    const bool closing = i + 1 < n && xml[i + 1] == '/';
    size_t p = i + (closing ? 2 : 1);
    const size_t name_begin = p;
    while (p < n && is_name(xml[p])) ++p;
    const std::string name = xml.substr(name_begin, p - name_begin);
    if (name.empty()) return "a '<' that starts no tag" + at(i);
    if (closing) {
      while (p < n && std::isspace(static_cast<unsigned char>(xml[p]))) ++p;
      if (p >= n || xml[p] != '>') return "a malformed closing tag </" + name + at(i);
      if (open.empty() || open.back() != name)
        return "</" + name + "> closes " + (open.empty() ? std::string("nothing") : "<" + open.back() + ">") + at(i);
      open.pop_back();
      i = p + 1;
      continue;
    }
    if (open.empty() && root_seen) return "a second root element <" + name + ">" + at(i);
    root_seen = true;
    std::set<std::string> attributes;
    for (;;) {
      const size_t before = p;
      while (p < n && std::isspace(static_cast<unsigned char>(xml[p]))) ++p;
      if (p >= n) return "an unclosed tag <" + name + at(i);
      if (xml[p] == '>') {
        open.push_back(name);
        i = p + 1;
        break;
      }
      if (xml.compare(p, 2, "/>") == 0) {
        i = p + 2;
        break;
      }
      if (p == before) return "no space before an attribute of <" + name + ">" + at(p);
      const size_t a = p;
      while (p < n && is_name(xml[p])) ++p;
      const std::string attribute = xml.substr(a, p - a);
      if (attribute.empty() || p + 1 >= n || xml[p] != '=' || (xml[p + 1] != '"' && xml[p + 1] != '\''))
        return "a malformed attribute in <" + name + ">" + at(a);
      if (!attributes.insert(attribute).second) return "attribute " + attribute + " repeated in <" + name + ">" + at(a);
      const char quote = xml[p + 1];
      const size_t end = xml.find(quote, p + 2);
      if (end == std::string::npos) return "an unclosed attribute value in <" + name + ">" + at(a);
      for (size_t k = p + 2; k < end; ++k) {
        if (xml[k] == '<') return "a '<' in an attribute value of <" + name + ">" + at(k);
        if (xml[k] == '&' && !entity_ok(k)) return "a bare '&' in an attribute value of <" + name + ">" + at(k);
      }
      p = end + 1;
    }
  }
  if (!root_seen) return "no root element";
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  return "";
}

struct SvgPath {
  std::vector<std::pair<double, double>> points;  // every M and L point, in pixels
  int runs = 0;                                   // M commands: pieces of the line
};

// The path drawn for the series titled `name` ("<g><title>name</title><path ... d=..."); empty
// when there is none.
inline SvgPath svg_series_path(const std::string& svg, const std::string& name) {
  SvgPath p;
  const size_t title = svg.find("<title>" + name + "</title><path");
  if (title == std::string::npos) return p;
  const size_t d = svg.find(" d=\"", title) + 4;
  const std::string text = svg.substr(d, svg.find('"', d) - d);
  const char* s = text.c_str();
  while (*s != '\0') {
    const char command = *s;
    if (command == 'M' || command == 'L') {
      char* end = nullptr;
      const double x = std::strtod(s + 1, &end);
      const double y = std::strtod(end, &end);
      p.points.emplace_back(x, y);
      if (command == 'M') ++p.runs;
      s = end;
    } else {
      ++s;
    }
  }
  return p;
}

}  // namespace strata::testing
