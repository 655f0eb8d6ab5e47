// Status and Result<T>: how errors the environment can cause (I/O, memory budgets, bad
// configs, corrupt files) travel to the user. A message says what went wrong, naming the
// file, key or tier, and what to do about it. Programmer errors use CHECK (check.h) instead.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "core/check.h"

namespace strata {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,  // bad config value, bad command line
  kNotFound,         // missing file or key
  kIOError,          // read/write/fsync failed
  kCorruption,       // wrong magic, truncated file, checksum mismatch
  kOutOfMemory,      // a tier budget or an allocation cannot hold a request
  kUnimplemented,    // valid request this build cannot serve
  kInternal,
};

const char* status_code_name(StatusCode code);

// Cheap when OK (no allocation). Copyable.
class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) { return Status(StatusCode::kInvalidArgument, std::move(msg)); }
  static Status NotFound(std::string msg) { return Status(StatusCode::kNotFound, std::move(msg)); }
  static Status IOError(std::string msg) { return Status(StatusCode::kIOError, std::move(msg)); }
  static Status Corruption(std::string msg) { return Status(StatusCode::kCorruption, std::move(msg)); }
  static Status OutOfMemory(std::string msg) { return Status(StatusCode::kOutOfMemory, std::move(msg)); }
  static Status Unimplemented(std::string msg) { return Status(StatusCode::kUnimplemented, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  const std::string& message() const;
  // "IOError: <message>", or "OK".
  std::string to_string() const;
  // Returns a copy whose message is "<context>: <message>".
  Status with_context(const std::string& context) const;
  // Returns a copy whose message is "<message>; <note>" (what happened because of it).
  Status with_note(const std::string& note) const;

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  Status(StatusCode code, std::string msg) : state_(std::make_shared<State>(State{code, std::move(msg)})) {}
  std::shared_ptr<const State> state_;
};

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit on purpose
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    CHECK(!std::get<Status>(v_).ok());
  }
  bool ok() const { return v_.index() == 0; }
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }
  T& value() & {
    CHECK(ok());
    return std::get<T>(v_);
  }
  const T& value() const& {
    CHECK(ok());
    return std::get<T>(v_);
  }
  T&& value() && {
    CHECK(ok());
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace strata

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::strata::Status _st = (expr);                 \
    if (!_st.ok()) return _st;                     \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or returns its Status.
#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_IMPL(STRATA_CONCAT(_res_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
