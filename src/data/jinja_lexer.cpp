// The lexer. Whitespace control is jinja2's with trim_blocks and lstrip_blocks on:
//   {%- / {{- / {#-  strip all whitespace before the tag; -%} -}} -#} all whitespace after it;
//   trim_blocks      a block or comment tag's end eats the one newline after it (not after +%});
//   lstrip_blocks    spaces and tabs from the start of a line to a block or comment tag go
//                    (not for {%+ and not for {{ tags).
// As jinja2 does, newlines are normalised to \n first and one trailing newline is dropped.
#include <cctype>

#include "data/jinja_ast.h"

namespace strata::model::jinja {
namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string normalise_newlines(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

void append_utf8(uint32_t cp, std::string* out) { *out += encode(std::u32string(1, static_cast<char32_t>(cp))); }

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;  // the last tag's end was followed by a newline it consumed
    while (pos_ < src_.size()) {
      const size_t open = find_open(pos_);
      std::string text = src_.substr(pos_, open - pos_);
      if (open == src_.size()) {
        emit_text(text);
        advance_to(open);
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char sign = open + 2 < src_.size() ? src_[open + 2] : '\0';
      if (sign == '-') {
        size_t keep = text.size();
        while (keep > 0 && is_ws(text[keep - 1])) --keep;
        text.resize(keep);
      } else if (kind != '{' && sign != '+') {
        const size_t line_begin = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if (line_begin > 0 || line_starting) {
          bool blank = line_begin < text.size();
          for (size_t i = line_begin; i < text.size(); ++i) blank = blank && (text[i] == ' ' || text[i] == '\t');
          if (blank) text.resize(line_begin);
        }
      }
      emit_text(text);
      advance_to(open);
      pos_ = open + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        line_starting = comment();
      } else {
        line_starting = tag(kind == '{');
      }
    }
    return std::move(tokens_);
  }

 private:
  size_t find_open(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return src_.size();
  }

  void emit_text(const std::string& text) {
    if (!text.empty()) tokens_.push_back({Token::Type::kText, text, 0, 0, line_});
  }

  void advance_to(size_t to) {
    for (size_t i = pos_; i < to && i < src_.size(); ++i) line_ += src_[i] == '\n';
    pos_ = to;
  }

  // After a tag's close: -X} strips all whitespace, X} of a block or comment eats one newline.
  // Returns whether what was consumed ended with a newline.
  bool close(char sign, bool trims) {
    const size_t start = pos_;
    if (sign == '-') {
      size_t end = pos_;
      while (end < src_.size() && is_ws(src_[end])) ++end;
      advance_to(end);
    } else if (sign != '+' && trims && pos_ < src_.size() && src_[pos_] == '\n') {
      advance_to(pos_ + 1);
    }
    return pos_ > start && src_[pos_ - 1] == '\n';
  }

  bool comment() {
    const int line = line_;
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) throw Error("a comment {# is never closed with #}", line);
    const char sign = end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
    advance_to(end + 2);
    return close(sign, true);
  }

  bool tag(bool variable) {
    const int line = line_;
    const std::string_view closer = variable ? "}}" : "%}";
    tokens_.push_back({variable ? Token::Type::kVarBegin : Token::Type::kBlockBegin, {}, 0, 0, line});
    const size_t first = tokens_.size();
    while (true) {
      // "}}" inside an open dict literal closes the dict, not the tag, as in jinja2.
      int open_braces = 0;
      for (size_t k = first; k < tokens_.size(); ++k) {
        if (tokens_[k].type == Token::Type::kOp) open_braces += tokens_[k].text == "{" ? 1 : tokens_[k].text == "}" ? -1 : 0;
      }
      size_t p = pos_;
      while (p < src_.size() && is_ws(src_[p])) ++p;
      advance_to(p);
      if (pos_ >= src_.size()) throw Error(std::string("a tag is never closed with ") + std::string(closer), line);
      char sign = '\0';
      if ((src_[pos_] == '-' || src_[pos_] == '+') && src_.compare(pos_ + 1, 2, closer) == 0) sign = src_[pos_];
      if (open_braces <= 0 && (sign || src_.compare(pos_, 2, closer) == 0)) {
        advance_to(pos_ + (sign ? 3 : 2));
        tokens_.push_back({variable ? Token::Type::kVarEnd : Token::Type::kBlockEnd, {}, 0, 0, line_});
        return close(sign, !variable);
      }
      expression_token();
    }
  }

  void expression_token() {
    const char c = src_[pos_];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = pos_;
      while (end < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
      tokens_.push_back({Token::Type::kName, src_.substr(pos_, end - pos_), 0, 0, line_});
      advance_to(end);
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      number();
    } else if (c == '\'' || c == '"') {
      string_literal(c);
    } else {
      static constexpr std::string_view kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~",
                                                  "(",  ")",  "[",  "]",  "{",  "}",  ",", ".", ":", "|", "=", "<", ">"};
      for (std::string_view op : kOps) {
        if (src_.compare(pos_, op.size(), op) == 0) {
          tokens_.push_back({Token::Type::kOp, std::string(op), 0, 0, line_});
          advance_to(pos_ + op.size());
          return;
        }
      }
      throw Error(std::string("unexpected character '") + c + "' in a tag", line_);
    }
  }

  void number() {
    size_t end = pos_;
    bool is_float = false;
    std::string digits;
    while (end < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) {
      if (src_[end] != '_') digits += src_[end];
      ++end;
    }
    if (end + 1 < src_.size() && src_[end] == '.' && std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
      is_float = true;
      digits += '.';
      ++end;
      while (end < src_.size() && std::isdigit(static_cast<unsigned char>(src_[end]))) digits += src_[end++];
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        is_float = true;
        digits += src_.substr(end, e - end);
        end = e;
        while (end < src_.size() && std::isdigit(static_cast<unsigned char>(src_[end]))) digits += src_[end++];
      }
    }
    Token t{is_float ? Token::Type::kFloat : Token::Type::kInt, digits, 0, 0, line_};
    try {
      if (is_float) t.f = std::stod(digits);
      else t.i = std::stoll(digits);
    } catch (const std::exception&) {
      throw Error("number " + digits + " is out of range", line_);
    }
    tokens_.push_back(std::move(t));
    advance_to(end);
  }

  // Python's escapes, as jinja2 decodes string literals ("unicode-escape").
  void string_literal(char quote) {
    const int line = line_;
    std::string value;
    size_t p = pos_ + 1;
    while (true) {
      if (p >= src_.size()) throw Error("a string literal is never closed", line);
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\' || p + 1 >= src_.size()) {
        value += c;
        ++p;
        continue;
      }
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case 'a': value += '\a'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case '\n': break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (p + n > src_.size()) throw Error(std::string("a truncated \\") + e + " escape in a string", line);
          const std::string hex = src_.substr(p, n);
          if (hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
            throw Error(std::string("a bad \\") + e + " escape in a string", line);
          }
          const uint32_t cp = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
          if (cp > 0x10ffff) throw Error("a \\U escape past U+10FFFF", line);
          append_utf8(cp, &value);
          p += n;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) cp = cp * 8 + static_cast<uint32_t>(src_[p++] - '0');
            append_utf8(cp, &value);
          } else {  // Python keeps an unknown escape as it is
            value += '\\';
            value += e;
          }
      }
    }
    tokens_.push_back({Token::Type::kString, std::move(value), 0, 0, line});
    advance_to(p + 1);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(normalise_newlines(source)).run(); }

}  // namespace strata::model::jinja
