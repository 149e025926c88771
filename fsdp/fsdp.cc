// Fully sharded data parallelism: see fsdp.h.
#include "tandem/fsdp/fsdp.h"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <optional>
#include <set>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/log/log.h"
#include "tandem/rpc/errors.h"

namespace tandem::fsdp {
namespace {

// The buffers a step takes and releases (gathered parameters, the gradients being reduced) are mappings of their own,
// not malloc's: through malloc released memory would stay taken (glibc raises its mmap threshold after the first free
// of a large block and serves the next ones from a heap it does not shrink: the 6-layer memory test measured 481 MiB
// instead of 209), and fixing the threshold (mallopt) made every large temporary of the process fault in fresh pages.
// A released mapping is kept for a later buffer it can hold (the smallest kept one that does): fresh pages cost about
// 0.55 ms per MiB here (faulting and zeroing; 9 ms for a 16 MiB unit), which was most of what a fully sharded step
// paid beyond DDP's. The pool keeps released mappings only while what it keeps plus what is in use stays within the
// most that was ever mapped in use at once (the high-water mark), the largest ones first, and a fully sharded step that
// takes the same buffers as the one before finds them all kept (the test checks it). A request no kept mapping holds is
// mapped afresh beside them (then, for a while, more is mapped than the mark), and one served by a larger kept mapping
// counts that mapping's size in use (the mark can creep up by what such a fit wastes). Kept buffers stay resident
// between backwards, so the optimizer's step, whose temporaries come from malloc, runs beside them: the process's peak
// can be the step's (the model state, the kept buffers, the step's temporaries). (A fixed bound of twice the largest
// unit was 4 KiB short of a backward's peak: a gathered unit, the next one prefetched and the last one's gradients; the
// largest buffer was unmapped and mapped afresh every step.) A model's destruction unmaps what the pool kept. PyTorch's
// caching allocator keeps FSDP's blocks on GPUs the same way. Thread-safe: buffers are released on autograd's threads
// too.
class BufferPool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (bytes == 0) return c10::DataPtr(nullptr, cpu);
    void* at = nullptr;
    size_t mapped = bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The smallest kept mapping that holds it (a unit's gathered parameters and another's gradients differ in
      // size: taking only mappings of the very size would leave the pool, bounded by the peak, mapping some afresh).
      if (auto it = kept_.lower_bound(bytes); it != kept_.end()) {
        mapped = it->first;
        at = it->second;
        kept_.erase(it);
        kept_bytes_ -= mapped;
      }
      if (at) {
        in_use_bytes_ += mapped;
        most_in_use_bytes_ = std::max(most_in_use_bytes_, in_use_bytes_);
      }
    }
    if (!at) {
      auto fresh = [bytes] {
        return ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      };
      at = fresh();
      if (at == MAP_FAILED) {
        trim();  // what is kept goes before the allocation fails
        at = fresh();
        if (at == MAP_FAILED) throw std::bad_alloc();
      }
      std::lock_guard<std::mutex> lock(mu_);
      in_use_bytes_ += bytes;
      most_in_use_bytes_ = std::max(most_in_use_bytes_, in_use_bytes_);
      ++mappings_;
    }
    return c10::DataPtr(at, new Mapping{at, mapped}, &BufferPool::release, cpu);
  }
  int64_t mappings() const {
    std::lock_guard<std::mutex> lock(mu_);
    return mappings_;
  }
  int64_t most_in_use() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(most_in_use_bytes_);
  }
  // Unmaps what is kept.
  void trim() const {
    std::multimap<size_t, void*> kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept.swap(kept_);
      kept_bytes_ = 0;
    }
    for (const auto& [bytes, at] : kept) ::munmap(at, bytes);
  }

 private:
  struct Mapping {
    void* at;
    size_t bytes;
  };
  static void release(void* context);
  mutable std::mutex mu_;
  mutable std::multimap<size_t, void*> kept_;  // by size
  mutable size_t kept_bytes_ = 0;
  mutable size_t in_use_bytes_ = 0;
  mutable size_t most_in_use_bytes_ = 0;
  mutable int64_t mappings_ = 0;
};
// Never destroyed: a buffer may be released after static destruction began (a tensor a static object holds).
BufferPool& pool() {
  static BufferPool* the = new BufferPool;
  return *the;
}

void BufferPool::release(void* context) {
  std::unique_ptr<Mapping> m(static_cast<Mapping*>(context));
  BufferPool& p = pool();
  std::vector<std::pair<size_t, void*>> unmap;
  {
    std::lock_guard<std::mutex> lock(p.mu_);
    p.in_use_bytes_ -= m->bytes;
    // The largest mappings are the ones kept within the mark (a larger one serves any smaller request; keeping a
    // smaller one instead would map the largest unit afresh every step when the mark holds one buffer).
    p.kept_.emplace(m->bytes, m->at);
    p.kept_bytes_ += m->bytes;
    while (p.kept_bytes_ + p.in_use_bytes_ > p.most_in_use_bytes_) {
      auto smallest = p.kept_.begin();
      unmap.emplace_back(smallest->first, smallest->second);
      p.kept_bytes_ -= smallest->first;
      p.kept_.erase(smallest);
    }
  }
  for (const auto& [bytes, at] : unmap) ::munmap(at, bytes);
}

// A flat tensor of `numel` elements in the pool's memory (not initialised).
at::Tensor pooled_empty(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(bytes), &pool(), /*resizable=*/true);
  return at::empty({0}, options.requires_grad(false)).set_(storage, 0, {numel}, {1});
}

// The memory of a unit's gathered buffer, released and taken again while the parameters' views (and the tensors
// autograd saved from them) keep pointing at its storage, as PyTorch's FSDP does with storage().resize_().
void release(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() != 0) at::native::resize_bytes_cpu(s, 0);
}
void take(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t want = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() != want) at::native::resize_bytes_cpu(s, want);
}

// Engine::queue_callback, called from a function of its own that .ci/tsan.supp names: LibTorch's ends in a tail call
// to pthread_mutex_unlock, whose return address is then its caller's, and ThreadSanitizer, which ignores the lock
// (taken inside uninstrumented LibTorch), would report the unlock. Not a tail call itself (the empty asm after it), so
// that this function is the one on the report's stack.
__attribute__((noinline)) void fsdp_queue_engine_callback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
  asm volatile("" ::: "memory");
}

enum class Held { kReleased, kGathering, kGathered };

struct UnitState {
  std::string label;  // for errors: the Sequential's child ("3"), the Unit's path ("encoder"), or "the root"
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<int64_t> offset;
  int64_t total = 0, shard_size = 0;
  at::Tensor full;   // {W S}: the parameters are views of it; its memory is released between uses
  at::Tensor shard;  // {S}: this rank's, a leaf for the optimizer
  Held held = Held::kReleased;
  bool memory = false;  // full's storage is taken
  // A collective into `full` failed or ran out of time and may still write into it (a Gloo operation can outlive its
  // deadline): its memory is never released by resizing (that frees it under the writer); the storage's deleter
  // returns it once the operation and the tensors let go of it. The group is broken then: nothing gathers again.
  bool written_late = false;
  rpc::Future gather;
  // A Linear unit's backward wrote its gradients into `full`, over the parameters it no longer needed (see
  // LinearIntoBuffer): its reduction starts from there, and the memory goes once it is done.
  bool grads_in_full = false;
  bool release_after_reduce = false;
  // This backward's reduce-scatter.
  bool reduced = false;
  at::Tensor reduce_in, reduce_out;
  rpc::Future reduce;

  // Parameter i's elements in a flat tensor of the unit's layout (its buffer, a gathered copy, a gradient buffer).
  at::Tensor flat_part(const at::Tensor& flat, size_t i) const { return flat.narrow(0, offset[i], params[i].numel()); }
  // The same, shaped as the parameter.
  at::Tensor part(const at::Tensor& flat, size_t i) const { return flat_part(flat, i).view(params[i].sizes()); }
  // The elements of parameter i that rank r's shard holds: `n` of them, from element `from` of the flattened
  // parameter, at element `at` of the shard (none, n = 0, for a parameter outside the rank's range).
  struct Overlap {
    int64_t from = 0, at = 0, n = 0;
  };
  Overlap overlap(size_t i, int64_t rank) const {
    const int64_t lo = rank * shard_size, hi = lo + shard_size;
    const int64_t begin = std::clamp(offset[i], lo, hi), end = std::clamp(offset[i] + params[i].numel(), lo, hi);
    if (end <= begin) return {};
    return {begin - offset[i], begin - lo, end - begin};
  }
};

}  // namespace

struct detail::ModelState {
  std::shared_ptr<torch::nn::Module> root;  // the model
  // Either a Sequential whose children with parameters are the units, run child by child here (unit_of_child: each
  // child's unit, -1 for none), or a model run by its own forward (`run`, null when it takes no single tensor), its
  // fsdp::Units calling pre_forward and post_forward, its other parameters in root_unit (-1: none).
  torch::nn::Sequential seq{nullptr};
  std::vector<int> unit_of_child;
  Forward run;
  int root_unit = -1;
  std::shared_ptr<comm::ProcessGroup> group;
  FsdpOptions options;
  std::vector<UnitState> units;
  std::vector<std::pair<int, int>> param_order;  // every parameter as (unit, index in it), in the model's order
  std::weak_ptr<ModelState> self;
  // The order of the forward running or last run: the units by the start of their forward and by its end, and each
  // unit's positions in them (-1: it did not run); subtree_end, the position in `started` past the units that ran
  // inside it (nested in it).
  struct Order {
    std::vector<int> started, ended, start_pos, end_pos, subtree_end;
    void reset(size_t n) {
      started.clear(), ended.clear();
      start_pos.assign(n, -1), end_pos.assign(n, -1), subtree_end.assign(n, -1);
    }
  };
  Order order;
  // A forward without gradients while a backward is pending (an evaluation between a forward and its backward) keeps
  // the order that backward goes by here, and puts it back after.
  std::optional<Order> stashed;
  // Prefetching a unit ahead follows the order of the forward before (at first, the units' order), and the unit that
  // ended last in it (at first, the root's or the last unit) stays gathered for the backward it begins.
  std::vector<int> prev_started;
  bool forward_active = false;
  int last_guess = -1;
  bool sync = true;
  bool in_backward = false;  // the final callback is queued
  int64_t gathered_elements = 0;
  int64_t peak_gathered = 0;
  int64_t gradients_into_buffers = 0;  // LinearIntoBuffer's backwards
  int64_t forwards_with_grad = 0;      // since the last backward ended
  std::mutex mu;                       // the hooks run on autograd's thread

  int world() const { return group->size(); }
  int64_t id = 0;  // in the registry LinearIntoBuffer finds the state by

  // Whether this forward computes unit u (child `module`) with LinearIntoBuffer: a Linear alone in its unit, fully
  // sharded, its gradients synchronised and reduced in the dtype it computes in, under autograd.
  bool into_buffer(const UnitState& u, const torch::nn::Module& module) const {
    if (!at::GradMode::is_enabled() || !sync || zero2() || compute_dtype(u) != reduce_dtype(u)) return false;
    // A LinearImpl itself: a subclass may compute something else.
    if (typeid(module) != typeid(torch::nn::LinearImpl)) return false;
    const auto* linear = module.as<torch::nn::Linear>();
    if (!linear || u.params.size() != (linear->bias.defined() ? 2u : 1u)) return false;
    for (const at::Tensor& p : u.params) {
      if (!p.requires_grad()) return false;
    }
    return u.params[0].unsafeGetTensorImpl() == linear->weight.unsafeGetTensorImpl() &&
           (!linear->bias.defined() || u.params[1].unsafeGetTensorImpl() == linear->bias.unsafeGetTensorImpl());
  }

  // Whether the reduction's result is added to a gradient (then it is a buffer of a step) or becomes it.
  static bool shard_grad_defined(const UnitState& u) { return u.shard.grad().defined(); }

  bool zero2() const { return options.sharding == Sharding::kGradientsAndOptimizer; }

  // This rank's piece of every parameter (sharded_state_dict's layout), its values views of the shards.
  std::vector<FullyShardedDataParallel::Piece> pieces() const {
    std::vector<FullyShardedDataParallel::Piece> out;
    const int64_t rank = group->rank();
    for (const auto& [k, i] : param_order) {
      const UnitState& u = units[k];
      const UnitState::Overlap o = u.overlap(i, rank);  // outside this rank's range: an empty piece at offset 0
      out.push_back({u.names[i], u.params[i].sizes().vec(), o.from, u.shard.detach().narrow(0, o.at, o.n)});
    }
    return out;
  }

  // Mixed precision: the dtype a unit is gathered (computed) in, and the one its gradients are reduced in.
  at::ScalarType compute_dtype(const UnitState& u) const {
    return options.mixed_precision.param_dtype.value_or(u.shard.scalar_type());
  }
  at::ScalarType reduce_dtype(const UnitState& u) const {
    return options.mixed_precision.reduce_dtype.value_or(compute_dtype(u));
  }

  void start_gather(UnitState& u) {
    if (u.held != Held::kReleased) return;
    if (!u.memory) {
      take(u.full);
      u.memory = true;
      gathered_elements += u.full.numel();
      peak_gathered = std::max(peak_gathered, gathered_elements);
    }
    // In the compute dtype: under mixed precision a cast copy of the shard, which the collective holds until done.
    u.gather = group->allgather(u.full, u.shard.detach().to(compute_dtype(u)));
    u.held = Held::kGathering;
  }
  void gathered(UnitState& u) {
    start_gather(u);
    if (u.held == Held::kGathering) {
      comm::wait(u.gather);
      u.held = Held::kGathered;
    }
  }
  // The unit's gathered parameters are no longer current (stale: the optimizer may step the shards); their memory is
  // released too, except under ZeRO-2, where it stays to be gathered into again.
  void reshard(UnitState& u) {
    if (u.held == Held::kReleased) return;
    if (u.held == Held::kGathering) comm::wait(u.gather);  // the group still writes into it
    u.held = Held::kReleased;
    if (zero2()) return;
    drop_memory(u);
  }
  // Waits for a collective nobody else waits for now (a prefetch the model will not use, a reduction of a failed
  // backward), within the group's deadline; its failure is logged, and the unit's buffer is then kept from release
  // (UnitState::written_late) when the collective wrote into it.
  static void settle(const rpc::Future& pending, UnitState* into = nullptr) {
    if (absl::Status st = pending.status(); !st.ok()) {
      TANDEM_LOG(kWarn, "fsdp") << "a collective left behind failed: " << st.message();
      if (into) into->written_late = true;
    }
  }
  void drop_memory(UnitState& u) {
    if (!u.memory || u.written_late) return;
    release(u.full);
    u.memory = false;
    gathered_elements -= u.full.numel();
  }

  // Unit k's backward is over (the unit before it began its own, or backward ended): its gradients are averaged into
  // the shards (or, under no_sync, kept in .grad), and its buffer is released.
  void reduce(UnitState& u) {
    if (u.reduced) return;
    u.reduced = true;
    if (u.grads_in_full) return reduce_from_full(u);
    if (!zero2()) reshard(u);  // ZeRO-2: the parameters stay current until the optimizer steps
    if (!sync) return;
    at::NoGradGuard no_grad;
    // Autograd's gradients are tensors of their own (one they computed is taken, not copied, by the accumulator);
    // each is copied into the buffer and dropped at once. Unused here: zeros.
    const auto reduce_options = u.shard.options().dtype(reduce_dtype(u)).requires_grad(false);
    u.reduce_in = pooled_empty(world() * u.shard_size, reduce_options);
    for (size_t i = 0; i < u.params.size(); ++i) {
      at::Tensor& g = u.params[i].mutable_grad();
      if (!g.defined()) {
        u.flat_part(u.reduce_in, i).zero_();
        continue;
      }
      u.flat_part(u.reduce_in, i).copy_(g.reshape({-1}));
      g.reset();
    }
    start_reduce(u);
  }

  // u.reduce_in holds the unit's gradients in its layout: its padding is zeroed and its reduce-scatter starts.
  void start_reduce(UnitState& u) {
    u.reduce_in.narrow(0, u.total, u.reduce_in.numel() - u.total).zero_();  // the padding
    // Added to the shard's gradient: reduced in place, into this rank's own chunk of the buffer. Becoming it: a tensor
    // of its own, which the gradient keeps.
    u.reduce_out = shard_grad_defined(u) ? u.reduce_in.narrow(0, group->rank() * u.shard_size, u.shard_size)
                                         : at::empty({u.shard_size}, u.reduce_in.options());
    u.reduce = group->reduce_scatter(u.reduce_out, u.reduce_in, comm::ReduceOp::kAvg);
  }

  // LinearIntoBuffer's backward: the weight's gradient (go^T x) and the bias's (go summed over rows) into unit k's
  // buffer, over its parameters (whose last use, the input's gradient, is done).
  // Returns false, writing nothing, unless this is the unit's one backward since its parameters were gathered (not
  // when the model ran more than one forward before this backward: the graphs share the unit's buffer).
  bool write_gradients(int64_t k, const at::Tensor& go, const at::Tensor& x, bool weight_grad, bool bias_grad) {
    std::lock_guard<std::mutex> lock(mu);
    UnitState& u = units[static_cast<size_t>(k)];
    if (forward_active || forwards_with_grad > 1 || !u.memory || u.held != Held::kGathered || u.grads_in_full ||
        u.reduced) {
      return false;
    }
    at::NoGradGuard no_grad;
    at::Tensor w = u.part(u.full, 0);
    if (weight_grad) {
      at::mm_out(w, go.t(), x);
    } else {
      w.zero_();  // as a parameter without a gradient is reduced
    }
    if (u.params.size() > 1) {
      at::Tensor b = u.part(u.full, 1);
      if (bias_grad) {
        at::sum_out(b, go, {0});
      } else {
        b.zero_();
      }
    }
    u.grads_in_full = true;
    ++gradients_into_buffers;
    return true;
  }

  // The same for a unit whose gradients its backward wrote into `full` (only when synchronising, fully sharded, and
  // reduced in the dtype it computes in): what earlier micro-batches left in .grad is added, the padding zeroed, and
  // the buffer is reduce-scattered in place; its parameters are not current any more.
  void reduce_from_full(UnitState& u) {
    u.grads_in_full = false;
    u.held = Held::kReleased;
    at::NoGradGuard no_grad;
    if (!sync) {  // synchronisation was turned off after the forward: the gradients go to .grad, as otherwise
      for (size_t i = 0; i < u.params.size(); ++i) {
        at::Tensor& g = u.params[i].mutable_grad();
        at::Tensor mine = u.part(u.full, i);
        g = g.defined() ? g.add(mine) : mine.clone();
      }
      drop_memory(u);
      return;
    }
    u.release_after_reduce = true;
    for (size_t i = 0; i < u.params.size(); ++i) {
      at::Tensor& g = u.params[i].mutable_grad();
      if (!g.defined()) continue;
      u.flat_part(u.full, i).add_(g.reshape({-1}));
      g.reset();
    }
    u.reduce_in = u.full;
    start_reduce(u);
  }

  // A reduction's average lands in its shard's .grad (added to what is there), and its buffers go.
  void finish(UnitState& u) {
    if (!u.reduce_out.defined()) return;  // no reduction started
    comm::wait(u.reduce);
    at::NoGradGuard no_grad;
    at::Tensor& g = u.shard.mutable_grad();
    if (g.defined()) {
      g.add_(u.reduce_out);
    } else {
      g = u.reduce_out.to(u.shard.scalar_type());  // mixed precision: into the shard's dtype
    }
    u.reduce_in = at::Tensor(), u.reduce_out = at::Tensor();
    if (u.release_after_reduce) u.release_after_reduce = false, drop_memory(u);
  }

  // A forward begins: what an earlier one left gathered may be stale (the optimizer stepped the shards since). A
  // backward that failed (a collective's error came out of it) left its reductions behind: they are dropped.
  void begin_forward() {
    in_backward = false;
    if (!at::GradMode::is_enabled() && forwards_with_grad > 0) stashed = order;
    for (UnitState& u : units) {
      if (u.grads_in_full || u.release_after_reduce) {  // left by a backward that failed
        // A reduction of the buffer in place may still run: the group writes into that memory until it ends.
        if (u.release_after_reduce && u.reduce_out.defined()) settle(u.reduce, &u);
        u.grads_in_full = u.release_after_reduce = false;
        drop_memory(u);
      }
      reshard(u);
      u.reduced = false;
      u.reduce_in = at::Tensor(), u.reduce_out = at::Tensor();
    }
    if (!order.started.empty()) prev_started.swap(order.started);
    if (!order.ended.empty()) last_guess = order.ended.back();
    order.reset(units.size());
    if (at::GradMode::is_enabled()) ++forwards_with_grad;
    forward_active = true;
  }
  void end_forward() {
    forward_active = false;
    if (stashed) order = std::move(*stashed), stashed.reset();
  }

  // Unit k's forward begins (inside the model's forward): its parameters are gathered, and the unit that ran after it
  // in the forward before starts gathering.
  void pre_forward(int k) {
    UnitState& u = units[k];
    if (order.start_pos[k] >= 0) {
      throw_error(absl::FailedPreconditionError(
          absl::StrCat("fsdp: unit ", u.label, " ran twice in one forward (a unit runs at most once per forward)")));
    }
    const size_t p = order.started.size();
    order.start_pos[k] = static_cast<int>(p);
    order.started.push_back(k);
    gathered(u);
    if (options.prefetch && p + 1 < prev_started.size() && prev_started[p] == k) {
      start_gather(units[prev_started[p + 1]]);
    }
  }
  // Its forward ended with output x: the parameters are released (except the unit expected to end the forward, whose
  // backward comes first), and a hook on x runs pre_backward before the unit's backward.
  at::Tensor post_forward(int k, at::Tensor x) {
    UnitState& u = units[k];
    order.subtree_end[k] = static_cast<int>(order.started.size());
    order.end_pos[k] = static_cast<int>(order.ended.size());
    order.ended.push_back(k);
    const bool grad = at::GradMode::is_enabled();
    if (!zero2() && (!grad || (options.reshard_after_forward && k != last_guess))) reshard(u);
    if (grad && x.defined() && x.requires_grad()) {
      x.register_hook([weak = self, k](const at::Tensor&) {
        if (auto state = weak.lock()) state->pre_backward(k);
      });
    }
    return x;
  }

  // Before unit j's backward (a hook on its output): the units whose forward began after j's had ended (after it in a
  // chain; not those nested in it, which run their backward inside j's) are done: the reductions started earlier
  // (which ran while the unit after j computed) are finished, theirs start; unit j's parameters are gathered again,
  // and the unit whose forward ended before j's starts gathering. At most two reductions' buffers are alive at once
  // (with overlap_reduce off, none: the reductions end before unit j is gathered). Units nested in others are reduced
  // when a unit before their outermost one begins its backward, or at the end.
  void pre_backward(int j) {
    std::lock_guard<std::mutex> lock(mu);
    // A backward inside the forward (torch::autograd::grad through a unit's output, e.g. for a penalty on the input's
    // gradient): the unit is gathered for it, and nothing is reduced (that backward accumulates no .grad).
    if (forward_active) return gathered(units[j]);
    if (!in_backward) {
      in_backward = true;
      fsdp_queue_engine_callback([weak = self] {
        if (auto state = weak.lock()) state->end_backward();
      });
    }
    for (UnitState& u : units) finish(u);
    // After several forwards, one backward goes through every graph (the later ones' first): a unit's gradients are
    // complete only at its end, where every unit is reduced.
    if (order.subtree_end[j] >= 0 && forwards_with_grad <= 1) {
      for (int q = static_cast<int>(order.started.size()) - 1; q >= order.subtree_end[j]; --q) {
        reduce(units[order.started[q]]);
      }
    }
    if (!options.overlap_reduce) {
      for (UnitState& u : units) finish(u);  // their buffers go before this unit's is taken
    }
    gathered(units[j]);
    if (options.prefetch && order.end_pos[j] > 0) start_gather(units[order.ended[order.end_pos[j] - 1]]);
  }

  // At the end of backward: the units whose reduction has not started (the first one, units nested in others, any
  // whose output got no gradient, any that did not run) start it, in the same order on every rank; then every shard
  // gets its average.
  void end_backward() {
    std::lock_guard<std::mutex> lock(mu);
    in_backward = false;
    forwards_with_grad = 0;
    for (int q = static_cast<int>(order.started.size()) - 1; q >= 0; --q) reduce(units[order.started[q]]);
    for (int k = static_cast<int>(units.size()) - 1; k >= 0; --k) reduce(units[k]);
    for (UnitState& u : units) finish(u), u.reduced = false;
    // The step's large temporaries (autograd's gradients before they were reduced) went back to malloc's heap, which
    // keeps them for the next ones. Handing its free pages back here (malloc_trim) lowered the benchmark's peak by
    // about 10 MiB but made the next step fault them in again: 1.2-1.3x DDP's step against 1.0-1.1x without.
  }
};

namespace {

// The models alive, by State::id, for LinearIntoBuffer's backward (which may outlive its model).
std::mutex g_models_mu;
std::map<int64_t, std::weak_ptr<detail::ModelState>> g_models;
std::atomic<int64_t> g_next_model{1};

// A Linear unit's forward whose backward writes the weight's and the bias's gradients into the unit's gathered buffer,
// over the parameters, once the input's gradient (the last use of the weight) is computed: the reduction then starts
// from that buffer, so the weight's gradient needs no memory of its own and is not copied (the largest unit's gradient
// and its copy were most of what a step held beyond the sharded state and the gathered unit). Autograd gets no
// gradient for the parameters. Without its model (destroyed meanwhile) the gradients are returned as usual.
struct LinearIntoBuffer : public torch::autograd::Function<LinearIntoBuffer> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t model, int64_t unit) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["model"] = model;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["bias"] = bias.defined();
    return at::linear(x, weight, bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor go = grads[0].reshape({-1, weight.size(0)});
    const at::Tensor x2 = x.reshape({-1, weight.size(1)});
    const bool has_bias = ctx->saved_data["bias"].toBool();
    std::shared_ptr<detail::ModelState> state;
    {
      std::lock_guard<std::mutex> lock(g_models_mu);
      if (auto it = g_models.find(ctx->saved_data["model"].toInt()); it != g_models.end()) state = it->second.lock();
    }
    if (!state) {  // its buffers, the weight's memory among them, are gone
      throw_error(absl::FailedPreconditionError("fsdp: backward through a model that was destroyed"));
    }
    at::Tensor grad_x = ctx->needs_input_grad(0) ? go.mm(weight).view(x.sizes()) : at::Tensor();
    const bool weight_grad = ctx->needs_input_grad(1), bias_grad = has_bias && ctx->needs_input_grad(2);
    // Under create_graph the input's gradient keeps the weight for a later backward: it is not overwritten then.
    if (!at::GradMode::is_enabled() &&
        state->write_gradients(ctx->saved_data["unit"].toInt(), go, x2, weight_grad, bias_grad)) {
      return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    return {grad_x, weight_grad ? go.t().mm(x2) : at::Tensor(), bias_grad ? go.sum(0) : at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// Unit k's module run on x: through LinearIntoBuffer when the model's into_buffer says so, else by `plain`.
at::Tensor run_unit(detail::ModelState& s, int k, const torch::nn::Module& module, const at::Tensor& x,
                    const std::function<at::Tensor()>& plain) {
  const UnitState& u = s.units[static_cast<size_t>(k)];
  if (!s.into_buffer(u, module)) return plain();
  return LinearIntoBuffer::apply(x, u.params[0], u.params.size() > 1 ? u.params[1] : at::Tensor(), s.id,
                                 static_cast<int64_t>(k));
}

// Unit `label` of `params` (named), its layout: INVALID_ARGUMENT when they differ in dtype or device. Nothing changes.
UnitState describe_unit(std::string label, const std::vector<std::pair<std::string, at::Tensor>>& params, int world) {
  UnitState u;
  u.label = std::move(label);
  for (const auto& [name, p] : params) {
    if (!u.params.empty() && (p.scalar_type() != u.params[0].scalar_type() || p.device() != u.params[0].device())) {
      throw_error(absl::InvalidArgumentError(
          absl::StrCat("fsdp: unit ", u.label, "'s parameters differ in dtype or device (", name, ")")));
    }
    u.params.push_back(p);
    u.names.push_back(name);
    u.offset.push_back(u.total);
    u.total += p.numel();
  }
  u.shard_size = (u.total + world - 1) / world;
  return u;
}

// Unit u's flat shards, rank 0's values with sync_module_states (a collective); the parameters become views of its
// released buffer.
void shard_unit(detail::ModelState& s, UnitState& u) {
  const int world = s.world(), rank = s.group->rank();
  const auto topts = u.params[0].options().requires_grad(false);
  at::Tensor flat = at::zeros({world * u.shard_size}, topts);
  for (size_t i = 0; i < u.params.size(); ++i) u.flat_part(flat, i).copy_(u.params[i].detach().reshape({-1}));
  if (s.options.sync_module_states) comm::wait(s.group->broadcast(flat, 0));
  u.shard = flat.narrow(0, rank * u.shard_size, u.shard_size).clone().requires_grad_(true);
  const auto param_dtype = s.options.mixed_precision.param_dtype;
  u.full = pooled_empty(world * u.shard_size, topts.dtype(param_dtype.value_or(topts.dtype().toScalarType())));
  for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(u.part(u.full, i));
  release(u.full);
}

// The model's fsdp::Units, in the order of its modules (a Unit's parent before it), with their paths.
std::vector<std::pair<std::string, std::shared_ptr<UnitImpl>>> units_in(const std::shared_ptr<torch::nn::Module>& m) {
  std::vector<std::pair<std::string, std::shared_ptr<UnitImpl>>> out;
  for (const auto& item : m->named_modules()) {
    if (auto unit = std::dynamic_pointer_cast<UnitImpl>(item.value())) {
      for (const auto& seen : out) {
        if (seen.second == unit) {
          throw_error(absl::InvalidArgumentError(
              absl::StrCat("fsdp: Unit '", item.key(), "' is also '", seen.first, "' (a Unit registered twice)")));
        }
      }
      out.emplace_back(item.key(), std::move(unit));
    }
  }
  return out;
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(torch::nn::Sequential model,
                                                   std::shared_ptr<comm::ProcessGroup> group, FsdpOptions options)
    : FullyShardedDataParallel(model ? model.ptr() : nullptr,
                               model ? detail::one_tensor_forward(model.ptr()) : detail::Forward(), std::move(group),
                               options) {}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model, detail::Forward forward,
                                                   std::shared_ptr<comm::ProcessGroup> group, FsdpOptions options)
    : state_(std::make_shared<State>()) {
  if (!model) throw_error(absl::InvalidArgumentError("fsdp: no model"));
  if (!group) throw_error(absl::InvalidArgumentError("fsdp: no process group"));
  State& s = *state_;
  s.self = state_;
  s.root = model;
  s.group = std::move(group);
  s.options = options;
  s.id = g_next_model.fetch_add(1);
  const FsdpOptions::MixedPrecision& mp = options.mixed_precision;
  for (const auto& dtype : {mp.param_dtype, mp.reduce_dtype, mp.output_dtype}) {
    if (dtype && !at::isFloatingType(*dtype)) {
      throw_error(absl::InvalidArgumentError(
          absl::StrCat("fsdp: mixed precision takes floating-point dtypes, not ", c10::toString(*dtype))));
    }
  }
  const auto unit_modules = units_in(model);
  auto* seq = model->as<torch::nn::SequentialImpl>();
  if (seq && seq->size() == 0) throw_error(absl::InvalidArgumentError("fsdp: an empty model"));
  // Every parameter once: a tensor under two names (tied) would be flattened into two places.
  const auto named = model->named_parameters(/*recurse=*/true);
  {
    std::map<const c10::TensorImpl*, std::string> seen;
    for (const auto& item : named) {
      auto [it, fresh] = seen.emplace(item.value().unsafeGetTensorImpl(), item.key());
      if (!fresh) {
        throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: parameters '", it->second, "' and '", item.key(),
                                                            "' are one tensor (tied): not supported")));
      }
    }
  }
  if (named.is_empty()) throw_error(absl::InvalidArgumentError("fsdp: a model without parameters"));
  // The units are described and checked whole before anything changes: a model refused is left as it was.
  using Named = std::vector<std::pair<std::string, at::Tensor>>;
  const int world = s.world();
  std::vector<int> unit_of_module(unit_modules.size(), -1);  // each Unit's unit
  if (seq && unit_modules.empty()) {                         // every child with parameters a unit
    s.seq = torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model));
    s.unit_of_child.assign(seq->size(), -1);
    for (size_t c = 0; c < seq->size(); ++c) {
      Named params;
      for (const auto& item : seq->ptr(c)->named_parameters())
        params.emplace_back(absl::StrCat(c, ".", item.key()), item.value());
      if (params.empty()) continue;
      s.unit_of_child[c] = static_cast<int>(s.units.size());
      s.units.push_back(describe_unit(std::to_string(c), params, world));
    }
  } else {  // the Units, each with the parameters under it and not under a Unit inside it; the rest the root's
    s.run = std::move(forward);
    std::vector<Named> of_unit(unit_modules.size());
    Named rest;
    for (const auto& item : named) {
      int owner = -1;
      size_t longest = 0;
      for (size_t m = 0; m < unit_modules.size(); ++m) {
        const std::string& path = unit_modules[m].first;
        const bool under = path.empty() || (item.key().size() > path.size() && item.key()[path.size()] == '.' &&
                                            item.key().compare(0, path.size(), path) == 0);
        if (under && (owner < 0 || path.size() >= longest)) owner = static_cast<int>(m), longest = path.size();
      }
      (owner < 0 ? rest : of_unit[owner]).push_back({item.key(), item.value()});
    }
    if (!rest.empty()) {
      s.root_unit = 0;
      s.units.push_back(describe_unit("the root", rest, world));
    }
    for (size_t m = 0; m < unit_modules.size(); ++m) {
      // A parameter registered on the wrapped module after the Unit was built is not the Unit's: refused, or it would
      // be neither sharded nor trained.
      const UnitImpl& unit = *unit_modules[m].second;
      const auto mine = unit.named_parameters(/*recurse=*/true), its = unit.inner_->named_parameters(/*recurse=*/true);
      std::set<const c10::TensorImpl*> registered;
      for (const auto& item : mine) registered.insert(item.value().unsafeGetTensorImpl());
      for (const auto& item : its) {
        if (!registered.count(item.value().unsafeGetTensorImpl())) {
          throw_error(absl::InvalidArgumentError(
              absl::StrCat("fsdp: Unit '", unit_modules[m].first, "': its module's parameter '", item.key(),
                           "' was registered after the Unit was built (build the Unit from the finished module)")));
        }
      }
      if (of_unit[m].empty()) continue;
      unit_of_module[m] = static_cast<int>(s.units.size());
      s.units.push_back(describe_unit("'" + unit_modules[m].first + "'", of_unit[m], world));
    }
  }
  at::NoGradGuard no_grad;
  if (options.sync_module_states) {
    for (auto& b : model->buffers()) comm::wait(s.group->broadcast(b, 0));
  }
  for (UnitState& u : s.units) shard_unit(s, u);
  for (size_t m = 0; m < unit_modules.size(); ++m) {
    UnitImpl& unit = *unit_modules[m].second;
    unit.state_ = state_;
    unit.attached_ = true;
    unit.unit_ = unit_of_module[m];
  }
  std::map<const c10::TensorImpl*, std::pair<int, int>> where;
  for (size_t k = 0; k < s.units.size(); ++k) {
    for (size_t i = 0; i < s.units[k].params.size(); ++i) {
      where[s.units[k].params[i].unsafeGetTensorImpl()] = {static_cast<int>(k), static_cast<int>(i)};
    }
  }
  for (const auto& item : named) s.param_order.push_back(where.at(item.value().unsafeGetTensorImpl()));
  // At first, prefetching follows the units' order, and the root's unit (which ends the forward) or the last unit is
  // expected to end it.
  s.order.reset(s.units.size());
  s.prev_started.resize(s.units.size());
  std::iota(s.prev_started.begin(), s.prev_started.end(), 0);
  s.last_guess = s.root_unit >= 0 ? s.root_unit : static_cast<int>(s.units.size()) - 1;
  // The unsharded parameters and the flat copies made above went back to malloc's heap, which keeps freed memory
  // resident (with a raised trim threshold, as bench/run.sh sets, or in the middle of the heap): handed back once
  // here, not per step (see end_backward). The benchmark's fully sharded peak fell from 158 to 147 MiB.
  malloc_trim(0);
  std::lock_guard<std::mutex> lock(g_models_mu);
  g_models[s.id] = state_;  // last: a constructor that throws leaves no entry
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  // The units' buffers go back (the module's parameters keep their storages, empty, as between uses), after the
  // collectives still writing into them; then what the pool kept is unmapped.
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(g_models_mu);
    g_models.erase(s.id);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  for (UnitState& u : s.units) {
    if (u.held == Held::kGathering) s.settle(u.gather, &u);
    if (u.reduce_out.defined()) s.settle(u.reduce, u.release_after_reduce ? &u : nullptr);  // in place: into full
    u.reduce_in = at::Tensor(), u.reduce_out = at::Tensor();
    if (!u.written_late) release(u.full);
  }
  pool().trim();
}

const std::shared_ptr<torch::nn::Module>& FullyShardedDataParallel::root_module() const { return state_->root; }

namespace detail {

void throw_not_a(const char* wanted, const torch::nn::Module& module) {
  throw_error(absl::InvalidArgumentError(
      absl::StrCat("fsdp: forward_as<", c10::demangle(wanted), ">: the module is a ", module.name())));
}

ForwardScope::ForwardScope(const std::weak_ptr<ModelState>& weak, int unit, bool attached)
    : state(weak.lock()), unit_(unit) {
  if (!state) {
    if (attached) {
      throw_error(absl::FailedPreconditionError(
          "fsdp: a Unit of a FullyShardedDataParallel that was destroyed (its parameters hold no memory)"));
    }
    return;  // a Unit no model holds: the module's plain forward
  }
  // The lock is held while the model's state changes, not across the user's code in between (which may run a
  // backward through a unit's output, whose hook takes it).
  std::lock_guard<std::mutex> lock(state->mu);
  if (unit_ == kRoot) {
    if (state->forward_active) {
      throw_error(absl::FailedPreconditionError("fsdp: forward() called inside the model's own forward"));
    }
    state->begin_forward();
    entered_ = true;
    if (state->root_unit >= 0) state->pre_forward(state->root_unit);
    return;
  }
  if (!state->forward_active) {
    throw_error(absl::FailedPreconditionError(
        "fsdp: a Unit of a fully sharded model runs only inside its FullyShardedDataParallel's forward()"));
  }
  if (unit_ >= 0) state->pre_forward(unit_);
}

ForwardScope::~ForwardScope() {
  if (!state || unit_ != kRoot || !entered_ || done_) return;
  std::lock_guard<std::mutex> lock(state->mu);
  state->end_forward();  // an exception: the next forward starts afresh
}

at::Tensor ForwardScope::cast(const at::Tensor& x) const {
  if (!state) return x;
  const auto& dtype = state->options.mixed_precision.param_dtype;
  return dtype && x.defined() && x.is_floating_point() ? x.to(*dtype) : x;
}

at::Tensor ForwardScope::output(at::Tensor out) {
  if (!state) return out;
  std::lock_guard<std::mutex> lock(state->mu);
  if (unit_ >= 0) return state->post_forward(unit_, std::move(out));
  if (unit_ != kRoot) return out;
  if (state->root_unit >= 0) out = state->post_forward(state->root_unit, std::move(out));
  const auto& dtype = state->options.mixed_precision.output_dtype;
  if (dtype && out.defined() && out.is_floating_point()) out = out.to(*dtype);
  state->end_forward();
  done_ = true;
  return out;
}

}  // namespace detail

at::Tensor FullyShardedDataParallel::forward(const at::Tensor& input) {
  State& s = *state_;
  if (!s.seq && !s.run) {
    throw_error(absl::UnimplementedError(
        "fsdp: the model's forward does not take one tensor: call forward_as<Module>(args...)"));
  }
  detail::ForwardScope scope(state_, detail::ForwardScope::kRoot, true);
  at::Tensor x = scope.cast(input);
  if (!s.seq) return scope.output(s.run(x));
  size_t c = 0;
  for (auto it = s.seq->begin(); it != s.seq->end(); ++it, ++c) {
    const int k = s.unit_of_child[c];
    if (k < 0) {
      x = it->forward(x);
      continue;
    }
    detail::ForwardScope unit(state_, k, /*attached=*/true);  // as a Unit's forward, without its input's cast
    x = unit.output(run_unit(s, k, *it->ptr(), x, [&] { return it->forward(x); }));
  }
  return scope.output(std::move(x));
}

UnitImpl::UnitImpl(std::shared_ptr<torch::nn::Module> module, detail::Forward forward)
    : inner_(std::move(module)), forward_(std::move(forward)) {
  if (!inner_) throw_error(absl::InvalidArgumentError("fsdp::Unit: no module"));
  // The module's parameters, buffers and children are the Unit's (the module itself is not a child): the names are
  // those of the model without Units.
  for (const auto& p : inner_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (const auto& c : inner_->named_children()) register_module(c.key(), c.value());
}

at::Tensor UnitImpl::forward(const at::Tensor& input) {
  if (!forward_) {
    throw_error(absl::UnimplementedError(
        "fsdp::Unit: its module's forward does not take one tensor: call forward_as<Module>(args...)"));
  }
  detail::ForwardScope scope(state_, unit_, attached_);
  const at::Tensor x = scope.cast(input);
  if (!scope.state || unit_ < 0) return scope.output(forward_(x));
  return scope.output(run_unit(*scope.state, unit_, *inner_, x, [&] { return forward_(x); }));
}

void UnitImpl::train(bool on) {
  inner_->train(on);
  torch::nn::Module::train(on);
}

void UnitImpl::pretty_print(std::ostream& stream) const {
  stream << "tandem::fsdp::Unit(";
  inner_->pretty_print(stream);
  stream << ")";
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<at::Tensor> out;
  for (const UnitState& u : state_->units) out.push_back(u.shard);
  return out;
}

void FullyShardedDataParallel::set_requires_gradient_sync(bool sync) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->sync = sync;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::full_parameters() const {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> whole;
  for (const UnitState& u : s.units) {
    whole.push_back(at::empty({s.world() * u.shard_size}, u.shard.options().requires_grad(false)));
    comm::wait(s.group->allgather(whole.back(), u.shard.detach()));
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [k, i] : s.param_order) {
    out.emplace_back(s.units[k].names[i], s.units[k].part(whole[k], i).clone());
  }
  return out;
}

namespace {

std::string shape_of(at::IntArrayRef sizes) { return c10::str(sizes); }  // [2, 3]

// Whether a state dict's entry fits the model's tensor of `sizes` and `dtype`: INVALID_ARGUMENT naming it when not.
void check_entry(const std::string& name, const at::Tensor& given, at::IntArrayRef sizes, at::ScalarType dtype) {
  if (given.defined() && given.sizes() == sizes && given.scalar_type() == dtype) return;
  throw_error(absl::InvalidArgumentError(
      absl::StrCat("fsdp: state dict entry '", name, "' is ",
                   given.defined() ? shape_of(given.sizes()) + " " + c10::toString(given.scalar_type()) : "undefined",
                   " but the model's is ", shape_of(sizes), " ", c10::toString(dtype))));
}

using Entries = std::map<std::string, const at::Tensor*>;

// A dict's entries by name: INVALID_ARGUMENT when a name comes twice.
Entries entries_of(const std::vector<std::pair<std::string, at::Tensor>>& dict) {
  Entries out;
  for (const auto& [name, t] : dict) {
    if (!out.emplace(name, &t).second) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: state dict has '", name, "' twice")));
    }
  }
  return out;
}

// Takes entry `name` out of `given`: INVALID_ARGUMENT when it has none.
at::Tensor take_entry(Entries* given, const std::string& name) {
  auto it = given->find(name);
  if (it == given->end()) throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: state dict has no '", name, "'")));
  const at::Tensor t = *it->second;
  given->erase(it);
  return t;
}

// Takes every buffer of `model` out of `given`, each checked against the buffer (present, of its shape and dtype):
// (entry, buffer) pairs, to be copied once the whole dict is checked.
std::vector<std::pair<at::Tensor, at::Tensor>> take_buffers(const torch::nn::Module& model, Entries* given) {
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (const auto& b : model.named_buffers(/*recurse=*/true)) {
    out.emplace_back(take_entry(given, b.key()), b.value());
    check_entry(b.key(), out.back().first, b.value().sizes(), b.value().scalar_type());
  }
  return out;
}

// What is left in `given` after the model took its entries: INVALID_ARGUMENT naming the first.
void refuse_extra(const Entries& given) {
  if (given.empty()) return;
  throw_error(absl::InvalidArgumentError(
      absl::StrCat("fsdp: state dict entry '", given.begin()->first, "' is not in the model")));
}

}  // namespace

FullyShardedDataParallel::StateDict FullyShardedDataParallel::full_state_dict() const {
  StateDict out = full_parameters();
  for (auto& b : named_buffers()) out.push_back(std::move(b));
  return out;
}

FullyShardedDataParallel::StateDict FullyShardedDataParallel::named_buffers() const {
  StateDict out;
  for (const auto& b : state_->root->named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value().clone());
  return out;
}

void FullyShardedDataParallel::load_full_state_dict(const StateDict& dict) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  at::NoGradGuard no_grad;
  Entries given = entries_of(dict);
  // Checked whole before anything changes, so that a bad dict leaves the model as it was.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (given, target)
  const int64_t rank = s.group->rank();
  for (UnitState& u : s.units) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      const at::Tensor t = take_entry(&given, u.names[i]);
      check_entry(u.names[i], t, u.params[i].sizes(), u.shard.scalar_type());  // the shard's: mixed precision
      const UnitState::Overlap o = u.overlap(i, rank);
      if (o.n == 0) continue;
      copies.emplace_back(t.reshape({-1}).narrow(0, o.from, o.n), u.shard.detach().narrow(0, o.at, o.n));
    }
  }
  for (auto& c : take_buffers(*s.root, &given)) copies.push_back(std::move(c));
  refuse_extra(given);
  for (UnitState& u : s.units) s.reshard(u);  // what was gathered is stale now
  for (auto& [from, to] : copies) to.copy_(from);
}

FullyShardedDataParallel::ShardedStateDict FullyShardedDataParallel::sharded_state_dict() const {
  const State& s = *state_;
  ShardedStateDict out;
  out.world_size = s.world();
  out.rank = s.group->rank();
  out.pieces = s.pieces();
  for (Piece& p : out.pieces) p.values = p.values.clone();
  out.buffers = named_buffers();
  return out;
}

void FullyShardedDataParallel::load_sharded_state_dict(const ShardedStateDict& dict) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  at::NoGradGuard no_grad;
  const std::vector<Piece> mine = s.pieces();  // views of this rank's shards
  if (dict.world_size != s.world()) {
    throw_error(absl::FailedPreconditionError(
        absl::StrCat("fsdp: the sharded state dict was saved by ", dict.world_size, " ranks; this job has ", s.world(),
                     ": consolidate() the ranks' dicts and load_full_state_dict() instead")));
  }
  if (dict.rank != s.group->rank() || dict.pieces.size() != mine.size()) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: the sharded state dict is rank ", dict.rank, "'s, of ",
                                                        dict.pieces.size(), " parameters; this is rank ",
                                                        s.group->rank(), " of a model of ", mine.size())));
  }
  // Checked whole before anything changes, so that a bad dict leaves the model as it was.
  for (size_t i = 0; i < mine.size(); ++i) {
    const Piece &a = dict.pieces[i], &b = mine[i];
    if (a.name != b.name || a.shape != b.shape || a.offset != b.offset) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: sharded state dict piece ", i, " is '", a.name, "' ",
                                                          shape_of(a.shape), " at ", a.offset, "; the model's is '",
                                                          b.name, "' ", shape_of(b.shape), " at ", b.offset)));
    }
    check_entry(a.name + " (this rank's piece)", a.values, b.values.sizes(), b.values.scalar_type());
  }
  Entries given = entries_of(dict.buffers);
  const auto buffers = take_buffers(*s.root, &given);
  refuse_extra(given);
  for (UnitState& u : s.units) s.reshard(u);  // what was gathered is stale now
  for (size_t i = 0; i < mine.size(); ++i) mine[i].values.copy_(dict.pieces[i].values);
  for (const auto& [from, to] : buffers) to.copy_(from);
}

namespace {

// The optimizers whose per-parameter state full_optimizer_state_dict() knows: their state's tensors by field, and
// its step.
struct OptimizerState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // defined ones only
  int64_t step = 0;
};
enum class OptimizerKind { kAdam, kAdamW, kSgd };
OptimizerKind kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return OptimizerKind::kSgd;
  throw_error(absl::UnimplementedError(
      "fsdp: the optimizer's state can be gathered for Adam, AdamW and SGD only (a sharded checkpoint keeps any "
      "optimizer's)"));
}
template <typename AdamState>
OptimizerState adam_fields(const AdamState& a) {
  OptimizerState out;
  out.step = a.step();
  for (auto [name, t] : {std::pair<const char*, at::Tensor>{"exp_avg", a.exp_avg()},
                         {"exp_avg_sq", a.exp_avg_sq()},
                         {"max_exp_avg_sq", a.max_exp_avg_sq()}}) {
    if (t.defined()) out.tensors.emplace_back(name, t);
  }
  return out;
}
OptimizerState fields_of(OptimizerKind kind, const torch::optim::OptimizerParamState& state) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return adam_fields(static_cast<const torch::optim::AdamParamState&>(state));
    case OptimizerKind::kAdamW:
      return adam_fields(static_cast<const torch::optim::AdamWParamState&>(state));
    case OptimizerKind::kSgd: {
      OptimizerState out;
      const at::Tensor& m = static_cast<const torch::optim::SGDParamState&>(state).momentum_buffer();
      if (m.defined()) out.tensors.emplace_back("momentum_buffer", m);
      return out;
    }
  }
  return {};
}
template <typename AdamState>
std::unique_ptr<torch::optim::OptimizerParamState> adam_state(const OptimizerState& f) {
  auto a = std::make_unique<AdamState>();
  a->step(f.step);
  for (const auto& [name, t] : f.tensors) {
    if (name == "exp_avg") a->exp_avg(t);
    if (name == "exp_avg_sq") a->exp_avg_sq(t);
    if (name == "max_exp_avg_sq") a->max_exp_avg_sq(t);
  }
  return a;
}
std::unique_ptr<torch::optim::OptimizerParamState> state_of(OptimizerKind kind, const OptimizerState& f) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return adam_state<torch::optim::AdamParamState>(f);
    case OptimizerKind::kAdamW:
      return adam_state<torch::optim::AdamWParamState>(f);
    case OptimizerKind::kSgd: {
      auto m = std::make_unique<torch::optim::SGDParamState>();
      if (!f.tensors.empty()) m->momentum_buffer(f.tensors[0].second);
      return m;
    }
  }
  return nullptr;
}
// The fields each kind of optimizer may have (a saved dict's entries are looked up by them).
std::vector<std::string> possible_fields(OptimizerKind kind) {
  if (kind == OptimizerKind::kSgd) return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
}
// The fields a parameter's state must have, once it has any ("step" included).
std::vector<std::string> required_fields(OptimizerKind kind, const torch::optim::Optimizer& optimizer) {
  if (kind == OptimizerKind::kSgd) return {"momentum_buffer"};
  const bool amsgrad = kind == OptimizerKind::kAdam
                           ? static_cast<const torch::optim::AdamOptions&>(optimizer.defaults()).amsgrad()
                           : static_cast<const torch::optim::AdamWOptions&>(optimizer.defaults()).amsgrad();
  std::vector<std::string> out = {"exp_avg", "exp_avg_sq", "step"};
  if (amsgrad) out.push_back("max_exp_avg_sq");
  return out;
}
std::string state_key(const at::Tensor& t) { return c10::guts::to_string(t.unsafeGetTensorImpl()); }

}  // namespace

FullyShardedDataParallel::StateDict FullyShardedDataParallel::full_optimizer_state_dict(
    const torch::optim::Optimizer& optimizer) const {
  State& s = *state_;
  const OptimizerKind kind = kind_of(optimizer);
  at::NoGradGuard no_grad;
  // Which shards have state (none before the first step) and which fields it has, agreed by every rank before any
  // gather: each unit's signature is 0 (no state) or 1 + a bit per field present; [signature, -signature] summed by
  // max gives every rank the largest and the smallest.
  const int64_t n = static_cast<int64_t>(s.units.size());
  const std::vector<std::string> fields = possible_fields(kind);
  at::Tensor signature = at::zeros({2 * n}, at::kDouble);
  std::vector<std::optional<OptimizerState>> states(s.units.size());
  for (int64_t k = 0; k < n; ++k) {
    auto it = optimizer.state().find(state_key(s.units[k].shard));
    if (it == optimizer.state().end()) continue;
    states[k] = fields_of(kind, *it->second);
    double v = 1;
    for (size_t b = 0; b < fields.size(); ++b) {
      for (const auto& t : states[k]->tensors) v += t.first == fields[b] ? static_cast<double>(2 << b) : 0.0;
    }
    signature[k] = v;
    signature[n + k] = -v;
  }
  comm::wait(s.group->allreduce(signature, comm::ReduceOp::kMax));
  StateDict out;
  for (int64_t k = 0; k < n; ++k) {
    const double largest = signature[k].item<double>(), smallest = -signature[n + k].item<double>();
    if (largest != smallest) {
      throw_error(absl::FailedPreconditionError(
          absl::StrCat("fsdp: the ranks' optimizers differ in their state for unit ", k,
                       smallest == 0 ? " (some have none: were they all stepped?)" : " (its fields differ)")));
    }
    if (largest == 0) continue;
    const UnitState& u = s.units[k];
    const OptimizerState& f = *states[k];
    for (const auto& [field, shard] : f.tensors) {
      at::Tensor whole = at::empty({s.world() * u.shard_size}, shard.options());
      comm::wait(s.group->allgather(whole, shard.detach().reshape({-1})));
      for (size_t i = 0; i < u.params.size(); ++i) {
        out.emplace_back(absl::StrCat(u.names[i], ".", field), u.part(whole, i).clone());
      }
    }
    if (kind != OptimizerKind::kSgd) {
      for (size_t i = 0; i < u.params.size(); ++i) out.emplace_back(u.names[i] + ".step", at::tensor(f.step));
    }
  }
  return out;
}

void FullyShardedDataParallel::load_full_optimizer_state_dict(torch::optim::Optimizer& optimizer,
                                                              const StateDict& dict) {
  State& s = *state_;
  const OptimizerKind kind = kind_of(optimizer);
  std::map<std::string, at::Tensor> given(dict.begin(), dict.end());
  const int64_t rank = s.group->rank();
  // Every unit's state built (and checked) first; the optimizer changes only when all are.
  std::vector<std::pair<std::string, std::unique_ptr<torch::optim::OptimizerParamState>>> built;
  for (const UnitState& u : s.units) {
    OptimizerState f;
    bool any = false, stepped = false;
    for (const std::string& field : possible_fields(kind)) {
      at::Tensor shard;
      for (size_t i = 0; i < u.params.size(); ++i) {
        const std::string name = absl::StrCat(u.names[i], ".", field);
        auto it = given.find(name);
        if (it == given.end()) {
          if (shard.defined()) throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: no '", name, "'")));
          continue;
        }
        check_entry(name, it->second, u.params[i].sizes(), u.shard.scalar_type());
        if (!shard.defined()) {
          if (i != 0) {
            throw_error(absl::InvalidArgumentError(
                absl::StrCat("fsdp: no '", u.names[0], ".", field, "' beside '", name, "'")));
          }
          shard = at::zeros({u.shard_size}, u.shard.options().requires_grad(false));
        }
        const UnitState::Overlap o = u.overlap(i, rank);
        if (o.n > 0) shard.narrow(0, o.at, o.n).copy_(it->second.reshape({-1}).narrow(0, o.from, o.n));
        given.erase(it);
      }
      if (shard.defined()) f.tensors.emplace_back(field, shard), any = true;
    }
    std::string unstepped;  // a parameter of the unit without its step
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto it = given.find(u.names[i] + ".step");
      if (it == given.end()) {
        unstepped = u.names[i] + ".step";
        continue;
      }
      if (it->second.numel() != 1) {
        throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: '", it->first, "' is not one number")));
      }
      f.step = it->second.item<int64_t>();
      given.erase(it);
      any = stepped = true;
    }
    if (stepped && !unstepped.empty()) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: the optimizer state has no '", unstepped, "'")));
    }
    if (!any) {  // no state: none after loading either
      built.emplace_back(state_key(u.shard), nullptr);
      continue;
    }
    for (const std::string& field : required_fields(kind, optimizer)) {
      const bool has = field == "step" ? stepped : std::any_of(f.tensors.begin(), f.tensors.end(), [&](const auto& t) {
        return t.first == field;
      });
      if (!has) {
        throw_error(absl::InvalidArgumentError(
            absl::StrCat("fsdp: the optimizer state has '", u.names[0], "' but no '", u.names[0], ".", field, "'")));
      }
    }
    built.emplace_back(state_key(u.shard), state_of(kind, f));
  }
  if (!given.empty()) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: optimizer state entry '", given.begin()->first,
                                                        "' is not of this model's parameters or optimizer")));
  }
  for (auto& [key, state] : built) {
    if (state) {
      optimizer.state()[key] = std::move(state);
    } else {
      optimizer.state().erase(key);
    }
  }
}

FullyShardedDataParallel::StateDict FullyShardedDataParallel::consolidate(const std::vector<ShardedStateDict>& ranks) {
  if (ranks.empty()) throw_error(absl::InvalidArgumentError("fsdp: consolidate() of no sharded state dict"));
  const ShardedStateDict& first = ranks[0];
  // Before anything is sized by the files' world size.
  if (static_cast<int64_t>(ranks.size()) != first.world_size) {
    throw_error(absl::InvalidArgumentError(absl::StrCat(
        "fsdp: consolidate() of ", ranks.size(), " sharded state dicts; the job had ", first.world_size, " ranks")));
  }
  std::vector<bool> seen(ranks.size());
  for (const ShardedStateDict& d : ranks) {
    if (d.pieces.size() != first.pieces.size() || d.world_size != first.world_size) {
      throw_error(absl::InvalidArgumentError("fsdp: consolidate() of sharded state dicts of different models or jobs"));
    }
    if (d.rank < 0 || d.rank >= d.world_size || seen[static_cast<size_t>(d.rank)]) {
      throw_error(absl::InvalidArgumentError(
          absl::StrCat("fsdp: consolidate(): rank ", d.rank, " of ", d.world_size, " is out of range or given twice")));
    }
    seen[static_cast<size_t>(d.rank)] = true;
  }
  StateDict out;
  for (size_t i = 0; i < first.pieces.size(); ++i) {
    const Piece& p = first.pieces[i];
    int64_t numel = 1;
    for (int64_t d : p.shape) {
      if (d < 0 || (d > 0 && numel > (int64_t{1} << 40) / d)) {
        throw_error(absl::InvalidArgumentError(
            absl::StrCat("fsdp: consolidate(): '", p.name, "' has the shape ", shape_of(p.shape))));
      }
      numel *= d;
    }
    // Every piece belongs to this parameter and fits in it, the pieces do not overlap, and together they are as large
    // as the whole: so they cover it. All checked before the whole is allocated (a shape read from a file does not
    // size an allocation alone).
    std::vector<std::pair<int64_t, const ShardedStateDict*>> by_offset;
    int64_t pieces = 0;
    for (const ShardedStateDict& d : ranks) {
      const Piece& q = d.pieces[i];
      if (!q.values.defined() || !p.values.defined() || q.name != p.name || q.shape != p.shape || q.offset < 0 ||
          q.offset > numel - q.values.numel() || q.values.scalar_type() != p.values.scalar_type()) {
        throw_error(absl::InvalidArgumentError(
            absl::StrCat("fsdp: consolidate(): rank ", d.rank, "'s piece ", i, " ('", q.name, "') does not fit")));
      }
      if (q.values.numel() > 0) by_offset.emplace_back(q.offset, &d);  // an empty piece overlaps nothing
    }
    std::sort(by_offset.begin(), by_offset.end(), [&](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t k = 1; k < by_offset.size(); ++k) {
      const Piece& before = by_offset[k - 1].second->pieces[i];
      if (before.offset + before.values.numel() > by_offset[k].first) {
        throw_error(absl::InvalidArgumentError(absl::StrCat("fsdp: consolidate(): rank ", by_offset[k].second->rank,
                                                            "'s piece of '", p.name, "' overlaps another rank's")));
      }
    }
    // Pieces that fit and do not overlap hold at most the whole: no overflow.
    for (const auto& [offset, d] : by_offset) pieces += d->pieces[i].values.numel();
    if (pieces != numel) {
      throw_error(
          absl::InvalidArgumentError(absl::StrCat("fsdp: consolidate(): the pieces of '", p.name, "' hold ", pieces,
                                                  " elements; its shape ", shape_of(p.shape), " has ", numel)));
    }
    at::Tensor whole = at::empty({numel}, p.values.options());
    for (const ShardedStateDict& d : ranks) {
      const Piece& q = d.pieces[i];
      whole.narrow(0, q.offset, q.values.numel()).copy_(q.values.reshape({-1}));
    }
    out.emplace_back(p.name, whole.view(p.shape));
  }
  for (const auto& b : first.buffers) out.push_back(b);
  return out;
}

FullyShardedDataParallel::Stats FullyShardedDataParallel::stats() const {
  const State& s = *state_;
  Stats out;
  out.units = static_cast<int64_t>(s.units.size());
  for (const UnitState& u : s.units) {
    out.shard_elements += u.shard_size;
    out.largest_unit_elements = std::max(out.largest_unit_elements, u.full.numel());
  }
  out.peak_gathered_elements = s.peak_gathered;
  out.buffers_mapped = pool().mappings();
  out.buffer_bytes_peak = pool().most_in_use();
  out.gradients_into_buffers = s.gradients_into_buffers;
  return out;
}

}  // namespace tandem::fsdp
