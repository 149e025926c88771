// ProcessGroup on Gloo: TCP connections between the members, set up through the job's rendezvous store.
#include "comm/process_group.h"

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>

#include <signal.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iterator>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "rpc/errors.h"
#include "rpc/extension.h"
#include "rpc/rpc.h"
#include "rpc/store.h"

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

template <typename T>
ReduceFn reduce_fn(ReduceOp op) {
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

// Calls f.template operator()<T>() with T the C++ type of `dtype`.
template <typename F>
void dispatch(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kDouble: return f(double{});
    case at::kChar: return f(int8_t{});
    case at::kByte: return f(uint8_t{});
    case at::kInt: return f(int32_t{});
    case at::kLong: return f(int64_t{});
    default:
      throw std::invalid_argument(absl::StrCat("collectives do not support dtype ", c10::toString(dtype)));
  }
}

void check_tensor(const at::Tensor& t, const char* what) {
  if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) {
    throw std::invalid_argument(absl::StrCat(what, " must be a defined, contiguous CPU tensor"));
  }
}

std::mutex g_names_mu;
std::set<std::string> g_names;  // group names used by this worker in this job: each names one group

const bool g_installed = [] {
  rpc::add_stop_hook([] {  // a new job (init_rpc again) starts with a new store: names are free again
    std::lock_guard<std::mutex> lock(g_names_mu);
    g_names.clear();
  });
  return true;
}();

class GlooGroup final : public ProcessGroup {
 public:
  GlooGroup(std::string name, int rank, int size, std::shared_ptr<gloo::rendezvous::Context> ctx,
            ProcessGroupOptions options)
      : name_(std::move(name)), rank_(rank), size_(size), options_(options), ctx_(std::move(ctx)) {
    thread_ = std::thread([this] { loop(); });
  }
  ~GlooGroup() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();  // an operation in progress ends within its timeout
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  rpc::Future allreduce(at::Tensor t, ReduceOp op) override {
    check_tensor(t, "allreduce: the tensor");
    if (op == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type())) {
      throw std::invalid_argument("allreduce: kAvg needs a floating-point tensor");
    }
    return submit("allreduce", t, static_cast<int>(op), [this, t, op](uint32_t tag) {
      dispatch(t.scalar_type(), [&](auto zero) {
        using T = decltype(zero);
        gloo::AllreduceOptions o(ctx_);
        o.setOutput(t.data_ptr<T>(), static_cast<size_t>(t.numel()));
        o.setReduceFunction(reduce_fn<T>(op));
        tagged(o, tag);
        gloo::allreduce(o);
      });
      if (op == ReduceOp::kAvg) t.div_(size_);
    });
  }

  rpc::Future broadcast(at::Tensor t, int root) override {
    check_tensor(t, "broadcast: the tensor");
    check_root(root, "broadcast");
    return submit("broadcast", t, root, [this, t, root](uint32_t tag) {
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
    if (op == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type())) {
      throw std::invalid_argument("reduce: kAvg needs a floating-point tensor");
    }
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
      throw std::invalid_argument("all_to_all: input and output must have the same dtype and size() equal chunks");
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

  rpc::Future barrier() override {
    return submit("barrier", at::Tensor(), 0, [this](uint32_t tag) {
      gloo::BarrierOptions o(ctx_);
      tagged(o, tag);
      gloo::barrier(o);
    });
  }

 private:
  // Every operation: its own tag (operations may overlap on the wire) and the group's timeout.
  template <typename Options>
  void tagged(Options& o, uint32_t tag) const {
    o.setTag(tag);
    o.setTimeout(options_.timeout);
  }

  void check_root(int root, const char* what) const {
    if (root < 0 || root >= size_) throw std::invalid_argument(absl::StrCat(what, ": no rank ", root, " in the group"));
  }
  // `whole` holds size() chunks the size and dtype of `chunk`.
  void check_chunks(const at::Tensor& whole, const at::Tensor& chunk, const char* what) const {
    check_tensor(whole, what);
    if (whole.scalar_type() != chunk.scalar_type() || whole.numel() != chunk.numel() * size_) {
      throw std::invalid_argument(absl::StrCat(what, ": the whole tensor must hold size() chunks of the same dtype"));
    }
  }

  struct Op {
    std::string what;
    std::vector<int64_t> fingerprint;  // what debug mode compares across ranks (kFingerprint values)
    std::function<void(uint32_t tag)> run;
    rpc::Future done;
  };

  // An operation's fingerprint: its name, its parameter (root, reduce op), and the dtype and shape of the tensor that
  // characterises it (the same on every rank).
  static constexpr size_t kFingerprint = 8;
  static constexpr const char* kOps[] = {"allreduce", "broadcast", "allgather", "reduce",
                                         "gather",    "scatter",   "all_to_all", "barrier"};
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
    }
    return f;
  }
  static std::string describe(const int64_t* f) {
    std::string s = f[0] >= 0 && f[0] < static_cast<int64_t>(std::size(kOps)) ? kOps[f[0]] : "?";
    if (f[2] < 0) return s + "()";
    s += absl::StrCat("(", c10::toString(static_cast<c10::ScalarType>(f[2])), "[");
    for (int64_t d = 0; d < std::min<int64_t>(f[3], 4); ++d) s += absl::StrCat(d ? ", " : "", f[4 + d]);
    return s + absl::StrCat(f[3] > 4 ? ", ..." : "", "], parameter ", f[1], ")");
  }

  // Debug mode: all ranks exchange the fingerprint of the operation they are about to run; the first rank whose
  // fingerprint differs from rank 0's is reported, on every rank.
  void check_same(const Op& op, uint32_t tag) {
    std::vector<int64_t> all(kFingerprint * size_);
    gloo::AllgatherOptions o(ctx_);
    o.setInput(const_cast<int64_t*>(op.fingerprint.data()), kFingerprint);
    o.setOutput(all.data(), all.size());
    tagged(o, tag);
    gloo::allgather(o);
    for (int r = 1; r < size_; ++r) {
      if (!std::equal(all.begin(), all.begin() + kFingerprint, all.begin() + r * kFingerprint)) {
        throw MismatchError(absl::StrCat("collective mismatch: rank ", r, " called ", describe(&all[r * kFingerprint]),
                                         " where rank 0 called ", describe(all.data())));
      }
    }
  }
  struct MismatchError : std::runtime_error {
    using std::runtime_error::runtime_error;
  };

  rpc::Future submit(std::string what, const at::Tensor& characteristic, int64_t param,
                     std::function<void(uint32_t)> run) {
    rpc::Future done;
    Op op{what, fingerprint(what, characteristic, param), std::move(run), done};
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
    return done;
  }

  void loop() {
    uint32_t tag = 0;
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      const std::string prefix = absl::StrCat("process group '", name_, "' (rank ", rank_, " of ", size_, "), ", op.what,
                                              ": ");
      if (!broken_.ok()) {
        op.done.set_error(absl::FailedPreconditionError(prefix + "the group failed earlier (" +
                                                        std::string(broken_.message()) + "); create a new one"));
        continue;
      }
      try {
        if (options_.debug) check_same(op, ++tag);
        op.run(++tag);
        op.done.set_value(c10::IValue());
      } catch (const MismatchError& e) {
        broken_ = absl::FailedPreconditionError(prefix + e.what());
        op.done.set_error(broken_);
      } catch (const std::exception& e) {
        std::string cause = e.what();
        const bool timed_out = cause.find("imed out") != std::string::npos || cause.find("imeout") != std::string::npos;
        broken_ = timed_out ? absl::DeadlineExceededError(prefix + "a rank did not take part within " +
                                                          std::to_string(options_.timeout.count()) + " ms: " + cause)
                            : absl::UnavailableError(prefix + cause);
        op.done.set_error(broken_);
      }
    }
  }

  const std::string name_;
  const int rank_, size_;
  const ProcessGroupOptions options_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stopping_ = false;
  absl::Status broken_;  // the group's thread only
  std::thread thread_;
};

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
    throw RpcError(absl::InvalidArgumentError(absl::StrCat("process group '", name, "': ranks must be distinct job ranks")));
  }
  auto me = std::find(ranks.begin(), ranks.end(), self.id);
  if (me == ranks.end()) {
    throw RpcError(absl::InvalidArgumentError(absl::StrCat("process group '", name, "': worker '", self.name,
                                                           "' is not one of its ranks (", absl::StrJoin(ranks, ", "), ")")));
  }
  {
    std::lock_guard<std::mutex> lock(g_names_mu);
    if (!g_names.insert(name).second) {
      throw RpcError(absl::AlreadyExistsError(absl::StrCat("process group '", name, "' was already created here")));
    }
  }
  const int rank = static_cast<int>(me - ranks.begin());
  const int size = static_cast<int>(ranks.size());
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
    return std::make_shared<GlooGroup>(name, rank, size, std::move(ctx), options);
  } catch (const RpcError& e) {
    throw RpcError(absl::Status(e.status().code(),
                                absl::StrCat("process group '", name, "' set-up on worker '", self.name, "': ",
                                             e.status().message())));
  } catch (const std::exception& e) {
    throw RpcError(absl::UnavailableError(
        absl::StrCat("process group '", name, "' set-up on worker '", self.name, "': ", e.what())));
  }
}

void wait(const rpc::Future& work) { throw_if_error(work.status()); }

}  // namespace tandem::comm
