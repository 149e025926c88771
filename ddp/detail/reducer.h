// The Reducer behind DistributedDataParallel (ddp/ddp.h): buckets, gradient-ready hooks, overlapped allreduce, the
// used-map over accumulation windows, taps for an external (distributed autograd) backward, and join.
//
// Threads: the training thread runs forward (pre_forward/post_forward) and join(); the autograd engine's thread runs
// the ready hooks, taps and finalize(). They never overlap for one DDP instance (a backward runs between two forwards),
// so the state below is not locked; collectives run on the process group's own thread. The exception: a distributed
// backward's taps run on RPC threads, several at once, and one of a backward that failed elsewhere may still run after
// the next forward began; tap_mu serialises them with each other, with the reduction, and with pre_forward,
// post_forward and join.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/ddp/ddp.h"
#include "tandem/sync/sync.h"

namespace tandem::ddp::detail {

[[noreturn]] void fail(absl::StatusCode code, const std::string& message);
// Compares `tensors`' count, elements, shapes and dtypes across `group` (an allgather): OK when every rank holds the
// same; otherwise FAILED_PRECONDITION naming the first rank that differs from rank 0 (what it holds against rank 0's,
// then `rule`). Collective.
absl::Status same_on_every_rank(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                                const std::string& rule);
// The id of the coming backward when it runs on another engine, else -1 (set_external_backward_probe).
int64_t external_backward_id();

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  using GradientOf = DistributedDataParallelBase::GradientOf;
  using SetAverage = DistributedDataParallelBase::SetAverage;

  struct Param {
    std::string name;
    at::Tensor tensor;
    std::shared_ptr<torch::autograd::Node> accumulator;  // retained: the tensor holds it only weakly
    size_t bucket = 0, offset = 0;
  };
  struct Bucket {
    std::vector<size_t> params;
    at::Tensor flat;
    bool shared = false;  // flat is the group's shared tensor (ProcessGroup::shared_tensor)
    size_t pending = 0;
    rpc::Future work;
  };

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<comm::ProcessGroup> group;
  DdpOptions options;
  // None: the built-in path (each gradient divided as it lands in its bucket, then a sum allreduce; in a shared
  // bucket, the allreduce averages as it reduces instead: no pass of its own over each gradient).
  CommHook hook;
  std::vector<Param> params;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;

  // The current iteration.
  bool require_sync = true;
  // The coming backward runs on another engine (distributed autograd, capture mode: no accumulator hooks): forward
  // put a tap between each parameter and its accumulator, which lands the gradient in its bucket as that backward
  // computes it.
  bool tapping = false;
  // The external backward (its id) whose taps land gradients, or -1: a tap put in a graph under another backward (its
  // iteration was abandoned, or its backward failed elsewhere and still runs here) passes its gradient on to its own
  // context without landing it in this iteration's buckets. Two forwards under one backward's id both land (a
  // parameter reached by both is then an error: "got a gradient twice").
  int64_t tap_backward = -1;
  // This accumulation window had a no_sync forward before an external backward: its gradients are summed in the
  // context, not seen by taps, so the window is reduced after backward from what the context holds.
  bool window_accumulates_externally = false;
  // Serialises the taps of an external backward with each other, with its reduction and with the next forward's
  // pre_forward and post_forward (or join): distributed autograd runs the gradient messages of one context on several
  // RPC threads at once (outputs sent to two workers), and each may reach taps (GradTap); a message of a backward that
  // failed elsewhere may still run here when the next forward begins.
  Mutex tap_mu;
  bool armed = false;            // post_forward readied the reducer: the next backward reduces
  bool callback_queued = false;  // finalize() is queued on the autograd engine
  std::vector<char> ready;
  // Parameters that got a gradient here in any backward since the last synchronised one, no_sync micro-steps
  // included (pytorch#124193): what the used-map allreduce reports, so that a parameter any rank used anywhere in an
  // accumulation window is reduced and written back on every rank.
  std::vector<char> locally_used;
  // gradient_as_bucket_view: the .grad of parameters no backward reached, as they were before landing divided them in
  // their buckets, so that a parameter no rank used keeps its .grad exactly (as with copies).
  std::vector<std::pair<size_t, at::Tensor>> untouched;
  size_t next_launch = 0;
  // Bucket rebuilding and statistics.
  bool record_order = true, rebuild_pending = false, rebuilt = false;
  std::vector<size_t> ready_order;
  int64_t iterations = 0;
  int64_t last_active = -1;  // uneven inputs: the highest rank that still had data, last time anyone had

  std::string where() const;

  // ---- set-up ----

  void collect();

  // All ranks must hold the same parameters: count, elements, and a digest of shapes and dtypes.
  void verify_same_parameters();

  void broadcast_from(int root, bool with_params);

  void install_hooks();

  // Buckets over the parameters in `order`: one dtype per bucket, the first of each dtype capped at
  // first_bucket_bytes, the others at bucket_cap_bytes; buckets launch in the order they were opened.
  void assign_buckets(const std::vector<size_t>& order);

  at::Tensor slice(size_t i) const;

  // Parameter i's place in its bucket, shaped like the parameter: it shares the bucket's storage without being an
  // autograd view, so that LibTorch's Optimizer::zero_grad (which detaches .grad in place) accepts it as .grad.
  at::Tensor bucket_view(size_t i) const;

  // ---- forward ----

  // Uneven inputs: every rank says whether it still has data (its rank, or -1) and whether the coming backward
  // reduces. Returns {highest rank with data or -1, whether any reduces}.
  std::pair<int64_t, bool> agree(bool active, bool sync);

  // Buckets rebuilt in the order gradients became ready in the first iteration: rank 0's order, so that every rank
  // launches the same buckets in the same order.
  void rebuild();

  void pre_forward();

  void post_forward(const std::vector<at::Tensor>& outputs);

  // Between a parameter's uses in the graph and its accumulator: the gradient of an external backward (which runs no
  // accumulator hooks) reaches the reducer here, summed over the parameter's uses, as soon as it is computed.
  struct GradTap : torch::autograd::Node {
    GradTap(std::weak_ptr<Reducer> impl, size_t index, int64_t backward)
        : impl(std::move(impl)), index(index), backward(backward) {}
    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
      if (auto s = impl.lock()) {
        MutexLock lock(&s->tap_mu);
        if (backward == s->tap_backward) s->tapped(index, grads.at(0));
      }
      return std::move(grads);
    }
    std::string name() const override { return "tandem::ddp::GradTap"; }
    std::weak_ptr<Reducer> impl;
    size_t index;
    int64_t backward;  // tap_backward when it was put in
  };

  // One walk of the graph forward produced, from its outputs: which parameters' accumulators it reaches (by parameter);
  // with `tap`, every edge into one of them is rewritten to go through that parameter's tap.
  std::vector<char> walk_graph(const std::vector<at::Tensor>& outputs, bool tap);

  // Parameter i is accounted for in its bucket (its gradient, or zeros).
  void set_ready(size_t i);

  // Parameter i's gradient of this backward has landed in its bucket: count it and launch what is complete.
  void gradient_landed(size_t i);

  void tapped(size_t i, const at::Tensor& grad);

  // Before a synchronised backward. The used-map is not reset here: it covers the whole accumulation window.
  void reset_iteration();

  // ---- backward ----

  void mark_ready(size_t i);

  // Parameter i's gradient into its bucket. Without a comm hook, in a bucket that is not shared, the average's
  // division happens here, spread over backward as PyTorch's Reducer does (in the copy, or in place), instead of over
  // whole buckets at the end.
  void land(size_t i);

  // Whether bucket b's allreduce divides (a shared bucket without a comm hook): then nothing divides as it lands.
  bool reduce_averages(const Bucket& b) const { return b.shared && !hook; }

  // Parameter i's `slice` = `grad`, divided by the group's size unless the reduction or a comm hook averages: the
  // same division as land()'s in place, so that both gradient modes give bit-identical results.
  void copy_scaled(size_t i, at::Tensor& slice, const at::Tensor& grad) const;

  // Bucket `index`'s reduction, once complete: the comm hook's, an average (shared), or a sum of the already divided
  // gradients. One that cannot start is a failed future naming the bucket and this rank.
  rpc::Future reduce(size_t index);

  // Buckets start in index order only, so every rank issues the same collectives in the same order.
  void launch_ready();

  // Waits for the reductions launched in this iteration (each within its future's deadline; their errors are the
  // backward's to report): one still running writes into its bucket, which the next backward fills (and .grad, with
  // gradient_as_bucket_view). Before an iteration's error is thrown, and before a new iteration begins after one that
  // did not end (its backward threw).
  void settle_launched();

  // Under tap_mu, as a forward begins (pre_forward) and before it readies the reducer (post_forward), and as a rank
  // joins: an iteration that did not end (its backward threw, or finalize did) is disarmed and its launched reductions
  // are settled.
  void end_unfinished();

  // At the end of backward (queued on the autograd engine by the first hook).
  void finalize();

  // After a synchronised backward (or its shadow under join): a new accumulation window begins.
  void finish_iteration();

  // gradient_as_bucket_view: paths that write the buckets without landing .grad in them first (distributed autograd,
  // join's shadow) give the parameters whose .grad shares a bucket their own copy, so .grad is what it would be with
  // copies. It is shared again when the next local backward lands it.
  void unshare_gradients();

  // ---- external backward (distributed autograd, through ddp_dist_autograd/) ----

  void reduce_external(const GradientOf& grad_of, const SetAverage& set_average, const std::string& what);

  void write_averages(const at::Tensor& used, const SetAverage& set_average);

  [[noreturn]] void fail_missing(std::vector<std::string> missing, const std::string& in) const;

  // Whether parameter i is to be written back: with find_unused_parameters, only if some rank used it.
  static bool used_anywhere(const at::Tensor& used, size_t i);

  // After every bucket was launched: with find_unused_parameters, the max-allreduce of the ranks' used-maps (returned);
  // then waits for all of it. Throws RpcError on a group failure.
  at::Tensor wait_all();

  // ---- uneven inputs ----

  void join();
};

}  // namespace tandem::ddp::detail
