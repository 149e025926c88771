#include "rpc/convert.h"

#include <stdexcept>

namespace tandem::rpc::detail {

void conversion_error(const char* expected, const c10::IValue& got) {
  std::string what = std::string("expected ") + expected + ", got " + got.tagKind();
  if (got.isInt()) what += " " + std::to_string(got.toInt());
  throw std::invalid_argument(what);
}

}  // namespace tandem::rpc::detail
