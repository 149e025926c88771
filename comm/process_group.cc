// ProcessGroup on Gloo: TCP connections between the members, set up through the job's rendezvous store.
#include "tandem/comm/process_group.h"

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <list>
#include <set>
#include <thread>

#include "absl/base/attributes.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "tandem/comm/detail/shm.h"
#include "tandem/log/log.h"
#include "tandem/metrics/metrics.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rpc/store.h"
#include "tandem/sync/sync.h"
#include "tandem/sync/threads.h"

namespace tandem::comm {
namespace {

using std::chrono::milliseconds;

// Gloo's rendezvous through the job's store, under a prefix of the group's own.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(rpc::Store& store, std::string prefix, milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    throw_if_error(store_.set(prefix_ + key, std::string(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(prefix_ + key, timeout_);
    throw_if_error(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    throw_if_error(store_.wait(full, timeout));
  }

 private:
  rpc::Store& store_;
  const std::string prefix_;
  const milliseconds timeout_;
};

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

// Reductions for the 16-bit floating types, which Gloo does not provide: computed in float, rounded once.
template <typename T>
void sum16(void* c, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(c);
  const auto *x = static_cast<const T*>(a), *y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(y[i]));
}
template <typename T>
void product16(void* c, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(c);
  const auto *x = static_cast<const T*>(a), *y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(y[i]));
}
template <typename T>
void min16(void* c, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(c);
  const auto *x = static_cast<const T*>(a), *y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<float>(x[i]) <= static_cast<float>(y[i]) ? x[i] : y[i];
}
template <typename T>
void max16(void* c, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(c);
  const auto *x = static_cast<const T*>(a), *y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<float>(x[i]) >= static_cast<float>(y[i]) ? x[i] : y[i];
}
template <typename T>
constexpr bool is16 = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

template <typename T>
ReduceFn reduce_fn(ReduceOp op) {
  if constexpr (is16<T>) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return &sum16<T>;
      case ReduceOp::kProduct:
        return &product16<T>;
      case ReduceOp::kMin:
        return &min16<T>;
      case ReduceOp::kMax:
        return &max16<T>;
    }
    return nullptr;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &gloo::sum<T>;
    case ReduceOp::kProduct:
      return &gloo::product<T>;
    case ReduceOp::kMin:
      return &gloo::min<T>;
    case ReduceOp::kMax:
      return &gloo::max<T>;
  }
  return nullptr;
}

// The dtypes collectives reduce and copy (dispatch() below).
bool supported(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// Calls f.template operator()<T>() with T the C++ type of `dtype`.
template <typename F>
void dispatch(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kDouble:
      return f(double{});
    case at::kHalf:
      return f(c10::Half{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kChar:
      return f(int8_t{});
    case at::kByte:
      return f(uint8_t{});
    case at::kInt:
      return f(int32_t{});
    case at::kLong:
      return f(int64_t{});
    default:  // refused by check_tensor before the operation was queued
      throw_error(absl::UnimplementedError(absl::StrCat("collectives do not support dtype ", c10::toString(dtype))));
  }
}

// Checked when an operation is called, before it is queued: a bad argument fails that call (tandem::Error) and never
// the group. Point-to-point operations move bytes, so any dtype will do (`any_dtype`).
void check_tensor(const at::Tensor& t, const char* what, bool any_dtype = false) {
  if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) {
    throw_error(absl::InvalidArgumentError(absl::StrCat(what, " must be a defined, contiguous CPU tensor")));
  }
  if (!any_dtype && !supported(t.scalar_type())) {
    throw_error(absl::UnimplementedError(absl::StrCat(what, " has dtype ", c10::toString(t.scalar_type()),
                                                      ", which collectives do not support (float, double, half, "
                                                      "bfloat16, int8, uint8, int32, int64)")));
  }
}

ABSL_CONST_INIT Mutex g_names_mu(absl::kConstInit);
// Group names used by this worker in this job: each names one group.
std::set<std::string> g_names ABSL_GUARDED_BY(g_names_mu);
// Those of g_names whose group was destroyed here, for the other members to ask after a failure (kDestroyed): over
// Gloo they see only a connection closed, and this worker still answers pings. Kept here, not in the job's store, so
// that ~GlooGroup writes nothing remote (no round trip before it cancels, nothing left to fail during shutdown).
// Never destroyed: a group a static holds may go, and RPC threads may ask, during static destruction.
std::set<std::string>* const g_destroyed ABSL_PT_GUARDED_BY(g_names_mu) = new std::set<std::string>;
// The job this worker is in: counted up by the stop hook. A group records its job, and a group of an earlier job
// (held past shutdown) destroyed after a new job created a group of the same name records nothing in g_destroyed.
uint64_t g_job ABSL_GUARDED_BY(g_names_mu) = 0;

constexpr const char* kPing = "__tandem.comm.ping";
// (group name) -> bool: whether this worker destroyed its group of that name in this job.
constexpr const char* kDestroyed = "__tandem.comm.destroyed";
// How long a failed group waits for its members to answer a ping, to name the ones that are gone. Fixed: it tests
// whether a worker's RPC server is alive, which takes a round trip whatever the group's operations cost.
constexpr std::chrono::milliseconds kPingTimeout{1000};

using Clock = std::chrono::steady_clock;

// What the members of a failed group say, in the form appended to an error ("; rank 1 (worker 'w1') ..."), each part
// "" when none.
struct MembersHeard {
  std::string unanswering;  // "... does not answer: <cause>" for each member that did not answer a ping
  std::string destroyed;    // "... destroyed its process group" for each member that says so
};

// Gloo's errors name a socket, not a rank: after a failure, asks each member (job ranks, by group rank; `self`
// excluded) for a ping and, when `group` is set, whether it destroyed its group of that name (it then still answers
// pings), all at once, each call within kPingTimeout. Never throws: it runs in failure paths, also while RPC shuts
// down.
MembersHeard ask_members(const std::vector<int>& job_ranks, int self, const std::string& group) {
  MembersHeard heard;
  if (!rpc::is_initialized()) return heard;
  struct Asked {
    int rank;
    rpc::Future ping, destroyed;
  };
  std::vector<Asked> asked;
  for (int r = 0; r < static_cast<int>(job_ranks.size()); ++r) {
    if (r == self) continue;
    asked.push_back({r, rpc::call(job_ranks[r], kPing, {}, kPingTimeout),
                     group.empty() ? rpc::Future::ready(c10::IValue(false))
                                   : rpc::call(job_ranks[r], kDestroyed, {c10::IValue(group)}, kPingTimeout)});
  }
  for (const Asked& a : asked) {
    const auto info = rpc::find_worker_info(job_ranks[a.rank]);
    const std::string who = absl::StrCat("; rank ", a.rank, " (worker '", info ? info->name : "?", "')");
    if (const absl::Status s = a.ping.status(); !s.ok()) {
      absl::StrAppend(&heard.unanswering, who, " does not answer: ", s.message());
    }
    // An answer that is not a bool (another build's function) says nothing.
    if (a.destroyed.status().ok() && a.destroyed.value().isBool() && a.destroyed.value().toBool()) {
      absl::StrAppend(&heard.destroyed, who, " destroyed its process group");
    }
  }
  return heard;
}

// The error of an operation (or the set-up) that Gloo failed after `elapsed`, decided by facts, not by Gloo's words:
// every member alive, none that destroyed group `group` (empty in the set-up: none yet) and the timeout spent is
// DEADLINE_EXCEEDED (a rank did not take part in time); otherwise UNAVAILABLE, naming the members that do not answer
// and those that destroyed the group.
absl::Status gloo_failure(const std::string& prefix, const std::string& cause, Clock::duration elapsed,
                          milliseconds timeout, const std::vector<int>& job_ranks, int self,
                          const std::string& group = "") {
  const MembersHeard heard = ask_members(job_ranks, self, group);
  if (heard.unanswering.empty() && heard.destroyed.empty() && elapsed >= timeout) {
    return absl::DeadlineExceededError(
        absl::StrCat(prefix, "a rank did not take part within ", timeout.count(), " ms: ", cause));
  }
  return absl::UnavailableError(prefix + cause + heard.unanswering + heard.destroyed);
}

uint64_t current_job() {
  MutexLock lock(&g_names_mu);
  return g_job;
}

const bool g_installed = [] {
  rpc::register_function(kPing, [] {});
  rpc::register_function(kDestroyed, [](std::string name) {
    MutexLock lock(&g_names_mu);
    return g_destroyed->count(name) > 0;
  });
  rpc::add_stop_hook([] {  // a new job (init_rpc again) starts with a new store: names are free again
    MutexLock lock(&g_names_mu);
    g_names.clear();
    g_destroyed->clear();
    ++g_job;
  });
  return true;
}();

class GlooGroup final : public ProcessGroup {
 public:
  GlooGroup(std::string name, int rank, int size, std::shared_ptr<gloo::rendezvous::Context> ctx,
            ProcessGroupOptions options, std::vector<int> job_ranks, std::unique_ptr<detail::ShmGroup> shm)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        options_(options),
        ctx_(std::move(ctx)),
        job_ranks_(std::move(job_ranks)),
        shm_(std::move(shm)),
        job_(current_job()) {
    thread_ = std::thread([this] { loop(); });
  }
  ~GlooGroup() override {
    std::deque<Op> cancelled;
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      cancelled.swap(queue_);  // never started: they fail below, without running (each could wait a timeout)
      pending_ -= static_cast<int64_t>(cancelled.size());
    }
    {
      MutexLock lock(&g_names_mu);
      if (job_ == g_job) g_destroyed->insert(name_);
    }
    // The others learn before anything here takes time. Over shared memory: their waits for an arrival of this rank
    // fail naming it (the barriers it reached still pass), and the operation running here stops at its next barrier.
    // Over Gloo: their operations fail when the connections close (ctx_, after the join), and their failure() asks
    // this worker (kDestroyed), which answers from g_destroyed.
    if (shm_) shm_->destroyed();
    for (Op& op : cancelled) {
      op.run = nullptr;
      metrics::collective_recorder(name_, op.what, transport_of(op.what))
          .record(Clock::duration::zero(), false, op.bytes, 0);
      op.done.set_error(absl::CancelledError(absl::StrCat(
          where(op.what), " #", op.seq, ": the group was destroyed on this rank before the operation started")));
    }
    // The operation in progress: over shared memory it ends at its next barrier (CANCELLED); over Gloo, which cannot
    // be interrupted while it writes the tensors, within its timeout (each of Gloo's waits), as before.
    thread_.join();
    waiters_.join_all();  // each ends within the timeout
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const char* transport() const override { return shm_ ? "shared_memory" : "gloo"; }

  rpc::Future allreduce(at::Tensor t, ReduceOp op) override {
    check_tensor(t, "allreduce: the tensor");
    check_op(t, op, "allreduce");
    return submit("allreduce", t, static_cast<int>(op), [this, t, op](uint32_t tag) {
      shm_ ? shm_->allreduce(t, op, deadline_) : run_allreduce(t, op, tag);
    });
  }

  rpc::Future reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op) override {
    check_tensor(output, "reduce_scatter: the output");
    check_chunks(input, output, "reduce_scatter");
    check_op(input, op, "reduce_scatter");
    return submit("reduce_scatter", input, static_cast<int>(op), [this, output, input, op](uint32_t tag) {
      if (shm_) return shm_->reduce_scatter(output, input, op, deadline_);
      at::Tensor whole = input.clone();
      run_allreduce(whole, op, tag);
      output.copy_(whole.view({size_, -1})[rank_].view_as(output));
    });
  }

  rpc::Future send(at::Tensor t, int dst, uint32_t tag) override { return p2p("send", t, dst, tag); }
  rpc::Future recv(at::Tensor t, int src, uint32_t tag) override { return p2p("recv", t, src, tag); }

  rpc::Future broadcast(at::Tensor t, int root) override {
    check_tensor(t, "broadcast: the tensor");
    check_root(root, "broadcast");
    return submit("broadcast", t, root, [this, t, root](uint32_t tag) {
      if (shm_) return shm_->broadcast(t, root, deadline_);
      dispatch(t.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::BroadcastOptions o(ctx_);
        o.setOutput(t.data_ptr<T>(), static_cast<size_t>(t.numel()));
        o.setRoot(root);
        tagged(o, tag);
        gloo::broadcast(o);
      });
    });
  }

  rpc::Future allgather(at::Tensor output, at::Tensor input) override {
    check_tensor(input, "allgather: the input");
    check_chunks(output, input, "allgather");
    return submit("allgather", input, 0, [this, output, input](uint32_t tag) {
      if (shm_) return shm_->allgather(output, input, deadline_);
      dispatch(input.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::AllgatherOptions o(ctx_);
        o.setInput(input.data_ptr<T>(), static_cast<size_t>(input.numel()));
        o.setOutput(output.data_ptr<T>(), static_cast<size_t>(output.numel()));
        tagged(o, tag);
        gloo::allgather(o);
      });
    });
  }

  rpc::Future reduce(at::Tensor t, int root, ReduceOp op) override {
    check_tensor(t, "reduce: the tensor");
    check_root(root, "reduce");
    check_op(t, op, "reduce");
    return submit("reduce", t, root * 8 + static_cast<int>(op), [this, t, root, op](uint32_t tag) {
      at::Tensor result = at::empty_like(t);  // Gloo's output; the tensor itself changes on the root only
      dispatch(t.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::ReduceOptions o(ctx_);
        o.setInput(t.data_ptr<T>(), static_cast<size_t>(t.numel()));
        o.setOutput(result.data_ptr<T>(), static_cast<size_t>(result.numel()));
        o.setRoot(root);
        o.setReduceFunction(reduce_fn<T>(op));
        tagged(o, tag);
        gloo::reduce(o);
      });
      if (rank_ == root) {
        t.copy_(result);
        if (op == ReduceOp::kAvg) t.div_(size_);
      }
    });
  }

  rpc::Future gather(at::Tensor output, at::Tensor input, int root) override {
    check_tensor(input, "gather: the input");
    check_root(root, "gather");
    if (rank_ == root) check_chunks(output, input, "gather");
    return submit("gather", input, root, [this, output, input, root](uint32_t tag) {
      dispatch(input.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::GatherOptions o(ctx_);
        o.setInput(input.data_ptr<T>(), static_cast<size_t>(input.numel()));
        if (rank_ == root) o.setOutput(output.data_ptr<T>(), static_cast<size_t>(output.numel()));
        o.setRoot(root);
        tagged(o, tag);
        gloo::gather(o);
      });
    });
  }

  rpc::Future scatter(at::Tensor output, at::Tensor input, int root) override {
    check_tensor(output, "scatter: the output");
    check_root(root, "scatter");
    if (rank_ == root) check_chunks(input, output, "scatter");
    return submit("scatter", output, root, [this, output, input, root](uint32_t tag) {
      dispatch(output.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::ScatterOptions o(ctx_);
        const size_t n = static_cast<size_t>(output.numel());
        std::vector<T*> chunks;
        if (rank_ == root) {
          for (int i = 0; i < size_; ++i) chunks.push_back(input.data_ptr<T>() + i * n);
          o.setInputs(chunks, n);
        }
        o.setOutput(output.data_ptr<T>(), n);
        o.setRoot(root);
        tagged(o, tag);
        gloo::scatter(o);
      });
    });
  }

  rpc::Future all_to_all(at::Tensor output, at::Tensor input) override {
    check_tensor(output, "all_to_all: the output");
    check_tensor(input, "all_to_all: the input");
    if (output.scalar_type() != input.scalar_type() || output.numel() != input.numel() || input.numel() % size_ != 0) {
      throw_error(
          absl::InvalidArgumentError("all_to_all: input and output must have the same dtype and size() equal chunks"));
    }
    return submit("all_to_all", input, 0, [this, output, input](uint32_t tag) {
      dispatch(input.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::AlltoallOptions o(ctx_);
        o.setInput(input.data_ptr<T>(), static_cast<size_t>(input.numel()));
        o.setOutput(output.data_ptr<T>(), static_cast<size_t>(output.numel()));
        tagged(o, tag);
        gloo::alltoall(o);
      });
    });
  }

  at::Tensor shared_tensor(int64_t numel, at::ScalarType dtype) override {
    if (numel < 0 || static_cast<uint64_t>(numel) > (uint64_t{1} << 50) / c10::elementSize(dtype)) {
      throw_error(absl::InvalidArgumentError(
          absl::StrCat("process group '", name_, "', shared_tensor: ", numel, " elements (at most 1 PiB)")));
    }
    const at::Tensor like = at::empty({0}, at::TensorOptions().dtype(dtype));
    check_tensor(like, "shared_tensor: the tensor");
    if (!shm_) return at::Tensor();
    auto out = std::make_shared<at::Tensor>();  // shared with the operation, which may outlive a failed wait
    wait(submit("shared_tensor", like, numel,
                [this, out, numel, dtype](uint32_t) { *out = shm_->shared_tensor(numel, dtype, deadline_); }));
    return *out;
  }

  rpc::Future barrier() override {
    return submit("barrier", at::Tensor(), 0, [this](uint32_t tag) {
      if (shm_) return shm_->barrier(deadline_);
      gloo::BarrierOptions o(ctx_);
      tagged(o, tag);
      gloo::barrier(o);
    });
  }

 private:
  void run_allreduce(const at::Tensor& t, ReduceOp op, uint32_t tag) {
    dispatch(t.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      gloo::AllreduceOptions o(ctx_);
      o.setOutput(t.data_ptr<T>(), static_cast<size_t>(t.numel()));
      o.setReduceFunction(reduce_fn<T>(op));
      tagged(o, tag);
      gloo::allreduce(o);
    });
    if (op == ReduceOp::kAvg) t.div_(size_);
  }

  // Point-to-point operations start at once (Gloo progresses them on its own thread) and each gets a thread that
  // waits for it within the timeout; the threads are joined as they finish and when the group goes.
  rpc::Future p2p(const char* what, const at::Tensor& t, int peer, uint32_t tag) {
    check_tensor(t, what, /*any_dtype=*/true);
    check_root(peer, what);
    if (peer == rank_) throw_error(absl::InvalidArgumentError(absl::StrCat(what, ": the peer is this rank")));
    const bool sending = what[0] == 's';
    const std::string prefix =
        absl::StrCat(where(what), (sending ? " to rank " : " from rank "), peer, " (tag ", tag, "): ");
    {
      // A callback of an operation ~GlooGroup cancels may call this: its transfer would outlive the connections.
      MutexLock lock(&mu_);
      if (stopping_) return rpc::Future::failed(absl::CancelledError(prefix + "the group is being destroyed"));
    }
    if (absl::Status b = broken(); !b.ok()) return rpc::Future::failed(failed_earlier(prefix, b));
    std::shared_ptr<gloo::transport::UnboundBuffer> buffer = ctx_->createUnboundBuffer(t.data_ptr(), t.nbytes());
    const uint64_t slot = gloo::Slot::build(kP2pSlotPrefix, tag);
    const Clock::time_point start = Clock::now();
    try {
      sending ? buffer->send(peer, slot) : buffer->recv(peer, slot);
    } catch (...) {
      mark_broken(failure(prefix, start));
      return rpc::Future::failed(broken());
    }
    // Done within the timeout, or failed (after naming the members gone, within kPingTimeout).
    // A wait on it that runs out names the operation (prefix without its ": ").
    rpc::Future done(absl::Now() + absl::FromChrono(options_.timeout + kPingTimeout),
                     prefix.substr(0, prefix.size() - 2));
    auto wait = [this, buffer, t, done, sending, prefix, start] {
      try {
        const bool ok = sending ? buffer->waitSend(options_.timeout) : buffer->waitRecv(options_.timeout);
        ok ? done.set_value(c10::IValue()) : done.set_error(absl::AbortedError(prefix + "aborted"));
      } catch (...) {
        absl::Status error = failure(prefix, start);
        mark_broken(error);
        done.set_error(error);
      }
    };
    if (!waiters_.try_start(wait)) {
      // No thread to wait for it (the system refused one; waiters_ has no cap): the operation is under way in Gloo
      // and its buffer must live until it ends, so this thread waits for it, within the same timeout.
      TANDEM_LOG(kWarn, "comm") << prefix << "no thread to wait for it; waiting on the caller's thread";
      wait();
    }
    return done;
  }

  absl::Status broken() {
    MutexLock lock(&mu_);
    return broken_;
  }
  // The first failure breaks the group for good. One on another path than the segment's (Gloo, a send or recv):
  // over shared memory the others learn at once (their next barrier fails naming this rank) instead of waiting for it
  // until their deadline. Not for a failure of an operation on the segment: the others see that one themselves
  // (shm.h), and marking it would fail a barrier they all passed.
  void mark_broken(const absl::Status& error, bool on_segment = false) {
    MutexLock lock(&mu_);
    if (!broken_.ok()) return;
    broken_ = error;
    // Not while the group is destroyed here: its kGoneBit already tells the others (shm.h, destroyed()), and marking
    // the segment would fail them in a barrier this rank reached (a Gloo operation or p2p transfer failing as the
    // connections close).
    if (shm_ && !on_segment && !stopping_) shm_->abandon();
  }
  // "process group 'g' (rank 1 of 2), allreduce": how every error of an operation begins.
  std::string where(const std::string& what) const {
    return absl::StrCat("process group '", name_, "' (rank ", rank_, " of ", size_, "), ", what);
  }
  static absl::Status failed_earlier(const std::string& prefix, const absl::Status& cause) {
    return absl::FailedPreconditionError(prefix + "the group failed earlier (" + std::string(cause.message()) +
                                         "); create a new one");
  }

  // The error of the operation started at `start` whose exception is being handled (call inside catch (...) only).
  // Gloo's (and LibTorch's) exceptions are classified by facts (gloo_failure); a tandem::Error or an out-of-memory
  // keeps its code.
  absl::Status failure(const std::string& prefix, Clock::time_point start) const {
    const absl::Status thrown = status_from_current_exception();
    if (thrown.code() != absl::StatusCode::kUnknown) {
      return absl::Status(thrown.code(), prefix + std::string(thrown.message()));
    }
    return gloo_failure(prefix, std::string(thrown.message()), Clock::now() - start, options_.timeout, job_ranks_,
                        rank_, name_);
  }

  static void check_op(const at::Tensor& t, ReduceOp op, const char* what) {
    if (op == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type())) {
      throw_error(absl::InvalidArgumentError(absl::StrCat(what, ": kAvg needs a floating-point tensor")));
    }
  }

  static constexpr uint8_t kP2pSlotPrefix = 0x40;  // beside Gloo's collective prefixes (0x01..0x08)

  // Every operation: its own tag (operations may overlap on the wire) and the group's timeout.
  template <typename Options>
  void tagged(Options& o, uint32_t tag) const {
    o.setTag(tag);
    o.setTimeout(options_.timeout);
  }

  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size_) {
      throw_error(absl::InvalidArgumentError(absl::StrCat(what, ": no rank ", root, " in the group")));
    }
  }
  // `whole` holds size() chunks the size and dtype of `chunk`.
  void check_chunks(const at::Tensor& whole, const at::Tensor& chunk, const char* what) const {
    check_tensor(whole, what);
    if (whole.scalar_type() != chunk.scalar_type() || whole.numel() != chunk.numel() * size_) {
      throw_error(absl::InvalidArgumentError(
          absl::StrCat(what, ": the whole tensor must hold size() chunks of the same dtype")));
    }
  }

  struct Op {
    std::string what;
    std::vector<int64_t> fingerprint;  // what debug mode compares across ranks (kFingerprint values)
    std::function<void(uint32_t tag)> run;
    rpc::Future done;
    int64_t bytes = 0;  // of the tensor that characterises it (for the log)
    int64_t seq = 0;    // its number among this rank's operations of the group, from 1 (named when cancelled)
  };

  // An operation's fingerprint: its name, its parameter (root, reduce op), and the dtype and shape of the tensor that
  // characterises it (the same on every rank): its first 4 sizes as they are, and a hash of all of them (shapes that
  // differ past the fourth dimension differ there).
  static constexpr size_t kFingerprint = 9;
  static constexpr const char* kOps[] = {"allreduce", "broadcast",  "allgather", "reduce",         "gather",
                                         "scatter",   "all_to_all", "barrier",   "reduce_scatter", "shared_tensor"};
  static std::vector<int64_t> fingerprint(const std::string& what, const at::Tensor& t, int64_t param) {
    std::vector<int64_t> f(kFingerprint, -1);
    for (size_t i = 0; i < std::size(kOps); ++i) {
      if (what == kOps[i]) f[0] = static_cast<int64_t>(i);
    }
    f[1] = param;
    if (t.defined()) {
      f[2] = static_cast<int64_t>(t.scalar_type());
      f[3] = t.dim();
      for (int64_t d = 0; d < std::min<int64_t>(t.dim(), 4); ++d) f[4 + d] = t.size(d);
      uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
      for (int64_t d = 0; d < t.dim(); ++d) h = (h ^ static_cast<uint64_t>(t.size(d))) * 1099511628211ull;
      f[8] = static_cast<int64_t>(h);
    }
    return f;
  }
  static std::string describe(const int64_t* f) {
    std::string s = f[0] >= 0 && f[0] < static_cast<int64_t>(std::size(kOps)) ? kOps[f[0]] : "?";
    if (f[2] < 0) return s + "()";
    s += absl::StrCat("(", c10::toString(static_cast<c10::ScalarType>(f[2])), "[");
    for (int64_t d = 0; d < std::min<int64_t>(f[3], 4); ++d) s += absl::StrCat(d ? ", " : "", f[4 + d]);
    return s + absl::StrCat(f[3] > 4 ? absl::StrCat(", ... (", f[3], " dimensions, sizes hashed ", f[8], ")") : "",
                            "], parameter ", f[1], ")");
  }

  // Debug mode: all ranks exchange the fingerprint of the operation they are about to run; the first rank whose
  // fingerprint differs from rank 0's is reported, on every rank (FAILED_PRECONDITION). Gloo's own failures throw.
  absl::Status check_same(const Op& op, uint32_t tag) {
    std::vector<int64_t> all(kFingerprint * size_);
    gloo::AllgatherOptions o(ctx_);
    o.setInput(const_cast<int64_t*>(op.fingerprint.data()), kFingerprint);
    o.setOutput(all.data(), all.size());
    tagged(o, tag);
    gloo::allgather(o);
    for (int r = 1; r < size_; ++r) {
      if (!std::equal(all.begin(), all.begin() + kFingerprint, all.begin() + r * kFingerprint)) {
        return absl::FailedPreconditionError(absl::StrCat("collective mismatch: rank ", r, " called ",
                                                          describe(&all[r * kFingerprint]), " where rank 0 called ",
                                                          describe(all.data())));
      }
    }
    return absl::OkStatus();
  }

  rpc::Future submit(std::string what, const at::Tensor& characteristic, int64_t param,
                     std::function<void(uint32_t)> run) {
    MutexLock lock(&mu_);
    if (stopping_) {  // a callback of a cancelled operation, run by ~GlooGroup: nothing would run it
      return rpc::Future::failed(absl::CancelledError(where(what) + ": the group is being destroyed"));
    }
    // Its deadline: the operations ahead of it and itself each complete or fail within the group's timeout (twice in
    // debug mode: the fingerprint exchange has its own), and a failure names the members gone within kPingTimeout.
    const int64_t ahead_and_this = ++pending_;
    const milliseconds per_op = options_.debug ? 2 * options_.timeout : options_.timeout;
    const int64_t bytes = characteristic.defined() ? static_cast<int64_t>(characteristic.nbytes()) : 0;
    // Named for the error of a wait that outlasts it (Gloo bounds each of its waits, not the whole operation).
    rpc::Future done(
        absl::Now() + absl::FromChrono(ahead_and_this * per_op + kPingTimeout),
        absl::StrCat(where(what), " of ", bytes, " bytes (", ahead_and_this - 1, " operations ahead of it)"));
    queue_.push_back(Op{what, fingerprint(what, characteristic, param), std::move(run), done, bytes, ++submitted_});
    return done;
  }

  void loop() {
    uint32_t tag = 0;
    for (;;) {
      Op op;
      {
        MutexLock lock(&mu_);
        mu_.Await(Condition(this, &GlooGroup::work_or_stop));  // idle until an operation comes or ~GlooGroup
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      run_op(op, tag);
      MutexLock lock(&mu_);
      --pending_;
    }
  }
  bool work_or_stop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); }

  // The path `what` takes: the common collectives over shared memory when the group has it, the rest over Gloo.
  const char* transport_of(const std::string& what) const {
    const bool common = what == "allreduce" || what == "reduce_scatter" || what == "broadcast" || what == "allgather" ||
                        what == "barrier" || what == "shared_tensor";
    return shm_ && common ? "shared_memory" : "gloo";
  }

  // Runs one operation on the group's thread and completes its future.
  void run_op(Op& op, uint32_t& tag) {
    const std::string prefix = where(op.what) + ": ";
    const Clock::time_point start = Clock::now();
    metrics::Recorder& recorder = metrics::collective_recorder(name_, op.what, transport_of(op.what));
    if (absl::Status b = broken(); !b.ok()) {
      op.run = nullptr;
      recorder.record(Clock::now() - start, false, op.bytes, 0);
      op.done.set_error(failed_earlier(prefix, b));
      return;
    }
    try {
      if (options_.debug) {
        if (absl::Status same = check_same(op, ++tag); !same.ok()) {
          op.run = nullptr;
          mark_broken(absl::Status(same.code(), prefix + std::string(same.message())));
          recorder.record(Clock::now() - start, false, op.bytes, 0);
          op.done.set_error(broken());
          return;
        }
      }
      deadline_ = Clock::now() + options_.timeout;
      TANDEM_LOG(kDebug, "comm") << where(op.what) << " of " << op.bytes << " bytes over " << transport_of(op.what);
      op.run(++tag);
      // Gloo bounds each of its waits by the timeout, not a whole operation: one that ends after its future's deadline
      // may have been reported failed to its waiter meanwhile, while its tensors were still being written. It fails,
      // and the group with it, as any operation that outlived its bound (before, the group went on as if nothing
      // happened: the caller saw an error, the next operation ran on).
      if (const absl::Time due = op.done.deadline(), now = absl::Now(); now > due) {
        throw_error(absl::DeadlineExceededError(
            absl::StrCat("ended ", absl::FormatDuration(absl::Trunc(now - due, absl::Milliseconds(1))),
                         " after its deadline (each operation ahead of it and itself within the group's timeout of ",
                         options_.timeout.count(), " ms, plus ", kPingTimeout.count(),
                         " ms); a wait on it may have failed meanwhile, so the group stops here")));
      }
      // The operation's tensors go before its future completes: a waiter that takes memory next finds theirs free
      // (fsdp's pool would map a buffer afresh instead of reusing the one a reduction just released).
      op.run = nullptr;
      recorder.record(Clock::now() - start, true, op.bytes, 0);
      if (profile::active()) {
        profile::report_steady(
            absl::StrCat("comm:", op.what, "(group ", name_, ", ", op.bytes, " bytes, ", transport_of(op.what), ")"),
            start, Clock::now());
      }
      op.done.set_value(c10::IValue());
    } catch (...) {
      op.run = nullptr;
      mark_broken(failure(prefix, start), std::string(transport_of(op.what)) == "shared_memory");
      recorder.record(Clock::now() - start, false, op.bytes, 0);
      TANDEM_LOG(kWarn, "comm") << broken().message();
      op.done.set_error(broken());
    }
  }

  const std::string name_;
  const int rank_, size_;
  const ProcessGroupOptions options_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  const std::vector<int> job_ranks_;             // the group's ranks in the job, by group rank
  const std::unique_ptr<detail::ShmGroup> shm_;  // set when the common collectives run over shared memory
  const uint64_t job_;                           // g_job when it was created
  Clock::time_point deadline_;                   // of the operation running (group thread only)
  Mutex mu_;
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;    // operations submitted and not completed yet (queued or running)
  int64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;  // operations submitted so far (Op::seq)
  ReapedThreads waiters_;                       // threads waiting for p2p transfers
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // the first failure
  std::thread thread_;
};

// The shared-memory path of a new group (ProcessGroupOptions::shared_memory), or null for Gloo alone. Collective: every
// rank publishes its place, and when all are equal rank 0 creates a segment the others map; all agree (a Gloo
// allreduce) before anyone uses it, and rank 0 then removes its name. Throws tandem::Error when kAlways cannot be met.
std::unique_ptr<detail::ShmGroup> shared_memory(const std::shared_ptr<gloo::rendezvous::Context>& ctx,
                                                const std::string& name, int rank, const std::vector<int>& ranks,
                                                const ProcessGroupOptions& options) {
  SharedMemory mode = options.shared_memory;
  if (const char* e = std::getenv("TANDEM_SHARED_MEMORY"); e && mode == SharedMemory::kAuto) {
    if (std::string(e) == "0") mode = SharedMemory::kNever;
    if (std::string(e) == "1") mode = SharedMemory::kAlways;
  }
  const int size = static_cast<int>(ranks.size());
  if (mode == SharedMemory::kNever || size < 2) return nullptr;
  rpc::Store& store = rpc::job_store();
  const std::string prefix = absl::StrCat("comm/", name, "/shm/");
  throw_if_error(store.set(absl::StrCat(prefix, "place/", rank), detail::host_place()));
  std::string first_place, differs;
  for (int r = 0; r < size && differs.empty(); ++r) {
    auto place = store.get(absl::StrCat(prefix, "place/", r), options.timeout);
    throw_if_error(place.status());
    if (r == 0) first_place = *place;
    if (*place != first_place)
      differs = absl::StrCat("rank ", r, " is on another host or network namespace than rank 0");
  }
  if (!differs.empty()) {
    if (mode == SharedMemory::kAlways) {
      throw_error(absl::FailedPreconditionError("shared memory was required, but " + differs));
    }
    return nullptr;
  }
  std::vector<std::string> labels;
  for (int r = 0; r < size; ++r) {
    const auto info = rpc::find_worker_info(ranks[r]);
    labels.push_back(absl::StrCat("rank ", r, " (worker '", info ? info->name : "?", "')"));
  }
  auto shm = detail::ShmGroup::attach(store, prefix + "segment", rank, std::move(labels), options.timeout);
  // Every rank must have mapped the segment before rank 0 removes its name, and all must use it or none.
  int32_t ok = shm.ok() ? 1 : 0;
  gloo::AllreduceOptions o(ctx);
  o.setOutput(&ok, 1);
  o.setReduceFunction(reduce_fn<int32_t>(ReduceOp::kMin));
  o.setTag(0x7fffffff);
  o.setTimeout(options.timeout);
  gloo::allreduce(o);
  if (shm.ok()) (*shm)->unlink();
  if (ok == 1) return std::move(*shm);
  const std::string why = shm.ok() ? "another rank could not map the segment" : std::string(shm.status().message());
  if (mode == SharedMemory::kAlways) throw_error(absl::UnavailableError("shared memory was required, but " + why));
  // Said on every rank: the group's collectives run several times slower over Gloo (a small /dev/shm, say a
  // container's default 64 MB, is the usual cause), and nothing else would tell.
  TANDEM_LOG(kWarn, "comm") << "process group '" << name << "': every rank is on this host, but its collectives run "
                            << "over Gloo: " << why;
  return nullptr;
}

std::string host_of(const std::string& address) {
  const auto colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

std::shared_ptr<ProcessGroup> ProcessGroup::create(const std::string& name, std::vector<int> ranks,
                                                   ProcessGroupOptions options) {
  (void)g_installed;
  const rpc::WorkerInfo self = rpc::get_worker_info();
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  if (ranks.empty()) {
    for (int r = 0; r < world; ++r) ranks.push_back(r);
  }
  std::sort(ranks.begin(), ranks.end());
  if (std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() || ranks.front() < 0 || ranks.back() >= world) {
    throw RpcError(
        absl::InvalidArgumentError(absl::StrCat("process group '", name, "': ranks must be distinct job ranks")));
  }
  auto me = std::find(ranks.begin(), ranks.end(), self.id);
  if (me == ranks.end()) {
    throw RpcError(
        absl::InvalidArgumentError(absl::StrCat("process group '", name, "': worker '", self.name,
                                                "' is not one of its ranks (", absl::StrJoin(ranks, ", "), ")")));
  }
  if (options.backend != Backend::kGloo) {
    throw RpcError(absl::UnimplementedError(absl::StrCat("process group '", name,
                                                         "': this build has no NCCL backend "
                                                         "(CUDA tensors); use Backend::kGloo for CPU tensors")));
  }
  {
    MutexLock lock(&g_names_mu);
    if (!g_names.insert(name).second) {
      throw RpcError(absl::AlreadyExistsError(absl::StrCat("process group '", name, "' was already created here")));
    }
  }
  const int rank = static_cast<int>(me - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  if (options.timeout.count() <= 0) options.timeout = rpc::default_timeout();
  const std::string prefix = absl::StrCat("process group '", name, "' set-up on worker '", self.name, "': ");
  const Clock::time_point start = Clock::now();
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host_of(self.address);
    auto device = gloo::transport::tcp::CreateDevice(attr);
    // Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died would kill this process with SIGPIPE instead of
    // failing the operation. Ignore it unless the program installed a handler of its own.
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
    if (const char* d = std::getenv("TANDEM_DEBUG_COLLECTIVES"); d && std::string(d) == "1") options.debug = true;
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(options.timeout);
    StoreAdapter store(rpc::job_store(), absl::StrCat("comm/", name, "/"), options.timeout);
    ctx->connectFullMesh(store, device);
    std::unique_ptr<detail::ShmGroup> shm = shared_memory(ctx, name, rank, ranks, options);
    TANDEM_LOG(kDebug, "comm") << "process group '" << name << "' ready: ranks " << absl::StrJoin(ranks, ",")
                               << ", this one " << rank << ", collectives over " << (shm ? "shared memory" : "gloo")
                               << (options.debug ? " (debug mode)" : "");
    return std::make_shared<GlooGroup>(name, rank, size, std::move(ctx), options, ranks, std::move(shm));
  } catch (...) {
    // The store's errors (tandem::Error) keep their code; Gloo's connection failures are classified by facts.
    const absl::Status thrown = status_from_current_exception();
    if (thrown.code() != absl::StatusCode::kUnknown) {
      throw_error(absl::Status(thrown.code(), prefix + std::string(thrown.message())));
    }
    throw_error(
        gloo_failure(prefix, std::string(thrown.message()), Clock::now() - start, options.timeout, ranks, rank));
  }
}

void wait(const rpc::Future& work) { throw_if_error(work.status()); }

}  // namespace tandem::comm
