// Fully sharded data parallelism (ZeRO-3; PyTorch's FullyShardedDataParallel), and ZeRO-2, over a
// torch::nn::Sequential (every child a unit) or any module whose units the user names (fsdp::Unit).
//
//   auto pg = comm::ProcessGroup::create("fsdp");                      // every rank, after rpc::init_rpc
//   fsdp::FullyShardedDataParallel model(make_sequential(), pg);       // rank 0's parameters, sharded
//   torch::optim::Adam opt(model.parameters(), 1e-3);                  // this rank's shards only
//   for (auto& batch : *loader) {                                      // each rank its own rows
//     opt.zero_grad();
//     torch::mse_loss(model.forward(batch.data), batch.target).backward();  // shard gradients averaged over ranks
//     opt.step();
//   }
//
// Units the user names (PyTorch's FSDP wrapping a submodule; FSDP2's fully_shard(model.encoder)): a submodule
// registered wrapped in fsdp::Unit, at any depth, units inside units too:
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() {
//       encoder = register_module("encoder", fsdp::Unit(torch::nn::Sequential(...)));  // one unit
//       head = register_module("head", fsdp::Unit(torch::nn::Linear(64, 10)));        // another
//       scale = register_parameter("scale", torch::ones({10}));                        // the root's unit
//     }
//     at::Tensor forward(const at::Tensor& x) { return head(encoder(x)) * scale; }
//     fsdp::Unit encoder{nullptr}, head{nullptr};
//     at::Tensor scale;
//   };
//   fsdp::FullyShardedDataParallel model(std::make_shared<NetImpl>(), pg);
//   model.forward(x);  // runs NetImpl::forward; each Unit gathers its parameters around its module's forward
//
// Then the units are the model's fsdp::Units (a unit's parameters are those under it and not under a Unit inside it)
// and, when parameters are left outside every Unit, the root's own unit, gathered for the whole forward (as PyTorch's
// root FSDP instance). A module without Units is one unit. A Unit is transparent: it registers its module's
// parameters, buffers and children as its own, so the names are those of the same model without Units
// ("encoder.0.weight"), and a model whose Units no FullyShardedDataParallel holds computes as the plain model (the
// reference a test compares with). Prefetching follows the order the units ran in the previous forward.
//
// How: each child of the Sequential that has parameters is a unit (with no fsdp::Unit in it; else the Units are). A
// unit's parameters are flattened in order into one buffer of N elements, padded to W x S (S = ceil(N / W), W the
// group's size); rank r keeps elements [r S, (r + 1) S) as a leaf tensor (parameters()), and the module's own
// parameters become views of a unit buffer whose memory is released between uses. Before a unit's forward its shards
// are all-gathered into that buffer (the next unit's gather is started while this one computes: prefetch); after it the
// memory is released again (reshard_after_forward). In backward, a hook on each unit's output gathers its parameters
// again just before the unit's backward (and starts the previous unit's gather); when the unit before it begins its
// backward, this unit's gradients are reduce-scattered (averaged) into the shards' .grad, overlapping the rest of
// backward, and its buffer released. Every rank issues the same collectives in the same order, whichever parameters got
// gradients: a parameter without one (unused on this rank) contributes zeros. Peak parameter memory per rank: its
// shards, plus about two units gathered at once (one with prefetch and overlap_reduce off).
//
// Contract:
// - Every rank builds the same architecture and calls forward and backward the same number of times, each backward
//   after its forward (as DDP), its units running in the same order on every rank (PyTorch's FSDP asks the same).
//   The gradient is the average over the ranks of each rank's loss gradient. A unit's output must get a gradient on
//   every rank or on none (the hook on it gathers the unit for its backward: a rank whose loss does not use it issues
//   one gather fewer, and the ranks' collectives pair wrongly until the group's deadline; PyTorch's FSDP asks the
//   same; TANDEM_DEBUG_COLLECTIVES names the first rank that differs). Several forwards before one backward work
//   (every unit is then reduced at the end of the backward). A backward inside the forward
//   (torch::autograd::grad through a unit's output) computes with the unit gathered and reduces nothing. A unit runs
//   at most once per forward (FAILED_PRECONDITION otherwise); a Unit of a held model runs only inside its forward()
//   (FAILED_PRECONDITION otherwise, as after the model was destroyed, when its parameters hold no memory).
// - The model's parameters must not be used outside forward() after wrapping: their memory is released between
//   uses (full_parameters() gathers them); under ZeRO-2 they hold the values of the last forward. Its buffers are not
//   sharded; with sync_module_states every rank takes rank 0's at construction.
// - set_requires_gradient_sync(false) (PyTorch's no_sync): backwards keep the unsharded gradients in the module's
//   parameters' .grad and add to them; the next synchronised backward reduces their sum.
// - Errors: INVALID_ARGUMENT at construction for an empty model (no parameters), a unit whose parameters differ in
//   dtype or device, a parameter in two units, or a mixed-precision dtype that is not floating point;
//   the group's errors (a dead rank, a timeout) come out of forward() or backward() as tandem::Error naming the group
//   and the operation.
// - Memory: released buffers are kept for reuse by later buffers they can hold, the largest first, while what is kept
//   and what is in use stay within the most that was in use at once (process-wide); beyond that, and when the model
//   is destroyed, they are unmapped (docs/fsdp.md, "Memory").
// - Not thread-safe: one thread drives forward and backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "tandem/comm/process_group.h"

namespace torch::optim {
class Optimizer;
}

namespace tandem::fsdp {

enum class Sharding {
  // ZeRO-3 (PyTorch's FULL_SHARD, or SHARD_GRAD_OP with reshard_after_forward off): parameters, gradients and
  // optimizer state sharded; a unit's parameters exist whole only around its forward and backward.
  kFull,
  // ZeRO-2: gradients and optimizer state sharded, every parameter kept whole on every rank (DDP's parameter memory):
  // the gradients are reduce-scattered into the shards during backward, the optimizer steps the shards, and the next
  // forward gathers each unit's updated parameters into its buffer (prefetched a unit ahead) before using it.
  kGradientsAndOptimizer,
};

struct FsdpOptions {
  Sharding sharding = Sharding::kFull;
  // kFull: release each unit's gathered parameters after its forward and gather them again for its backward. Off: keep
  // them from its forward to the end of its backward (PyTorch's SHARD_GRAD_OP: less traffic, more memory).
  bool reshard_after_forward = true;
  // Start gathering the next unit's parameters while the current one computes (forward and backward; PyTorch's
  // forward_prefetch and backward_prefetch).
  bool prefetch = true;
  // Reduce-scatter a unit's gradients while the units before it run their backward. Off: each unit's reduction is
  // waited for before the next unit is gathered for its backward. With prefetch off too (fully sharded, resharding
  // after forward), a step holds at most one unit's buffer at a time (parameters, or gradients being reduced): the
  // least memory, for time (docs/fsdp.md, "Memory"; PyTorch's nearest switch is limit_all_gathers).
  bool overlap_reduce = true;
  // At construction every rank takes rank 0's parameters and buffers (a broadcast).
  bool sync_module_states = true;
  // Mixed precision (PyTorch's MixedPrecision): the shards stay in the parameters' dtype (the master copy the
  // optimizer steps); with param_dtype set, each unit is gathered in it (its shard cast first), so forward and
  // backward compute in it, and floating-point inputs of forward() are cast to it; gradients are reduced in
  // reduce_dtype (param_dtype when unset), then cast into the shards' .grad. output_dtype, when set, casts forward()'s
  // output (for a loss computed against float32 targets). Buffers keep their dtype. On CPU, LibTorch 1.13 computes
  // matrix products in bfloat16 but not in float16: param_dtype = float16 makes a Linear's forward throw there, while
  // reduce_dtype = float16 (with float32 parameters) works.
  struct MixedPrecision {
    std::optional<at::ScalarType> param_dtype;
    std::optional<at::ScalarType> reduce_dtype;
    std::optional<at::ScalarType> output_dtype;
  };
  MixedPrecision mixed_precision;
};

class FullyShardedDataParallel;

namespace detail {
struct ModelState;
using Forward = std::function<at::Tensor(const at::Tensor&)>;
// M's forward of one tensor, or null when M has none (forward() then throws UNIMPLEMENTED; forward_as<M>(...) runs
// it).
template <typename M, typename = void>
struct HasTensorForward : std::false_type {};
template <typename M>
struct HasTensorForward<
    M, std::void_t<decltype(at::Tensor(std::declval<M&>().forward(std::declval<const at::Tensor&>())))>>
    : std::true_type {};
template <typename M>
Forward one_tensor_forward(const std::shared_ptr<M>& module) {
  if constexpr (HasTensorForward<M>::value) {
    return [raw = module.get()](const at::Tensor& x) -> at::Tensor { return raw->forward(x); };
  } else {
    return nullptr;
  }
}
// INVALID_ARGUMENT naming both types when `module` is not an M.
[[noreturn]] void throw_not_a(const char* wanted, const torch::nn::Module& module);
template <typename M>
M* module_as(torch::nn::Module& module) {
  M* m = module.as<M>();
  if (!m) throw_not_a(typeid(M).name(), module);
  return m;
}
// Around a module's forward (a Unit's, or the root's): gathers before, and after, releases and hooks the backward.
// Unit k of `state`; `state` null: a plain forward.
class ForwardScope {
 public:
  static constexpr int kRoot = -2;  // `unit` for the model's own forward
  // `attached`: a Unit some model held (an error when that model is gone). Throws (see the contract above).
  ForwardScope(const std::weak_ptr<ModelState>& state, int unit, bool attached);
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  // Floating-point tensors cast to the compute dtype under mixed precision; anything else as it is.
  template <typename T>
  decltype(auto) input(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return cast(arg);
    } else {
      return std::forward<T>(arg);
    }
  }
  at::Tensor cast(const at::Tensor& x) const;
  at::Tensor output(at::Tensor out);
  std::shared_ptr<ModelState> state;

 private:
  int unit_;
  bool entered_ = false;  // the model's forward began
  bool done_ = false;
};
}  // namespace detail

// A submodule named as a unit of a fully sharded model (see above): register it in place of the module, call it as
// the module (forward of one tensor, or forward_as<M>(args...) for another signature). Its parameters, buffers and
// children are the module's (a Unit adds no name to theirs). Not thread-safe, as the model.
class UnitImpl : public torch::nn::Module {
 public:
  template <typename M>
  explicit UnitImpl(torch::nn::ModuleHolder<M> module) : UnitImpl(module.ptr()) {}
  template <typename M>
  explicit UnitImpl(std::shared_ptr<M> module)
      : UnitImpl(std::static_pointer_cast<torch::nn::Module>(module), detail::one_tensor_forward(module)) {}
  UnitImpl(std::shared_ptr<torch::nn::Module> module, detail::Forward forward);

  at::Tensor forward(const at::Tensor& input);
  // The module's forward of other arguments (its type M), returning a tensor.
  template <typename M, typename... Args>
  at::Tensor forward_as(Args&&... args) {
    M* module = detail::module_as<M>(*inner_);
    detail::ForwardScope scope(state_, unit_, attached_);
    return scope.output(module->forward(scope.input(std::forward<Args>(args))...));
  }
  const std::shared_ptr<torch::nn::Module>& module() const { return inner_; }
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

 private:
  friend class FullyShardedDataParallel;
  std::shared_ptr<torch::nn::Module> inner_;
  detail::Forward forward_;
  std::weak_ptr<detail::ModelState> state_;  // set by the model that holds it
  int unit_ = -1;                            // its unit there (-1: none, it has no parameters of its own)
  bool attached_ = false;
};
TORCH_MODULE(Unit);

class FullyShardedDataParallel {
 public:
  // Collective. Throws tandem::Error (see above). A Sequential with no fsdp::Unit in it: every child with parameters
  // is a unit; else the Units (and the root's other parameters) are.
  FullyShardedDataParallel(torch::nn::Sequential model, std::shared_ptr<comm::ProcessGroup> group,
                           FsdpOptions options = {});
  // Any module: its fsdp::Units and the root's other parameters are the units (one unit when it has no Unit).
  template <typename M>
  FullyShardedDataParallel(std::shared_ptr<M> model, std::shared_ptr<comm::ProcessGroup> group,
                           FsdpOptions options = {})
      : FullyShardedDataParallel(std::static_pointer_cast<torch::nn::Module>(model), detail::one_tensor_forward(model),
                                 std::move(group), options) {}
  template <typename M>
  FullyShardedDataParallel(torch::nn::ModuleHolder<M> model, std::shared_ptr<comm::ProcessGroup> group,
                           FsdpOptions options = {})
      : FullyShardedDataParallel(model.ptr(), std::move(group), options) {}
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Collective: every rank calls it with its own rows.
  at::Tensor forward(const at::Tensor& input);
  // The model's forward of other arguments (the model's type M, returning a tensor). Collective.
  template <typename M, typename... Args>
  at::Tensor forward_as(Args&&... args) {
    M* module = detail::module_as<M>(*root_module());
    detail::ForwardScope scope(model_state(), detail::ForwardScope::kRoot, true);
    return scope.output(module->forward(scope.input(std::forward<Args>(args))...));
  }
  // This rank's shard of each unit (leaf tensors, one per unit with parameters): give them to the optimizer.
  std::vector<at::Tensor> parameters() const;
  void set_requires_gradient_sync(bool sync);

  // Collective: every parameter of the model, gathered, under its name in the model ("0.weight", "encoder.0.weight"),
  // in the model's order.
  std::vector<std::pair<std::string, at::Tensor>> full_parameters() const;

  // State dicts (checkpoint/checkpoint.h saves either form through checkpoint::State::add).
  using StateDict = std::vector<std::pair<std::string, at::Tensor>>;
  // The full state: every parameter (gathered) and buffer under its name in the model, in its order: what the plain
  // model of the same architecture (without Units) holds. Collective (every rank gathers every unit).
  StateDict full_state_dict() const;
  // The model's buffers (not sharded: every rank holds them), by name. Not collective.
  StateDict named_buffers() const;
  // Loads a full state dict (from full_state_dict(), the plain model's named parameters and buffers, or
  // consolidate()): each rank takes its shard of each parameter. Not collective; every rank is given the same dict.
  // INVALID_ARGUMENT naming the entry when one is missing, unknown, or of another shape or dtype.
  void load_full_state_dict(const StateDict& dict);

  // This rank's part of each parameter, as PyTorch's sharded state dict keeps a local shard with its offset: the
  // elements [offset, offset + numel) of the flattened parameter. Self-describing: consolidate() puts the ranks' dicts
  // back together without a group, for any number of ranks.
  struct Piece {
    std::string name;
    std::vector<int64_t> shape;  // the whole parameter's
    int64_t offset = 0;          // into the flattened parameter
    at::Tensor values;           // 1-D, possibly empty
  };
  struct ShardedStateDict {
    int64_t world_size = 0;
    int64_t rank = 0;
    std::vector<Piece> pieces;  // every parameter, in order
    StateDict buffers;          // the same on every rank
  };
  // Not collective: copies of this rank's shards, nothing gathered.
  ShardedStateDict sharded_state_dict() const;
  // Loads this rank's own part of a sharded state dict saved by a job of the same world size (FAILED_PRECONDITION
  // otherwise: consolidate() the ranks' dicts and load_full_state_dict() instead); INVALID_ARGUMENT when a piece does
  // not match this model's. Not collective.
  void load_sharded_state_dict(const ShardedStateDict& dict);
  // The optimizer's state for this model's shards, gathered (PyTorch's full_optim_state_dict): for every parameter
  // and every state tensor of it, "<name>.<field>" ("0.weight.exp_avg") shaped as the parameter, and "<name>.step".
  // A job of any world size loads it. `optimizer` must have been given parameters() (other tensors are ignored).
  // Adam, AdamW and SGD; others: UNIMPLEMENTED. Collective; FAILED_PRECONDITION when the ranks' optimizers differ in
  // which shards have state.
  StateDict full_optimizer_state_dict(const torch::optim::Optimizer& optimizer) const;
  // Loads such a dict: each rank takes its shard of each state tensor. Not collective. INVALID_ARGUMENT naming the
  // entry when one is missing or misshapen, or when the dict is of another optimizer's kind.
  void load_full_optimizer_state_dict(torch::optim::Optimizer& optimizer, const StateDict& dict);

  // The full state dict of every rank's sharded one (each rank's, in any order). INVALID_ARGUMENT when they do not
  // cover every parameter exactly (a rank missing, dicts of different jobs).
  static StateDict consolidate(const std::vector<ShardedStateDict>& ranks);

  struct Stats {
    int64_t units = 0;
    int64_t shard_elements = 0;  // this rank's, every unit's shard (padding included)
    int64_t largest_unit_elements = 0;
    int64_t peak_gathered_elements = 0;  // most parameter elements gathered at once so far
    // Fresh mappings the process's buffer pool (gathered parameters, gradients being reduced) has made so far, every
    // model's: a step that takes the same buffers as the one before makes none.
    int64_t buffers_mapped = 0;
    // The most bytes of those buffers in use at once so far, process-wide.
    int64_t buffer_bytes_peak = 0;
    // Backwards of Linear units that wrote their gradients into the unit's gathered buffer, over its parameters, and
    // were reduced from there (fully sharded, synchronising, reduced in the dtype computed in): no gradient of the
    // weight's size allocated, none copied.
    int64_t gradients_into_buffers = 0;
  };
  Stats stats() const;

  using State = detail::ModelState;

 private:
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model, detail::Forward forward,
                           std::shared_ptr<comm::ProcessGroup> group, FsdpOptions options);
  std::weak_ptr<detail::ModelState> model_state() const { return state_; }
  const std::shared_ptr<torch::nn::Module>& root_module() const;
  std::shared_ptr<State> state_;
};

}  // namespace tandem::fsdp
