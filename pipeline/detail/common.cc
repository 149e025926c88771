#include "tandem/pipeline/detail/common.h"

#include <sys/resource.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/rpc.h"

namespace tandem::pipeline::detail {

void fail(absl::StatusCode code, const std::string& message) {
  throw RpcError(absl::Status(code, "pipeline: " + message));
}

namespace {
struct SendFault {
  std::atomic<bool> set{false};
  Mutex mu;
  std::function<void(int64_t, int64_t, int)> fault ABSL_GUARDED_BY(mu);
};
SendFault& send_fault() {
  static auto* f = new SendFault;  // never destroyed: drivers may send until exit
  return *f;
}
}  // namespace

namespace {
std::atomic<int64_t> g_sums_posted{0};
}  // namespace
int64_t sums_posted_for_tests() { return g_sums_posted.load(); }
void note_sum_posted() { g_sums_posted.fetch_add(1); }

void set_send_fault_for_tests(std::function<void(int64_t pipe, int64_t step, int rank)> fault) {
  SendFault& f = send_fault();
  MutexLock lock(&f.mu);
  f.set.store(fault != nullptr);
  f.fault = std::move(fault);
}

void send_fault_for_tests(int64_t pipe, int64_t step, int rank) {
  SendFault& f = send_fault();
  if (!f.set.load()) return;
  std::function<void(int64_t, int64_t, int)> fault;
  {
    MutexLock lock(&f.mu);
    fault = f.fault;
  }
  if (fault) fault(pipe, step, rank);  // outside the lock: it may throw
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string self_name() { return rpc::is_initialized() ? rpc::get_worker_info().name : "(local)"; }

Mutex& build_mutex() {
  static auto* mu = new Mutex;
  return *mu;
}

int64_t status_kib(const char* field) {
  const std::string prefix = std::string(field) + ":";
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(prefix, 0) == 0) return std::strtoll(line.c_str() + prefix.size(), nullptr, 10);
  }
  return -1;
}

int64_t peak_resident_kib() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0 || usage.ru_maxrss <= 0) return -1;
  return usage.ru_maxrss;  // KiB on Linux
}

double parameter_weight(const torch::nn::Module& layer) {
  double n = 1;
  for (const auto& p : layer.parameters()) n += static_cast<double>(p.numel());
  return n;
}

double fastest_pass(const std::function<at::Tensor(const at::Tensor&)>& layer, const at::Tensor& x, at::Tensor* out) {
  double best = std::numeric_limits<double>::infinity();
  at::Tensor y;
  for (int rep = 0; rep < 3; ++rep) {
    at::Tensor in = x.is_floating_point() ? x.detach().requires_grad_(true) : x;
    const auto t0 = Clock::now();
    y = layer(in);
    if (y.requires_grad()) y.sum().backward();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  *out = y.detach();
  return best;
}

}  // namespace tandem::pipeline::detail
