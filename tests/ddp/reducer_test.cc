// The reducer's failure paths over a process group of one rank whose allreduces the test scripts (no RPC, no peers):
// no reduction a failed backward launched is still running when its error is thrown or the next iteration begins.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"
#include "tests/common/time_scale.h"

// A namespace of its own: the binary is a unity build, and scenarios.cc's anonymous names are in the same unit.
namespace tandem::test::reducer_failures {
namespace {

using std::chrono::milliseconds;

// What the next allreduce does: completes at once, fails at once, or is still running when asked and ends `late_by`
// later, after writing kLateValue into its tensor (as a reduction still under way writes its results).
enum class Reply { kDone, kFail, kLate };
constexpr double kLateValue = 1000;

// One rank's process group (its collectives leave the tensors as they are), whose allreduces follow a script.
class ScriptedGroup final : public comm::ProcessGroup {
 public:
  ~ScriptedGroup() override { join_late(); }

  // The replies to the next allreduces, in order; once they are used, allreduces complete at once.
  void script(std::vector<Reply> replies, milliseconds late_by) {
    MutexLock lock(&mu_);
    replies_.assign(replies.begin(), replies.end());
    late_by_ = late_by;
  }
  // Late allreduces that have ended (written their tensor and completed their future).
  int late_ended() const { return late_ended_.load(); }
  // Waits for every late allreduce to end.
  void join_late() {
    std::vector<std::thread> late;
    {
      MutexLock lock(&mu_);
      late.swap(late_);
    }
    for (auto& t : late) t.join();
  }

  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  const char* transport() const override { return "gloo"; }

  rpc::Future allreduce(at::Tensor tensor, comm::ReduceOp) override {
    MutexLock lock(&mu_);
    const int index = calls_++;
    const Reply reply = replies_.empty() ? Reply::kDone : replies_.front();
    if (!replies_.empty()) replies_.pop_front();
    if (reply == Reply::kDone) return done();
    if (reply == Reply::kFail) {
      return rpc::Future::failed(absl::UnavailableError(absl::StrCat("scripted failure of allreduce ", index)));
    }
    // Bounded: a reducer that never waits for it still finds it complete within the minute.
    rpc::Future work(absl::Now() + absl::Minutes(1), absl::StrCat("scripted late allreduce ", index));
    late_.emplace_back([this, tensor, work, late_by = late_by_] {
      std::this_thread::sleep_for(late_by);
      tensor.fill_(kLateValue);
      late_ended_.fetch_add(1);
      work.set_value(c10::IValue());
    });
    return work;
  }
  rpc::Future broadcast(at::Tensor, int) override { return done(); }
  rpc::Future allgather(at::Tensor output, at::Tensor input) override {
    output.copy_(input.reshape(output.sizes()));
    return done();
  }
  rpc::Future reduce(at::Tensor, int, comm::ReduceOp) override { return done(); }
  rpc::Future gather(at::Tensor output, at::Tensor input, int) override { return allgather(output, input); }
  rpc::Future scatter(at::Tensor output, at::Tensor input, int) override {
    output.copy_(input.reshape(output.sizes()));
    return done();
  }
  rpc::Future all_to_all(at::Tensor output, at::Tensor input) override { return allgather(output, input); }
  rpc::Future reduce_scatter(at::Tensor output, at::Tensor input, comm::ReduceOp) override {
    if (!output.is_same(input)) output.copy_(input.reshape(output.sizes()));
    return done();
  }
  rpc::Future barrier() override { return done(); }
  at::Tensor shared_tensor(int64_t, at::ScalarType) override { return at::Tensor(); }  // plain buckets
  rpc::Future send(at::Tensor, int, uint32_t) override { return unsupported(); }
  rpc::Future recv(at::Tensor, int, uint32_t) override { return unsupported(); }

 private:
  static rpc::Future done() { return rpc::Future::ready(c10::IValue()); }
  static rpc::Future unsupported() {
    return rpc::Future::failed(absl::UnimplementedError("a group of one rank has no peer"));
  }

  const std::string name_ = "scripted";
  Mutex mu_;
  std::deque<Reply> replies_ ABSL_GUARDED_BY(mu_);
  milliseconds late_by_ ABSL_GUARDED_BY(mu_) = milliseconds(0);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> late_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> late_ended_{0};
};

constexpr int64_t kIn = 8, kHidden = 16, kOut = 4;

// An identity whose backward throws.
struct FailsInBackward : torch::autograd::Function<FailsInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("a backward function failed (injected)");
  }
};

// fc2 (256 + 16 bytes) is bucket 0 with a 200-byte first bucket, fc1 (512 + 64 bytes) bucket 1. With fail_backward,
// the backward throws between fc2's (its accumulators run first: bucket 0 is launched) and fc1's.
struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    torch::manual_seed(3);
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::tanh(fc1(x));
    if (fail_backward) h = FailsInBackward::apply(h);
    return fc2(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool fail_backward = false;
};

// The model's gradients against those of the same model trained alone (a group of one averages nothing).
std::string gradients_differ(TwoLayers& model, const at::Tensor& x, const at::Tensor& y) {
  TwoLayers alone;
  torch::mse_loss(alone.forward(x), y).backward();
  const auto mine = model.named_parameters(), theirs = alone.named_parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    const at::Tensor& g = mine[i].value().grad();
    if (!g.defined()) return mine[i].key() + " has no gradient";
    const double d = (g - theirs[i].value().grad()).abs().max().item<double>();
    if (!(d <= 1e-6)) return absl::StrCat(mine[i].key(), "'s gradient differs by ", d);
  }
  return "";
}

// The backward's error ("" and a test failure when it threw none).
std::string backward_error(ddp::DistributedDataParallel<TwoLayers>& ddp, const at::Tensor& x, const at::Tensor& y) {
  try {
    torch::mse_loss(ddp.forward(x), y).backward();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "the backward succeeded";
  return "";
}

struct Fixture {
  std::shared_ptr<ScriptedGroup> group = std::make_shared<ScriptedGroup>();
  std::shared_ptr<TwoLayers> model = std::make_shared<TwoLayers>();
  at::Tensor x = at::randn({4, kIn}), y = at::randn({4, kOut});
};

// The next iteration (every allreduce done at once), then whatever the failed one left running ends: the gradients
// are still this iteration's.
void expect_next_iteration_unmixed(Fixture& f, ddp::DistributedDataParallel<TwoLayers>& ddp) {
  for (auto& p : f.model->parameters()) p.mutable_grad() = at::Tensor();
  torch::mse_loss(ddp.forward(f.x), f.y).backward();
  f.group->join_late();
  EXPECT_EQ(gradients_differ(*f.model, f.x, f.y), "");
}

// Before (710ba4f), wait_all threw bucket 0's error at once, with bucket 1's allreduce still writing into the bucket,
// where the next iteration's gradients (.grad, with gradient_as_bucket_view) then were.
TEST(UnitDdpReducer, AFailedBucketIsThrownOnlyOnceTheLaterBucketsReductionEnded) {
  Fixture f;
  ddp::DistributedDataParallel<TwoLayers> ddp(f.model, f.group, {.bucket_cap_bytes = 600, .first_bucket_bytes = 200});
  ASSERT_EQ(ddp.stats().bucket_bytes, (std::vector<size_t>{272, 576}));
  f.group->script({Reply::kFail, Reply::kLate}, scaled(milliseconds(500)));
  const std::string error = backward_error(ddp, f.x, f.y);
  EXPECT_NE(error.find("scripted failure of allreduce 0"), std::string::npos) << error;
  EXPECT_EQ(f.group->late_ended(), 1) << "the backward threw while bucket 1's allreduce was still running";

  expect_next_iteration_unmixed(f, ddp);
}

// The same for the used-parameters allreduce (find_unused_parameters), launched after the buckets: before, the last
// bucket's error was thrown without waiting for it.
TEST(UnitDdpReducer, AFailedBucketIsThrownOnlyOnceTheUsedParametersReductionEnded) {
  Fixture f;
  ddp::DdpOptions options{.bucket_cap_bytes = 600, .first_bucket_bytes = 200};
  options.find_unused_parameters = true;
  ddp::DistributedDataParallel<TwoLayers> ddp(f.model, f.group, options);
  ASSERT_EQ(ddp.stats().bucket_bytes.size(), 2u);
  f.group->script({Reply::kDone, Reply::kFail, Reply::kLate}, scaled(milliseconds(500)));
  const std::string error = backward_error(ddp, f.x, f.y);
  EXPECT_NE(error.find("scripted failure of allreduce 1"), std::string::npos) << error;
  EXPECT_EQ(f.group->late_ended(), 1) << "the backward threw while the used-parameters allreduce was still running";

  expect_next_iteration_unmixed(f, ddp);
}

// A backward that throws after launching bucket 0 (a backward function failed) never reaches the reducer's end: the
// next forward waits for that reduction before it readies the reducer, since it writes into bucket 0, where the next
// backward's gradients go. Before, the next iteration ran beside it and its write landed in the new gradients.
TEST(UnitDdpReducer, TheNextForwardWaitsForTheReductionsOfABackwardThatThrew) {
  Fixture f;
  ddp::DistributedDataParallel<TwoLayers> ddp(f.model, f.group, {.bucket_cap_bytes = 600, .first_bucket_bytes = 200});
  f.group->script({Reply::kLate}, scaled(milliseconds(500)));
  f.model->fail_backward = true;
  const std::string error = backward_error(ddp, f.x, f.y);
  EXPECT_NE(error.find("a backward function failed (injected)"), std::string::npos) << error;

  f.model->fail_backward = false;
  for (auto& p : f.model->parameters()) p.mutable_grad() = at::Tensor();
  const at::Tensor out = ddp.forward(f.x);
  EXPECT_EQ(f.group->late_ended(), 1) << "the next forward readied the reducer while bucket 0's allreduce still ran";
  torch::mse_loss(out, f.y).backward();
  f.group->join_late();
  EXPECT_EQ(gradients_differ(*f.model, f.x, f.y), "");
}

}  // namespace
}  // namespace tandem::test::reducer_failures
