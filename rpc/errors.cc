#include "tandem/rpc/errors.h"

#include <c10/util/Exception.h>

#include <new>

namespace tandem {
namespace {

absl::Status failing(const absl::Status& status) {
  return status.ok() ? absl::InternalError("Error from an OK status") : status;
}

std::string what_of(const absl::Status& status) {
  return std::string(absl::StatusCodeToString(status.code())) + ": " + std::string(status.message());
}

}  // namespace

Error::Error(const absl::Status& status) : std::runtime_error(what_of(failing(status))), status_(failing(status)) {}

void throw_error(absl::Status status) { throw Error(status); }

absl::Status status_from_exception(const std::exception& e) {
  if (const auto* error = dynamic_cast<const Error*>(&e)) return error->status();
  if (dynamic_cast<const std::bad_alloc*>(&e)) {
    return absl::ResourceExhaustedError(std::string("out of memory: ") + e.what());
  }
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return absl::UnknownError(c10_error->what_without_backtrace());
  }
  return absl::UnknownError(e.what());
}

absl::Status status_from_current_exception() {
  try {
    throw;
  } catch (const std::exception& e) {
    return status_from_exception(e);
  } catch (...) {
    return absl::UnknownError("unknown exception");
  }
}

}  // namespace tandem
