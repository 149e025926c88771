// The Reducer (ddp/detail/reducer.h).
#include "tandem/ddp/detail/reducer.h"

#include <ATen/ATen.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <map>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/log/log.h"
#include "tandem/profile/profile.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rpc.h"

namespace tandem::ddp::detail {

std::string Reducer::where() const {
  return absl::StrCat("rank ", group->rank(), " of process group '", group->name(), "'");
}

void Reducer::collect() {
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (!t.requires_grad()) continue;
    if (t.is_sparse() || !t.is_contiguous())
      fail(absl::StatusCode::kInvalidArgument, "parameter '" + item.key() + "' is sparse or not contiguous");
    params.push_back(Param{item.key(), t, torch::autograd::impl::grad_accumulator(t)});
  }
  for (const auto& b : module->named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) buffers.push_back(b.value());
  }
  ready.assign(params.size(), 0);
  locally_used.assign(params.size(), 0);
}

absl::Status same_on_every_rank(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                                const std::string& what) {
  int64_t numel = 0;
  uint64_t digest = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { digest = (digest ^ v) * 1099511628211ull; };
  for (const auto& t : tensors) {
    numel += t.numel();
    mix(static_cast<uint64_t>(t.scalar_type()));
    for (int64_t d : t.sizes()) mix(static_cast<uint64_t>(d));
  }
  auto mine = at::tensor({static_cast<int64_t>(tensors.size()), numel, static_cast<int64_t>(digest >> 1)}, at::kLong);
  auto all = at::empty({3 * group.size()}, at::kLong);
  comm::wait(group.allgather(all, mine));
  auto a = all.accessor<int64_t, 1>();
  for (int r = 1; r < group.size(); ++r) {
    if (a[3 * r] != a[0] || a[3 * r + 1] != a[1] || a[3 * r + 2] != a[2]) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " of process group '", group.name(), "' holds ", a[3 * r], " parameters with ",
                       a[3 * r + 1], " elements where rank 0 holds ", a[0], " with ", a[1],
                       a[3 * r] == a[0] && a[3 * r + 1] == a[1] ? " (shapes or dtypes differ)" : "", ": ", what));
    }
  }
  return absl::OkStatus();
}

void Reducer::verify_same_parameters() {
  std::vector<at::Tensor> tensors;
  for (const auto& p : params) tensors.push_back(p.tensor);
  if (absl::Status s = same_on_every_rank(*group, tensors, "every rank must wrap the same model"); !s.ok())
    fail(s.code(), std::string(s.message()));
}

void Reducer::broadcast_from(int root, bool with_params) {
  std::vector<rpc::Future> works;
  if (with_params) {
    for (const auto& p : params) works.push_back(group->broadcast(p.tensor, root));
  }
  for (const auto& b : buffers) works.push_back(group->broadcast(b, root));
  for (const auto& w : works) comm::wait(w);
}

void Reducer::install_hooks() {
  std::weak_ptr<Reducer> self = weak_from_this();
  struct ReadyHook : torch::autograd::FunctionPostHook {
    ReadyHook(std::weak_ptr<Reducer> impl, size_t index) : impl(std::move(impl)), index(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      if (auto s = impl.lock()) s->mark_ready(index);
      return outputs;
    }
    std::weak_ptr<Reducer> impl;
    size_t index;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].accumulator->add_post_hook(std::make_unique<ReadyHook>(self, i));
  }
}

void Reducer::assign_buckets(const std::vector<size_t>& order) {
  std::vector<at::Tensor> old_grads;  // gradients keep their values across a rebuild
  for (const auto& p : params) old_grads.push_back(p.tensor.grad());
  // Built aside and swapped in once every bucket has its memory: a failing group leaves the old buckets whole.
  std::vector<Bucket> fresh;
  std::map<at::ScalarType, size_t> open, opened;  // dtype -> open bucket; dtype -> buckets opened
  std::vector<size_t> bytes;
  for (size_t i : order) {
    const at::ScalarType dtype = params[i].tensor.scalar_type();
    auto it = open.find(dtype);
    if (it == open.end()) {
      it = open.emplace(dtype, fresh.size()).first;
      fresh.emplace_back();
      bytes.push_back(0);
      ++opened[dtype];
    }
    const size_t b = it->second;
    fresh[b].params.push_back(i);
    bytes[b] += params[i].tensor.nbytes();
    const size_t limit = opened[dtype] == 1 ? options.first_bucket_bytes : options.bucket_cap_bytes;
    if (bytes[b] >= limit) open.erase(it);
  }
  for (Bucket& bucket : fresh) {
    int64_t n = 0;
    for (size_t i : bucket.params) n += params[i].tensor.numel();
    // float and double buckets in memory every rank maps when the group runs over shared memory: the allreduce then
    // reads the others' buckets where they are and writes the averages into them (no copies into and out of the
    // group's segment). Other dtypes keep dividing each gradient first (a half sum could overflow before dividing).
    const at::TensorOptions like = params[bucket.params.front()].tensor.options().requires_grad(false);
    const at::ScalarType dtype = like.dtype().toScalarType();
    if (options.shared_buckets && (dtype == at::kFloat || dtype == at::kDouble)) {
      bucket.flat = group->shared_tensor(n, dtype);
    }
    bucket.shared = bucket.flat.defined();
    if (!bucket.shared) bucket.flat = at::zeros({n}, like);
    bucket.pending = bucket.params.size();
  }
  buckets.swap(fresh);
  for (size_t b = 0; b < buckets.size(); ++b) {
    size_t offset = 0;
    for (size_t i : buckets[b].params) {
      params[i].bucket = b;
      params[i].offset = offset;
      offset += static_cast<size_t>(params[i].tensor.numel());
    }
  }
  if (options.gradient_as_bucket_view) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!old_grads[i].defined()) continue;
      at::Tensor view = bucket_view(i);
      view.copy_(old_grads[i]);
      params[i].tensor.mutable_grad() = view;
    }
  }
}

at::Tensor Reducer::slice(size_t i) const {
  const Param& p = params[i];
  return buckets[p.bucket].flat.narrow(0, static_cast<int64_t>(p.offset), p.tensor.numel());
}

at::Tensor Reducer::bucket_view(size_t i) const {
  const Param& p = params[i];
  const at::Tensor& flat = buckets[p.bucket].flat;
  at::NoGradGuard no_grad;
  at::Tensor v = at::empty({0}, flat.options());
  v.set_(flat.storage(), flat.storage_offset() + static_cast<int64_t>(p.offset), p.tensor.sizes(),
         c10::contiguous_strides(p.tensor.sizes()));
  return v;
}

std::pair<int64_t, bool> Reducer::agree(bool active, bool sync) {
  auto t = at::tensor({active ? static_cast<int64_t>(group->rank()) : int64_t{-1}, int64_t{active && sync}}, at::kLong);
  comm::wait(group->allreduce(t, comm::ReduceOp::kMax));
  const int64_t highest = t[0].item<int64_t>();
  if (highest >= 0) last_active = highest;
  return {highest, t[1].item<int64_t>() != 0};
}

void Reducer::rebuild() {
  rebuild_pending = false;
  std::vector<char> seen(params.size(), 0);
  std::vector<int64_t> order;
  for (size_t i : ready_order) {
    if (!seen[i]) order.push_back(static_cast<int64_t>(i)), seen[i] = 1;
  }
  for (size_t i = params.size(); i-- > 0;) {
    if (!seen[i]) order.push_back(static_cast<int64_t>(i));
  }
  auto t = at::tensor(order, at::kLong);
  comm::wait(group->broadcast(t, 0));
  std::vector<size_t> agreed(params.size());
  for (size_t k = 0; k < agreed.size(); ++k) agreed[k] = static_cast<size_t>(t[k].item<int64_t>());
  assign_buckets(agreed);
  rebuilt = true;
}

void Reducer::pre_forward() {
  {
    // First: a late tap of an unfinished iteration (its backward failed elsewhere) must not launch a bucket while this
    // rank's agreement or broadcast below runs (the ranks' collectives would be issued in different orders).
    MutexLock lock(&tap_mu);
    end_unfinished();
  }
  if (options.uneven_inputs) agree(true, require_sync && at::GradMode::is_enabled());
  if (options.broadcast_buffers && !buffers.empty()) broadcast_from(0, /*with_params=*/false);
  if (rebuild_pending) rebuild();
}

void Reducer::post_forward(const std::vector<at::Tensor>& outputs) {
  // Held throughout: a tap of a backward that failed elsewhere, still running here, is not mixed with the new state.
  MutexLock lock(&tap_mu);
  end_unfinished();  // a backward that did not reduce left state behind, and perhaps reductions running
  const int64_t external_id = external_backward_id();
  const bool external = external_id >= 0;
  if (!at::GradMode::is_enabled()) return;
  if (!require_sync) {
    window_accumulates_externally |= external;
    return;
  }
  reset_iteration();
  armed = true;
  const bool tap = external && !window_accumulates_externally;
  if (tap) tap_backward = external_id;
  if (!tap && !options.find_unused_parameters) return;
  const std::vector<char> reached = walk_graph(outputs, tap);
  if (!options.find_unused_parameters) return;
  // Parameters whose accumulators the graph does not reach get no gradient in this backward: ready now.
  for (size_t i = 0; i < params.size(); ++i) {
    if (reached[i]) continue;
    if (tapping) {
      slice(i).zero_();  // the external backward gives it nothing here: zero from this rank
    } else {
      const at::Tensor& g = params[i].tensor.grad();
      if (options.gradient_as_bucket_view && g.defined()) untouched.emplace_back(i, g.clone());
      land(i);  // its current .grad (zero after zero_grad, or what no_sync accumulated), as PyTorch does
    }
    set_ready(i);
  }
}

std::vector<char> Reducer::walk_graph(const std::vector<at::Tensor>& outputs, bool tap) {
  std::unordered_map<const torch::autograd::Node*, size_t> param_of;
  for (size_t i = 0; i < params.size(); ++i) param_of.emplace(params[i].accumulator.get(), i);
  std::vector<char> reached(params.size(), 0);
  std::vector<std::shared_ptr<torch::autograd::Node>> taps(params.size());
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined()) continue;
    if (out.grad_fn()) {
      stack.push_back(out.grad_fn().get());
    } else if (out.requires_grad()) {  // an output that is a leaf: its accumulator is reached directly
      auto it = param_of.find(torch::autograd::impl::grad_accumulator(out).get());
      if (it != param_of.end()) reached[it->second] = 1;
    }
  }
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    for (auto& e : n->next_edges()) {  // rewritten in place: a new edge would re-check the node's parents
      if (!e.function) continue;
      auto it = param_of.find(e.function.get());
      if (it == param_of.end()) {
        stack.push_back(e.function.get());
        continue;
      }
      reached[it->second] = 1;
      if (!tap) continue;
      auto& t = taps[it->second];
      if (!t) {
        const Param& p = params[it->second];
        t = std::make_shared<GradTap>(weak_from_this(), it->second, tap_backward);
        t->add_input_metadata(p.tensor);
        t->add_next_edge(torch::autograd::Edge(p.accumulator, 0));
      }
      e = torch::autograd::Edge(t, 0);
    }
  }
  tapping = tap;
  return reached;
}

void Reducer::set_ready(size_t i) {
  ready[i] = 1;
  --buckets[params[i].bucket].pending;
}

void Reducer::gradient_landed(size_t i) {
  set_ready(i);
  locally_used[i] = 1;
  if (record_order) ready_order.push_back(i);
  launch_ready();
}

void Reducer::tapped(size_t i, const at::Tensor& grad) {
  if (!armed || !tapping) return;  // a backward the reducer was not armed for
  if (ready[i]) {
    fail(absl::StatusCode::kFailedPrecondition, "parameter '" + params[i].name +
                                                    "' got a gradient twice in one distributed backward (several "
                                                    "gradient messages reaching it?)");
  }
  at::Tensor s = slice(i);
  if (grad.defined()) {
    copy_scaled(i, s, grad);
  } else {
    s.zero_();
  }
  gradient_landed(i);
}

void Reducer::reset_iteration() {
  callback_queued = false;
  next_launch = 0;
  std::fill(ready.begin(), ready.end(), 0);
  untouched.clear();
  for (auto& b : buckets) {
    b.pending = b.params.size();
    b.work = rpc::Future();
  }
}

void Reducer::mark_ready(size_t i) {
  locally_used[i] = 1;
  if (!armed) return;  // no_sync, or a backward through a forward DDP did not see: .grad accumulates locally
  Param& p = params[i];
  if (ready[i]) {
    fail(absl::StatusCode::kFailedPrecondition,
         "parameter '" + p.name + "' got a gradient twice in one backward (reentrant backward or checkpointing?)");
  }
  if (!callback_queued) {
    callback_queued = true;
    std::weak_ptr<Reducer> self = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([self] {
      if (auto s = self.lock()) s->finalize();
    });
  }
  land(i);
  gradient_landed(i);
}

void Reducer::land(size_t i) {
  Param& p = params[i];
  at::Tensor s = slice(i);
  const at::Tensor& g = p.tensor.grad();
  if (!g.defined()) {
    s.zero_();
  } else if (!options.gradient_as_bucket_view || g.data_ptr() != s.data_ptr()) {
    copy_scaled(i, s, g);
    // .grad was replaced (first backward, or set by the user): share the bucket again
    if (options.gradient_as_bucket_view) p.tensor.mutable_grad() = bucket_view(i);
  } else if (!hook && !reduce_averages(buckets[p.bucket])) {
    s.div_(group->size());
  }
}

void Reducer::copy_scaled(size_t i, at::Tensor& slice, const at::Tensor& grad) const {
  if (hook || reduce_averages(buckets[params[i].bucket])) {
    slice.copy_(grad.reshape({-1}));
  } else {
    at::div_out(slice, grad.reshape({-1}), at::scalar_tensor(group->size(), slice.options()));
  }
}

rpc::Future Reducer::reduce(size_t index) {
  const Bucket& b = buckets[index];
  try {
    if (hook) {
      rpc::Future f = hook(*group, b.flat);
      if (f.deadline() != absl::InfiniteFuture()) return f;  // the group's, or one the hook bounded itself
      // A future the hook made itself has no deadline: it gets RPC's timeout (the group's default) or the wait of a
      // future without one (5 minutes), whichever is longer (a group may allow more than RPC's timeout, and a wait cut
      // short would leave the hook's work writing into a bucket the next iteration fills); a wait that runs out names
      // the hook, the bucket and this rank (it named nothing).
      const auto bound = std::max(rpc::default_timeout(), std::chrono::milliseconds(rpc::Future::kDefaultWait));
      rpc::Future bounded(absl::Now() + absl::FromChrono(bound),
                          absl::StrCat("the communication hook's future for bucket ", index, " (", b.flat.nbytes(),
                                       " bytes) on ", where()));
      f.add_callback([bounded](const rpc::Future& done) { bounded.set_status(done.status()); });
      return bounded;
    }
    return group->allreduce(b.flat, reduce_averages(b) ? comm::ReduceOp::kAvg : comm::ReduceOp::kSum);
  } catch (const std::exception& e) {
    // The error names the reduction (the user's hook or the group's allreduce), the bucket and this rank; a hook's
    // own error keeps its code (a plain exception's is INTERNAL).
    const absl::Status cause = status_from_exception(e);
    return rpc::Future::failed(absl::Status(
        hook && cause.code() == absl::StatusCode::kUnknown ? absl::StatusCode::kInternal : cause.code(),
        absl::StrCat(hook ? "the communication hook threw" : "the allreduce could not start", " for bucket ", index,
                     " (", b.flat.nbytes(), " bytes) on ", where(), ": ", cause.message())));
  }
}

void Reducer::launch_ready() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
    const size_t index = next_launch;
    Bucket& b = buckets[next_launch++];
    const auto launched = std::chrono::steady_clock::now();
    b.work = reduce(index);
    if (profile::active()) {
      b.work.add_callback([index, launched, bytes = b.flat.nbytes()](const rpc::Future&) {
        if (profile::active()) {
          profile::report_steady(absl::StrCat("ddp:bucket#", index, "(", bytes, " bytes)"), launched,
                                 std::chrono::steady_clock::now());
        }
      });
    }
  }
}

void Reducer::settle_launched() {
  // Their outcome is not the error being reported (the iteration's, thrown after this, or the group's, which its
  // later calls report): the first failure is logged, so that a communication hook's own error is not lost.
  bool said = false;
  for (size_t b = 0; b < next_launch; ++b) {
    const absl::Status s = buckets[b].work.status();
    if (!s.ok() && !said) {
      TANDEM_LOG(kWarn, "ddp") << "bucket " << b << "'s reduction, left behind by an iteration that did not end, "
                               << "failed: " << s.message();
      said = true;
    }
  }
}

void Reducer::end_unfinished() {
  armed = false;
  tapping = false;
  tap_backward = -1;
  settle_launched();
}

void Reducer::finalize() {
  armed = false;
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!ready[i]) missing.push_back(params[i].name);
  }
  if (!missing.empty()) {
    settle_launched();
    std::fill(locally_used.begin(), locally_used.end(), 0);
    fail_missing(std::move(missing), "this backward");
  }
  launch_ready();
  at::Tensor used = wait_all();
  for (const auto& [i, grad] : untouched) {
    if (!used_anywhere(used, i)) params[i].tensor.mutable_grad().copy_(grad);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!used_anywhere(used, i)) continue;
    at::Tensor& grad = params[i].tensor.mutable_grad();
    at::Tensor view = slice(i).view(params[i].tensor.sizes());
    if (options.gradient_as_bucket_view) {
      if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = bucket_view(i);
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
  ++iterations;
  finish_iteration();
}

void Reducer::finish_iteration() {
  if (record_order) {
    record_order = false;
    rebuild_pending = options.rebuild_buckets;
  }
  reset_iteration();
  std::fill(locally_used.begin(), locally_used.end(), 0);
  tapping = window_accumulates_externally = false;
}

void Reducer::unshare_gradients() {
  if (!options.gradient_as_bucket_view) return;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& g = params[i].tensor.mutable_grad();
    if (g.defined() && g.data_ptr() == slice(i).data_ptr()) g = g.clone();
  }
}

void Reducer::reduce_external(const GradientOf& grad_of, const SetAverage& set_average, const std::string& what) {
  MutexLock lock(&tap_mu);  // after every tap of the backward (a late one waits, then finds the reducer disarmed)
  if (armed && tapping) {   // buckets launched as the backward computed their gradients
    armed = false;
    std::vector<std::string> missing;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!ready[i]) missing.push_back(params[i].name);
    }
    if (!missing.empty() && !options.find_unused_parameters) {
      settle_launched();
      std::fill(locally_used.begin(), locally_used.end(), 0);
      tapping = window_accumulates_externally = false;
      fail_missing(std::move(missing), what);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (ready[i]) continue;  // reached by the graph, but this backward gave it no gradient
      slice(i).zero_();
      set_ready(i);
    }
    launch_ready();
    write_averages(wait_all(), set_average);
    return;
  }
  // Not tapped (the forward ran outside a context, or the window accumulated under no_sync): the whole reduction
  // now, from the gradients the backward left; the context holds every micro-step's.
  reset_iteration();
  armed = false;
  unshare_gradients();
  std::vector<at::Tensor> grads(params.size());
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    grads[i] = grad_of(params[i].tensor);
    if (!grads[i].defined()) missing.push_back(params[i].name);
  }
  if (!missing.empty() && !options.find_unused_parameters) {
    std::fill(locally_used.begin(), locally_used.end(), 0);
    tapping = window_accumulates_externally = false;
    fail_missing(std::move(missing), what);
  }
  for (size_t i = 0; i < params.size(); ++i) locally_used[i] = locally_used[i] || grads[i].defined();
  for (size_t k = 0; k < buckets.size(); ++k) {
    Bucket& b = buckets[k];
    for (size_t i : b.params) {
      at::Tensor s = slice(i);
      if (grads[i].defined()) {
        copy_scaled(i, s, grads[i]);
      } else {
        s.zero_();
      }
    }
    b.work = reduce(k);
  }
  write_averages(wait_all(), set_average);
}

void Reducer::write_averages(const at::Tensor& used, const SetAverage& set_average) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!used_anywhere(used, i)) continue;
    set_average(params[i].tensor, slice(i).view(params[i].tensor.sizes()).clone());
  }
  ++iterations;
  finish_iteration();
}

void Reducer::fail_missing(std::vector<std::string> missing, const std::string& in) const {
  const size_t n = missing.size();
  if (n > 5) missing.resize(5);
  fail(absl::StatusCode::kFailedPrecondition,
       absl::StrCat(where(), ": ", n, " parameter(s) got no gradient in ", in, " (", absl::StrJoin(missing, ", "),
                    n > 5 ? ", ..." : "",
                    "); construct with find_unused_parameters = true when a forward does not "
                    "use every parameter"));
}

bool Reducer::used_anywhere(const at::Tensor& used, size_t i) {
  return !used.defined() || used.data_ptr<int32_t>()[i] != 0;
}

at::Tensor Reducer::wait_all() {
  at::Tensor used;
  rpc::Future used_work;
  if (options.find_unused_parameters) {
    used = at::tensor(std::vector<int32_t>(locally_used.begin(), locally_used.end()), at::kInt);
    used_work = group->allreduce(used, comm::ReduceOp::kMax);
  }
  // Every launched operation is waited for before an error is thrown: one still running after the throw would write
  // into a bucket the next iteration fills.
  absl::Status first;
  for (auto& b : buckets) {
    if (absl::Status s = b.work.status(); first.ok()) first = s;
  }
  if (used.defined()) {
    if (absl::Status s = used_work.status(); first.ok()) first = s;
  }
  throw_if_error(first);
  return used;
}

void Reducer::join() {
  if (!options.uneven_inputs) {
    fail(absl::StatusCode::kFailedPrecondition, "join() needs DdpOptions::uneven_inputs on every rank");
  }
  {
    MutexLock lock(&tap_mu);
    end_unfinished();
  }
  // A joined rank's unfinished accumulation window is dropped: it shadows with zero gradients and uses nothing.
  std::fill(locally_used.begin(), locally_used.end(), 0);
  for (;;) {
    const auto [highest, sync] = agree(false, false);
    if (highest < 0) break;
    if (options.broadcast_buffers && !buffers.empty()) broadcast_from(0, false);
    if (rebuild_pending) rebuild();
    if (!sync) continue;
    // Shadow the others' backward: the same buckets, in the same order, with zero gradients.
    unshare_gradients();
    for (size_t i = 0; i < buckets.size(); ++i) {
      buckets[i].flat.zero_();
      buckets[i].work = reduce(i);
    }
    wait_all();
    finish_iteration();
  }
  // Everyone is out of data: the last rank that trained holds the final model.
  if (last_active >= 0) {
    at::NoGradGuard no_grad;
    broadcast_from(static_cast<int>(last_active), /*with_params=*/true);
  }
  last_active = -1;
}

}  // namespace tandem::ddp::detail
