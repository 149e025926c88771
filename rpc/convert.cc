#include "tandem/rpc/convert.h"

#include "absl/status/status.h"
#include "tandem/rpc/errors.h"

namespace tandem::rpc::detail {

void conversion_error(const char* expected, const c10::IValue& got) {
  std::string what = std::string("expected ") + expected + ", got " + got.tagKind();
  if (got.isInt()) what += " " + std::to_string(got.toInt());
  throw_error(absl::InvalidArgumentError(what));
}

}  // namespace tandem::rpc::detail
