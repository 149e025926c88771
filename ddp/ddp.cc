// DistributedDataParallel's public surface (ddp/ddp.h) and its communication hooks; the Reducer behind it is in
// ddp/detail/reducer.h.
#include "tandem/ddp/ddp.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "absl/base/thread_annotations.h"
#include "tandem/ddp/detail/reducer.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::ddp {

namespace detail {

void fail(absl::StatusCode code, const std::string& message) {
  throw RpcError(absl::Status(code, "DistributedDataParallel: " + message));
}

namespace {
Mutex g_probe_mu;
// Set by ddp_dist_autograd/: a distributed autograd context is current.
std::function<int64_t()> g_external_probe ABSL_GUARDED_BY(g_probe_mu);
}  // namespace

int64_t external_backward_id() {
  MutexLock lock(&g_probe_mu);
  return g_external_probe ? g_external_probe() : -1;
}

}  // namespace detail

using detail::fail;

CommHook allreduce_hook() {
  return [](comm::ProcessGroup& group, at::Tensor bucket) { return group.allreduce(bucket, comm::ReduceOp::kAvg); };
}

namespace {
CommHook compress_hook(at::ScalarType wire) {
  return [wire](comm::ProcessGroup& group, at::Tensor bucket) {
    at::Tensor compressed = bucket.to(wire).div_(group.size());  // divide first: the sum stays in range
    return group.allreduce(compressed, comm::ReduceOp::kSum).then([bucket, compressed](const rpc::Future& f) {
      (void)f.value();  // rethrows the allreduce's error
      bucket.copy_(compressed);
      return c10::IValue();
    });
  };
}
}  // namespace

CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() { return compress_hook(at::kBFloat16); }

DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         std::shared_ptr<comm::ProcessGroup> group, DdpOptions options)
    : impl_(std::make_shared<detail::Reducer>()) {
  if (!module || !group) fail(absl::StatusCode::kInvalidArgument, "a module and a process group are required");
  impl_->module = std::move(module);
  impl_->group = std::move(group);
  impl_->options = options;
  impl_->collect();
  impl_->verify_same_parameters();
  {
    at::NoGradGuard no_grad;
    impl_->broadcast_from(0, /*with_params=*/true);
  }
  std::vector<size_t> reverse;
  for (size_t i = impl_->params.size(); i-- > 0;) reverse.push_back(i);
  if (!reverse.empty()) impl_->assign_buckets(reverse);
  impl_->install_hooks();
}

DistributedDataParallelBase::~DistributedDataParallelBase() = default;

DistributedDataParallelBase::NoSync::NoSync(DistributedDataParallelBase& ddp)
    : ddp_(ddp), previous_(ddp.impl_->require_sync) {
  ddp_.impl_->require_sync = false;
}
DistributedDataParallelBase::NoSync::~NoSync() { ddp_.impl_->require_sync = previous_; }

void DistributedDataParallelBase::register_comm_hook(CommHook hook) {
  if (impl_->iterations > 0 || impl_->armed) {
    fail(absl::StatusCode::kFailedPrecondition, "register_comm_hook must come before the first forward");
  }
  impl_->hook = std::move(hook);
}

void DistributedDataParallelBase::join() { impl_->join(); }
void DistributedDataParallelBase::reduce_external(const GradientOf& grad_of, const SetAverage& set_average,
                                                  const std::string& what) {
  impl_->reduce_external(grad_of, set_average, what);
}

void set_external_backward_probe(std::function<int64_t()> probe) {
  MutexLock lock(&detail::g_probe_mu);
  detail::g_external_probe = std::move(probe);
}
void DistributedDataParallelBase::pre_forward() { impl_->pre_forward(); }
void DistributedDataParallelBase::post_forward(const std::vector<at::Tensor>& outputs) { impl_->post_forward(outputs); }
comm::ProcessGroup& DistributedDataParallelBase::group() const { return *impl_->group; }

DdpStats DistributedDataParallelBase::stats() const {
  DdpStats s;
  for (const auto& b : impl_->buckets) s.bucket_bytes.push_back(b.flat.nbytes());
  s.iterations = impl_->iterations;
  s.buckets_launched = static_cast<int64_t>(impl_->next_launch);
  s.rebuilt = impl_->rebuilt;
  return s;
}

}  // namespace tandem::ddp
