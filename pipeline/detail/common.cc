#include "pipeline/detail/common.h"

#include "rpc/errors.h"
#include "rpc/rpc.h"

namespace tandem::pipeline::detail {

void fail(absl::StatusCode code, const std::string& message) {
  throw RpcError(absl::Status(code, "pipeline: " + message));
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void check_not_empty(const at::Tensor& input) {
  if (!input.defined() || input.dim() == 0 || input.size(0) == 0) {
    fail(absl::StatusCode::kInvalidArgument, "the batch is empty (the input needs at least one row)");
  }
}

std::string self_name() { return rpc::is_initialized() ? rpc::get_worker_info().name : "(local)"; }

}  // namespace tandem::pipeline::detail
