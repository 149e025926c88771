#include "pipeline/detail/common.h"

#include <cstdlib>
#include <fstream>
#include <string>

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

Mutex& build_mutex() {
  static auto* mu = new Mutex;
  return *mu;
}

int64_t peak_resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

}  // namespace tandem::pipeline::detail
