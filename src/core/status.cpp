#include "core/status.h"

namespace strata {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kOutOfMemory: return "OutOfMemory";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code())) + ": " + message();
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  return Status(code(), context + ": " + message());
}

Status Status::with_note(const std::string& note) const {
  if (ok()) return *this;
  return Status(code(), message() + "; " + note);
}

}  // namespace strata
