// DDP scenarios every rank runs. The equivalence scenarios train a DDP model on W ranks with batch b each and, in the
// same process, a reference model on one process with batch W·b (same initial parameters: rank 0's; same data), and
// compare the parameters after every run.
#include "tests/ddp/scenarios.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/ddp/zero.h"
#include "tandem/ddp_dist_autograd/ddp_dist_autograd.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/dist_optim/dist_optim.h"
#include "tandem/nn/remote_module.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rref/rref.h"
#include "tandem/sync/sync.h"
#include "tests/common/multiproc.h"
#include "tests/common/scenario.h"
#include "tests/common/test_env.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

constexpr int64_t kBatch = 4, kIn = 8, kHidden = 16, kOut = 4;

struct Net : torch::nn::Module {
  Net(bool with_side, bool with_unused, int64_t hidden = kHidden) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, kOut));
    if (with_side) side = register_module("side", torch::nn::Linear(hidden, kOut));
    if (with_unused) unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  at::Tensor forward(const at::Tensor& x, bool use_side = false) {
    auto h = torch::tanh(fc1(x));
    auto y = fc2(h);
    if (use_side) y = y + side(h);
    return y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, side{nullptr}, unused{nullptr};
};

// The whole batch of one (micro-)step: W·b rows; rank r trains on rows [r·b, (r+1)·b).
std::pair<at::Tensor, at::Tensor> data(int64_t step, int world) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  return {at::randn({world * kBatch, kIn}, gen), at::randn({world * kBatch, kOut}, gen)};
}
at::Tensor rows(const at::Tensor& t, int rank) { return t.narrow(0, rank * kBatch, kBatch); }

double max_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  double d = 0;
  for (size_t i = 0; i < pa.size(); ++i) d = std::max(d, (pa[i] - pb[i]).abs().max().item<double>());
  return d;
}

// Variants: "plain", "copy" (gradient_as_bucket_view off), "default_buckets", "no_sync", "unused", "fp16", "bf16",
// "uneven", "zero".
std::string equivalence(const std::string& variant) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  const bool side = variant == "unused";
  ddp::DdpOptions options;
  if (variant != "default_buckets") {
    options.first_bucket_bytes = 256;  // several buckets, so order, launch and rebuild matter
    options.bucket_cap_bytes = 512;
  }
  options.gradient_as_bucket_view = variant != "copy";
  options.find_unused_parameters = side;
  options.uneven_inputs = variant == "uneven";
  const int micro = variant == "no_sync" ? 3 : 1;
  const double tolerance = variant == "fp16" ? 5e-3 : variant == "bf16" ? 5e-2 : 1e-5;

  torch::manual_seed(100 + rank);  // different on every rank: construction must broadcast rank 0's
  auto model = std::make_shared<Net>(side, side);
  torch::manual_seed(100);
  auto ref = std::make_shared<Net>(side, side);

  auto pg = comm::ProcessGroup::create("ddp_" + variant);
  // The default choice: the shared-memory path (issue 15) when every rank is on this host, Gloo across the test hosts
  // (tests/hosts/run.sh): these tests cover both.
  const std::string expected = test_hosts().count > 0 ? "gloo" : "shared_memory";
  if (pg->transport() != expected) return std::string("the group runs on ") + pg->transport() + ", not on " + expected;
  ddp::DistributedDataParallel<Net> ddp(model, pg, options);
  if (variant == "fp16") ddp.register_comm_hook(ddp::fp16_compress_hook());
  if (variant == "bf16") ddp.register_comm_hook(ddp::bf16_compress_hook());
  if (max_diff(*model, *ref) != 0) return "construction did not give every rank rank 0's parameters";

  std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;
  std::optional<ddp::ZeroRedundancyOptimizer> zero;
  if (variant == "zero") {
    zero.emplace(model->parameters(), pg, [](std::vector<at::Tensor> shard) {
      return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.01));
    });
    if (zero->shard().empty() || zero->shard().size() == model->parameters().size()) return "ZeRO did not shard";
    ref_opt = std::make_unique<torch::optim::Adam>(ref->parameters(), torch::optim::AdamOptions(0.01));
  } else {
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ref_opt = std::make_unique<torch::optim::SGD>(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  }

  // Uneven inputs: rank r has 3 + r steps; gradients are averaged over the whole group (joined ranks add zeros).
  const int mine = variant == "uneven" ? 3 + rank : 5;
  const int steps = variant == "uneven" ? 3 + world - 1 : 5;
  for (int step = 0; step < steps; ++step) {
    const bool use_side = side && step % 2 == 0;  // the side branch is used on even steps only
    if (step < mine) {
      zero ? zero->zero_grad() : opt->zero_grad();
      for (int k = 0; k < micro; ++k) {
        auto [x, y] = data(step * micro + k, world);
        std::optional<ddp::DistributedDataParallelBase::NoSync> no_sync;
        if (k + 1 < micro) no_sync.emplace(ddp);
        torch::mse_loss(ddp.forward(rows(x, rank), use_side), rows(y, rank)).backward();
      }
      if (zero) zero->step();
      else opt->step();
    }
    ref_opt->zero_grad();
    for (int k = 0; k < micro; ++k) {
      auto [x, y] = data(step * micro + k, world);
      at::Tensor loss;
      if (variant == "uneven") {
        loss = at::zeros({});
        for (int r = 0; r < world; ++r) {
          if (step < 3 + r) loss = loss + torch::mse_loss(ref->forward(rows(x, r)), rows(y, r)) / world;
        }
      } else {
        loss = torch::mse_loss(ref->forward(x, use_side), y);
      }
      loss.backward();
    }
    ref_opt->step();
  }
  if (variant == "uneven") ddp.join();
  const double d = max_diff(*model, *ref);
  if (!(d <= tolerance))
    return absl::StrCat(variant, ": parameters differ from one process by ", d, " (tolerance ", tolerance, ")");
  if (variant == "unused" && model->unused->weight.grad().defined()) return "a parameter no rank used got a gradient";
  if (variant == "plain") {
    auto g = model->fc1->weight.grad();  // shares its bucket with fc1.bias: the storage is larger than the gradient
    if (g.storage().nbytes() <= g.nbytes()) return "with gradient_as_bucket_view, .grad is not a view into a bucket";
  }
  if (variant == "plain" && (!ddp.stats().rebuilt || ddp.stats().bucket_bytes.size() < 2))
    return "buckets were not rebuilt";
  return "";
}

// ---- Accumulation windows (no_sync) with branches used by some ranks only ----
//
// A window is an optimizer step: micro-steps under no_sync, then one synchronised micro-step. Each micro-step says, for
// every rank, which branches its forward uses (a bit mask). The reference is one process whose micro-step loss is the
// mean over the ranks' losses (the whole batch), accumulating over the window; with uneven inputs, a rank out of data
// adds nothing (its share stays divided by the world size, as join() averages).

constexpr int kBranches = 4;

struct BranchNet : torch::nn::Module {
  BranchNet() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
    for (int j = 0; j < kBranches; ++j)
      branch.push_back(register_module("branch" + std::to_string(j), torch::nn::Linear(kHidden, kOut)));
  }
  at::Tensor forward(const at::Tensor& x, uint32_t mask) {
    auto h = torch::tanh(fc1(x));
    auto y = fc2(h);
    for (int j = 0; j < kBranches; ++j) {
      if (mask >> j & 1) y = y + branch[j](h);
    }
    return y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  std::vector<torch::nn::Linear> branch;
};

struct Window {
  std::vector<std::vector<uint32_t>> masks;  // [micro-step][rank]; the last micro-step is the synchronised one
  std::vector<char> active;                  // [rank]: whether the rank still has data (uneven inputs)
};

// Random windows: branch 0 used by random ranks in random micro-steps, branch 1 likewise but only under no_sync,
// branch 2 only ever by one rank, branch 3 never. A window where no rank uses a branch happens by chance.
std::vector<Window> random_windows(uint32_t seed, int world, bool uneven) {
  std::mt19937 gen(seed);
  auto coin = [&] { return gen() % 2 == 0; };
  const int lonely = static_cast<int>(seed % world);
  const int count = uneven ? 2 + world : 4;
  std::vector<Window> windows(count);
  for (int w = 0; w < count; ++w) {
    const int micro = 1 + static_cast<int>(gen() % 3);
    windows[w].masks.assign(micro, std::vector<uint32_t>(world, 0));
    for (int k = 0; k < micro; ++k) {
      for (int r = 0; r < world; ++r) {
        uint32_t& m = windows[w].masks[k][r];
        if (coin()) m |= 1u << 0;
        if (k + 1 < micro && coin()) m |= 1u << 1;
        if (r == lonely && coin()) m |= 1u << 2;
      }
    }
    windows[w].active.assign(world, 1);
    // Uneven inputs: rank r has data for count - (world - 1 - r) windows.
    for (int r = 0; r < world; ++r) windows[w].active[r] = !uneven || w < count - (world - 1 - r);
  }
  return windows;
}

// The case of pytorch#69031: rank 0 uses branch 0 in a no_sync micro-step, no rank uses it in the synchronised one.
std::vector<Window> branch_only_under_no_sync(int world) {
  Window w;
  w.masks = {std::vector<uint32_t>(world, 0), std::vector<uint32_t>(world, 0)};
  w.masks[0][0] = 1;
  w.active.assign(world, 1);
  return {w, w};
}

struct Snapshot {
  std::vector<at::Tensor> params,
      grads;  // after each window's optimizer step (grads: before it); grads may be undefined
};

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.defined() ? t.detach().clone() : at::Tensor());
  return out;
}
std::vector<at::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad());
  return out;
}

// Differences between two lists of tensors (undefined must match undefined), or "" when all are within `tolerance`.
std::string compare(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double tolerance,
                    const std::vector<std::string>& names) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) {
      return absl::StrCat(names[i], " is ", a[i].defined() ? "defined" : "undefined", " where the other is not");
    }
    if (!a[i].defined()) continue;
    const double d = (a[i] - b[i]).abs().max().item<double>();
    if (!(d <= tolerance)) return absl::StrCat(names[i], " differs by ", d);
  }
  return "";
}

// One process with the whole batch. Hybrid: the remote tanh is local here, and gradients start undefined in every
// window (a distributed autograd context has none of a parameter no rank used; the optimizer then skips it).
std::vector<Snapshot> train_reference(const std::vector<Window>& windows, int world, bool hybrid) {
  torch::manual_seed(100);
  BranchNet ref;
  torch::optim::SGD opt(ref.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<Snapshot> out;
  int64_t step = 0;
  for (const Window& w : windows) {
    if (hybrid) {
      for (auto& p : ref.parameters()) p.mutable_grad() = at::Tensor();
    } else {
      opt.zero_grad();
    }
    for (const auto& masks : w.masks) {
      auto [x, y] = data(step++, world);
      at::Tensor loss = at::zeros({});
      for (int r = 0; r < world; ++r) {
        if (!w.active[r]) continue;
        at::Tensor out = ref.forward(rows(x, r), masks[r]);
        if (hybrid) out = torch::tanh(out);
        loss = loss + torch::mse_loss(out, rows(y, r)) / world;
      }
      loss.backward();
    }
    Snapshot s;
    s.grads = clones(grads_of(ref));
    opt.step();
    s.params = clones(ref.parameters());
    out.push_back(std::move(s));
  }
  return out;
}

// This rank's DDP training over `windows`; one snapshot per window it had data for, then (uneven) one after join().
std::vector<Snapshot> train_ddp(const std::vector<Window>& windows, const std::string& mode, bool bucket_view,
                                const std::string& group_name) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  const bool hybrid = mode == "hybrid" || mode == "hybrid_uneven", uneven = mode == "uneven" || mode == "hybrid_uneven";
  torch::manual_seed(100 + rank);
  auto model = std::make_shared<BranchNet>();
  ddp::DdpOptions options{.bucket_cap_bytes = 512, .first_bucket_bytes = 256};
  options.find_unused_parameters = true;
  options.gradient_as_bucket_view = bucket_view;
  options.uneven_inputs = uneven;
  ddp::DistributedDataParallel<BranchNet> ddp(model, comm::ProcessGroup::create(group_name), options);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<rref::RRef> handles;
  for (const auto& p : model->parameters()) handles.push_back(rref::make_local(p));
  std::optional<dist_optim::DistributedOptimizer> dist_opt;
  if (hybrid) dist_opt.emplace("sgd", handles, std::map<std::string, double>{{"lr", 0.1}, {"momentum", 0.9}});
  std::vector<Snapshot> out;
  int64_t step = 0;
  for (const Window& w : windows) {
    if (!w.active[rank]) break;
    std::optional<dist_autograd::ContextGuard> ctx;
    if (hybrid) ctx.emplace();
    else opt.zero_grad();
    for (size_t k = 0; k < w.masks.size(); ++k) {
      auto [x, y] = data(step++, world);
      std::optional<ddp::DistributedDataParallelBase::NoSync> no_sync;
      if (k + 1 < w.masks.size()) no_sync.emplace(ddp);
      at::Tensor pred = ddp.forward(rows(x, rank), w.masks[k][rank]);
      if (hybrid) {
        pred = rpc::rpc_sync<at::Tensor>((rank + 1) % world, "ddp_remote_tanh", pred);
        dist_autograd::backward(ctx->id(), {torch::mse_loss(pred, rows(y, rank))});
      } else {
        torch::mse_loss(pred, rows(y, rank)).backward();
      }
    }
    Snapshot s;
    if (hybrid) {
      ddp::reduce_context_gradients(ddp, ctx->id());
      const auto grads = dist_autograd::get_gradients(ctx->id());
      for (const auto& p : model->parameters()) s.grads.push_back(grads[p].defined() ? grads[p].clone() : at::Tensor());
      dist_opt->step(ctx->id());
    } else {
      s.grads = clones(grads_of(*model));
      opt.step();
    }
    s.params = clones(model->parameters());
    out.push_back(std::move(s));
  }
  if (uneven) {
    ddp.join();
    out.push_back(Snapshot{clones(model->parameters()), {}});
  }
  return out;
}

// `spec`: "<mode>/<seed>" (mode local, hybrid or uneven; random windows) or "issue11". Both gradient modes must be
// bit-identical, and each must follow one process within 1e-5 after every window: gradients and parameters.
std::string accumulation(const std::string& spec) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  std::vector<std::string> parts = absl::StrSplit(spec, '/');
  const std::string mode = parts[0] == "issue11" ? "local" : parts[0];
  const uint32_t seed = parts.size() > 1 ? static_cast<uint32_t>(std::stoul(parts[1])) : 0;
  const bool uneven = mode == "uneven" || mode == "hybrid_uneven";
  const auto windows = parts[0] == "issue11" ? branch_only_under_no_sync(world) : random_windows(seed, world, uneven);
  const auto ref = train_reference(windows, world, mode == "hybrid" || mode == "hybrid_uneven");
  const auto view = train_ddp(windows, mode, true, "acc_view_" + spec);
  const auto copy = train_ddp(windows, mode, false, "acc_copy_" + spec);
  std::vector<std::string> names;
  for (const auto& item : BranchNet().named_parameters()) names.push_back(item.key());
  for (size_t w = 0; w < view.size(); ++w) {
    const bool after_join = uneven && w + 1 == view.size();
    const Snapshot& expected = after_join ? ref.back() : ref[w];
    const std::string where =
        absl::StrCat(spec, " on rank ", rank, after_join ? " after join" : "", ", window ", w, ": ");
    std::string err = compare(view[w].params, copy[w].params, 0, names);
    if (err.empty() && !after_join) err = compare(view[w].grads, copy[w].grads, 0, names);
    if (!err.empty()) return where + "the gradient modes differ: " + err;
    err = compare(view[w].params, expected.params, 1e-5, names);
    if (err.empty() && !after_join) err = compare(view[w].grads, expected.grads, 1e-5, names);
    if (!err.empty()) return where + "DDP differs from one process with the whole batch: " + err;
  }
  const size_t expected_snapshots =
      uneven ? std::count_if(windows.begin(), windows.end(), [&](const Window& w) { return w.active[rank] != 0; }) + 1
             : windows.size();
  if (view.size() != expected_snapshots)
    return absl::StrCat(spec, ": ", view.size(), " snapshots, expected ", expected_snapshots);
  return "";
}

// ---- Hybrid: an embedding table on a parameter server (rank 2) and DDP trainers (ranks 0 and 1) ----

constexpr int64_t kTokens = 40, kBag = 5, kEmbDim = 8;

torch::nn::EmbeddingBag make_embedding() {
  torch::manual_seed(7);
  return torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(kTokens, kEmbDim).mode(torch::kSum));
}

struct Dense : torch::nn::Module {
  Dense() {
    fc1 = register_module("fc1", torch::nn::Linear(kEmbDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// The whole batch of one step: W·b bags of kBag token ids and targets; trainer r takes bags [r·b, (r+1)·b).
std::pair<at::Tensor, at::Tensor> bags(int64_t step, int world) {
  auto gen = at::detail::createCPUGenerator(2000 + step);
  return {at::randint(0, kTokens, {world * kBatch, kBag}, gen, at::kLong), at::randn({world * kBatch, kOut}, gen)};
}
at::Tensor bag_offsets(int64_t n) { return at::arange(0, n * kBag, kBag, at::kLong); }

// "hybrid_embedding/<buckets>/<even|uneven>": the trainers' parameters (dense, here; embedding, on the server) follow
// one process with the whole batch after every step (1e-5). The server steps the embedding once per trainer (each
// trainer's context), as PyTorch's tutorial does: the reference's embedding takes lr on the sum of the trainers'
// gradients, its dense part lr on their average.
std::string hybrid_embedding(const std::string& spec) {
  const int rank = rpc::get_worker_info().id;
  if (rank == 2) return "";
  std::vector<std::string> parts = absl::StrSplit(spec, '/');
  const bool small = parts.at(0) == "small", uneven = parts.at(1) == "uneven";
  const double lr = 0.1;
  auto embedding = nn::RemoteModule::from_rref(rref::RRef::from_ivalue(rpc::rpc_sync(2, "ddp_test.embedding", spec)));
  torch::manual_seed(100 + rank);
  auto dense = std::make_shared<Dense>();
  auto pg = comm::ProcessGroup::create("hybrid_embedding_" + spec, {0, 1});
  ddp::DdpOptions options;
  if (small) options.first_bucket_bytes = 256, options.bucket_cap_bytes = 512;
  options.uneven_inputs = uneven;
  ddp::DistributedDataParallel<Dense> ddp(dense, pg, options);
  std::vector<rref::RRef> params = embedding.remote_parameters();
  for (const auto& p : dense->parameters()) params.push_back(rref::make_local(p));
  dist_optim::DistributedOptimizer opt("sgd", params, {{"lr", lr}});
  torch::manual_seed(100);
  auto ref_dense = std::make_shared<Dense>();
  auto ref_emb = make_embedding();
  const int mine = uneven ? 2 + rank : 4, steps = uneven ? 3 : 4;
  for (int step = 0; step < steps; ++step) {
    auto [ids, y] = bags(step, 2);
    if (step < mine) {
      dist_autograd::ContextGuard ctx;
      at::Tensor my_ids = ids.narrow(0, rank * kBatch, kBatch).reshape({-1});
      at::Tensor out = ddp.forward(embedding.forward(my_ids, bag_offsets(kBatch)));
      dist_autograd::backward(ctx.id(), {torch::mse_loss(out, rows(y, rank))});
      ddp::reduce_context_gradients(ddp, ctx.id());
      opt.step(ctx.id());
    }
    // Both trainers' steps on the server are done before either reads the table again.
    if (!uneven || step < 2) comm::wait(pg->barrier());
    // The reference: the trainers with data this step, the loss divided by the world size (as DDP averages).
    for (auto& p : ref_dense->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : ref_emb->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < 2; ++r) {
      if (uneven && step >= 2 + r) continue;
      at::Tensor r_ids = ids.narrow(0, r * kBatch, kBatch).reshape({-1});
      loss = loss + torch::mse_loss(ref_dense->forward(ref_emb->forward(r_ids, bag_offsets(kBatch))), rows(y, r)) / 2;
    }
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ref_dense->parameters()) p.sub_(p.grad() * lr);
      for (auto& p : ref_emb->parameters()) p.sub_(p.grad() * (2 * lr));
    }
    if (step < mine) {
      const double d = max_diff(*dense, *ref_dense);
      if (!(d <= 1e-5))
        return absl::StrCat(spec, ": dense parameters differ from one process by ", d, " at step ", step);
      at::Tensor table = rpc::rpc_sync<at::Tensor>(2, "ddp_test.embedding_weight", spec);
      const double e = (table - ref_emb->weight).abs().max().item<double>();
      if (!(e <= 1e-5)) return absl::StrCat(spec, ": the embedding differs from one process by ", e, " at step ", step);
    }
  }
  if (uneven) ddp.join();
  return "";
}

// "hybrid_killed/ps" or "hybrid_killed/trainer": after a first step, the parameter server (rank 2) or trainer 1 dies;
// the surviving trainer's next step fails within the group's timeout, naming the dead worker.
std::string hybrid_killed(const std::string& who) {
  const int rank = rpc::get_worker_info().id;
  if (rank == 2) return "";
  auto embedding = nn::RemoteModule::from_rref(rref::RRef::from_ivalue(rpc::rpc_sync(2, "ddp_test.embedding", who)));
  auto dense = std::make_shared<Dense>();
  auto pg = comm::ProcessGroup::create("hybrid_killed", {0, 1}, {.timeout = std::chrono::milliseconds(3000)});
  ddp::DistributedDataParallel<Dense> ddp(dense, pg);
  auto step = [&](int64_t k) {
    auto [ids, y] = bags(k, 2);
    dist_autograd::ContextGuard ctx;
    at::Tensor out =
        ddp.forward(embedding.forward(ids.narrow(0, rank * kBatch, kBatch).reshape({-1}), bag_offsets(kBatch)));
    dist_autograd::backward(ctx.id(), {torch::mse_loss(out, rows(y, rank))});
    ddp::reduce_context_gradients(ddp, ctx.id());
  };
  step(0);
  comm::wait(pg->barrier());
  const bool ps = who == "ps";
  if (!ps && rank == 1) _exit(9);
  if (ps && rank == 0) (void)rpc::rpc_async(2, "test.die_in", int64_t{50});
  if (ps) {  // until the parameter server is gone (bounded): a fixed sleep was too short under ThreadSanitizer
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until &&
           rpc::call(2, "__tandem.rref.ping", {}, std::chrono::milliseconds(1000)).status().ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  const std::string dead = ps ? "worker2" : "rank 1";
  const auto t0 = std::chrono::steady_clock::now();
  try {
    step(1);
    return "a step succeeded after " + dead + " died";
  } catch (const std::exception& e) {
    const std::string m = e.what();
    if (m.find(dead) == std::string::npos) return "the error does not name " + dead + ": " + m;
  }
  if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(20)) return "the failure took longer than 20 s";
  return "";
}

// ---- Hybrid: one DDP model's outputs sent to two workers ----
//
// The trainers (ranks 0 and 1) run a DDP model of two heads that share no parameter; head a's output goes to worker 2,
// head b's to worker 3 (tanh there), so distributed autograd brings each trainer one context's gradients in two
// messages, which its RPC threads run at once, each reaching its head's taps. Bucket 0 holds head b's parameters,
// bucket 1 head a's; the comm hook of bucket 0 runs inside the reducer, called by head b's last tap. The gradients of
// one message must reach the reducer while no other message's is inside it (Reducer::tap_mu). Interleave makes the
// messages overlap there: head a's message waits at its gate (before its second layer's backward) until bucket 0's
// hook has begun, and that hook waits until head a's message is at the gate, then for head a's probe (past the taps
// of that layer), within a bound. Serialised taps hold head a's message back until the hook has returned; taps that
// are not let it reach the probe while the hook runs.
class Interleave {
 public:
  void reset() {
    MutexLock lock(&mu_);
    hooks_ = 0;
    gate_reached_ = gate_opened_ = hook_began_ = hook_ended_ = probe_passed_ = probe_inside_hook_ = false;
  }
  // Head a's gate: until bucket 0's hook has begun.
  void gate() {
    MutexLock lock(&mu_);
    gate_reached_ = true;
    gate_opened_ = mu_.AwaitWithTimeout(Condition(&hook_began_), absl::FromChrono(scaled(kMeet)));
  }
  // Head a's probe: the taps of its second layer are behind it.
  void probe() {
    MutexLock lock(&mu_);
    probe_passed_ = true;
    probe_inside_hook_ = hook_began_ && !hook_ended_;
  }
  // The comm hook: its first call of a step (bucket 0) waits for head a's message at the gate, then for its probe.
  void hook() {
    MutexLock lock(&mu_);
    if (hooks_++ > 0) return;
    hook_began_ = true;
    if (mu_.AwaitWithTimeout(Condition(&gate_reached_), absl::FromChrono(scaled(kMeet)))) {
      (void)mu_.AwaitWithTimeout(Condition(&probe_passed_), absl::FromChrono(scaled(kPass)));
    }
    hook_ended_ = true;
  }
  // "" when the messages overlapped as arranged and head a's gradients stayed out while the hook ran.
  std::string verdict() {
    MutexLock lock(&mu_);
    if (!hook_began_) return "bucket 0's comm hook was never called";
    if (!gate_reached_ || !gate_opened_) return "the gradient messages of the two heads did not run at once";
    if (!probe_passed_) return "head a's gradients never got past its second layer";
    if (probe_inside_hook_) {
      return "head a's gradients reached the reducer while head b's launch of bucket 0 (its comm hook) was inside it";
    }
    return "";
  }

 private:
  // How long the two messages may take to meet (generous: they are sent together), and how long head a's message may
  // take from its gate past its taps when nothing holds it (about a millisecond).
  static constexpr std::chrono::milliseconds kMeet{20000}, kPass{300};
  Mutex mu_;
  int hooks_ ABSL_GUARDED_BY(mu_) = 0;
  bool gate_reached_ ABSL_GUARDED_BY(mu_) = false;
  bool gate_opened_ ABSL_GUARDED_BY(mu_) = false;
  bool hook_began_ ABSL_GUARDED_BY(mu_) = false;
  bool hook_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool probe_passed_ ABSL_GUARDED_BY(mu_) = false;
  bool probe_inside_hook_ ABSL_GUARDED_BY(mu_) = false;
};

Interleave& interleave() {
  static Interleave* the = new Interleave;  // used by RPC threads until the process ends
  return *the;
}

// Identities in forward; in backward, head a's gate (HeadAGate) and probe (HeadAProbe).
template <void (Interleave::*kAt)()>
struct HeadAPoint : torch::autograd::Function<HeadAPoint<kAt>> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    (interleave().*kAt)();
    return grads;
  }
};
using HeadAGate = HeadAPoint<&Interleave::gate>;
using HeadAProbe = HeadAPoint<&Interleave::probe>;

// Head a: a1, a2 (640 bytes); head b: b1, b2 (848 bytes). Head a's probe sits between its layers: the engine runs the
// taps of a2's parameters (made last, so first in its order) before it. `interleaved` off: the plain reference.
struct TwoHeads : torch::nn::Module {
  explicit TwoHeads(bool interleaved) : interleaved(interleaved) {
    a1 = register_module("a1", torch::nn::Linear(kIn, 12));
    a2 = register_module("a2", torch::nn::Linear(12, kOut));
    b1 = register_module("b1", torch::nn::Linear(kIn, kHidden));
    b2 = register_module("b2", torch::nn::Linear(kHidden, kOut));
  }
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = torch::tanh(a1(x));
    if (interleaved) h = HeadAProbe::apply(h);
    at::Tensor a = a2(h);
    if (interleaved) a = HeadAGate::apply(a);
    return {a, b2(torch::tanh(b1(x)))};
  }
  torch::nn::Linear a1{nullptr}, a2{nullptr}, b1{nullptr}, b2{nullptr};
  const bool interleaved;
};

int64_t bytes_of(const std::vector<torch::nn::Linear>& layers) {
  int64_t n = 0;
  for (const auto& l : layers) {
    for (const auto& p : l->parameters()) n += static_cast<int64_t>(p.nbytes());
  }
  return n;
}

// Three steps on the trainers (ranks 0 and 1): each step's messages overlap as Interleave arranges, and the
// gradients reduce_context_gradients writes into the context equal those of one process with both trainers' rows
// (1e-5); both then step by plain SGD.
std::string hybrid_two_workers() {
  const int rank = rpc::get_worker_info().id;
  if (rank >= 2) return "";  // the workers the heads' outputs go to
  torch::manual_seed(100 + rank);
  auto model = std::make_shared<TwoHeads>(true);
  torch::manual_seed(100);
  TwoHeads ref(false);
  ddp::DdpOptions options;
  const int64_t b_bytes = bytes_of({model->b1, model->b2}), a_bytes = bytes_of({model->a1, model->a2});
  options.first_bucket_bytes = static_cast<size_t>(b_bytes);  // bucket 0: head b's, in reverse order
  options.rebuild_buckets = false;                            // and it stays so
  ddp::DistributedDataParallel<TwoHeads> ddp(model, comm::ProcessGroup::create("hybrid_two_workers", {0, 1}), options);
  ddp.register_comm_hook([](comm::ProcessGroup& group, at::Tensor bucket) {
    interleave().hook();
    return group.allreduce(bucket, comm::ReduceOp::kAvg);
  });
  if (ddp.stats().bucket_bytes != std::vector<size_t>{static_cast<size_t>(b_bytes), static_cast<size_t>(a_bytes)}) {
    return "the buckets are not head b's, then head a's";
  }
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  const double lr = 0.1;
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = data(step, 2);
    std::vector<at::Tensor> got;
    {
      interleave().reset();
      dist_autograd::ContextGuard ctx;
      const std::vector<at::Tensor> out = ddp.forward(rows(x, rank));
      at::Tensor a = rpc::rpc_sync<at::Tensor>(2, "ddp_remote_tanh", out[0]);
      at::Tensor b = rpc::rpc_sync<at::Tensor>(3, "ddp_remote_tanh", out[1]);
      dist_autograd::backward(ctx.id(), {torch::mse_loss(a + b, rows(y, rank))});
      if (std::string err = interleave().verdict(); !err.empty()) return absl::StrCat("step ", step, ": ", err);
      if (ddp.stats().buckets_launched != 2) return absl::StrCat("step ", step, ": not every bucket was launched");
      ddp::reduce_context_gradients(ddp, ctx.id());
      const auto grads = dist_autograd::get_gradients(ctx.id());
      for (const auto& p : model->parameters()) got.push_back(grads[p].defined() ? grads[p].clone() : at::Tensor());
    }
    ref.zero_grad();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < 2; ++r) {
      const std::vector<at::Tensor> o = ref.forward(rows(x, r));
      loss = loss + torch::mse_loss(torch::tanh(o[0]) + torch::tanh(o[1]), rows(y, r)) / 2;
    }
    loss.backward();
    if (std::string err = compare(got, grads_of(ref), 1e-5, names); !err.empty()) {
      return absl::StrCat("step ", step, ": the averaged gradients differ from one process's: ", err);
    }
    torch::NoGradGuard no_grad;
    const auto mine = model->parameters(), theirs = ref.parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      mine[i].sub_(got[i] * lr);
      theirs[i].sub_(theirs[i].grad() * lr);
    }
  }
  return "";
}

std::string run(const std::string& name) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  if (absl::StartsWith(name, "equivalence/")) return equivalence(name.substr(12));
  if (absl::StartsWith(name, "hybrid_embedding/")) return hybrid_embedding(name.substr(17));
  if (absl::StartsWith(name, "hybrid_killed/")) return hybrid_killed(name.substr(14));
  if (name == "hybrid_two_workers") return hybrid_two_workers();
  if (absl::StartsWith(name, "accumulation/")) {
    // "accumulation/<mode>/<seed>,<seed>,...": every seed in turn.
    std::vector<std::string> parts = absl::StrSplit(name.substr(13), '/');
    if (parts.size() != 2) return accumulation(parts[0]);
    for (const std::string& seed : std::vector<std::string>(absl::StrSplit(parts[1], ','))) {
      if (std::string err = accumulation(parts[0] + "/" + seed); !err.empty()) return err;
    }
    return "";
  }
  if (absl::StartsWith(name, "hybrid/")) {
    // DDP over ranks 0 and 1 combined with the RPC path: the forward calls rank 2 (tanh there) under distributed
    // autograd; the buckets are reduced during dist_autograd::backward (their reductions have started when it
    // returns: the reducer's counter), reduce_context_gradients writes the averages into the context, and
    // DistributedOptimizer steps them. The trainers follow one process with both batches. "hybrid/small": buckets of
    // 256/512 bytes; "hybrid/default": PyTorch's.
    if (rank == 2) return "";
    torch::manual_seed(100 + rank);
    auto model = std::make_shared<Net>(false, false);
    torch::manual_seed(100);
    auto ref = std::make_shared<Net>(false, false);
    auto pg = comm::ProcessGroup::create(name, {0, 1});
    ddp::DdpOptions options;
    if (name == "hybrid/small") options.first_bucket_bytes = 256, options.bucket_cap_bytes = 512;
    ddp::DistributedDataParallel<Net> ddp(model, pg, options);
    std::vector<rref::RRef> handles;
    for (const auto& p : model->parameters()) handles.push_back(rref::make_local(p));
    dist_optim::DistributedOptimizer opt("sgd", handles, {{"lr", 0.1}});
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = data(step, 2);
      {
        dist_autograd::ContextGuard ctx;
        at::Tensor out = rpc::rpc_sync<at::Tensor>(2, "ddp_remote_tanh", ddp.forward(rows(x, rank)));
        dist_autograd::backward(ctx.id(), {torch::mse_loss(out, rows(y, rank))});
        const auto st = ddp.stats();
        if (st.buckets_launched != static_cast<int64_t>(st.bucket_bytes.size())) {
          return absl::StrCat(name, ": ", st.buckets_launched, " of ", st.bucket_bytes.size(),
                              " buckets were launched during the distributed backward");
        }
        if (name == "hybrid/small" && st.bucket_bytes.size() < 2) return "hybrid/small: fewer than 2 buckets";
        ddp::reduce_context_gradients(ddp, ctx.id());
        opt.step(ctx.id());
      }
      ref_opt.zero_grad();
      torch::mse_loss(torch::tanh(ref->forward(x)), y).backward();
      ref_opt.step();
    }
    const double d = max_diff(*model, *ref);
    if (!(d <= 1e-5)) return absl::StrCat(name, ": parameters differ from one process by ", d);
    return "";
  }
  if (name == "stale_tap") {
    // An iteration abandoned after its forward under a context (its backward failed elsewhere, say), whose backward
    // runs here only after the next forward: the old graph's taps must not land their gradients in the new iteration's
    // buckets (before, they did: the new backward then failed with "got a gradient twice", or, where the old graph
    // reached a parameter the new one does not, averaged the old gradient). The new iteration follows one process.
    torch::manual_seed(100 + rank);
    auto model = std::make_shared<Net>(false, false);
    torch::manual_seed(100);
    auto ref = std::make_shared<Net>(false, false);
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create(name),
                                          {.bucket_cap_bytes = 512, .first_bucket_bytes = 256});
    std::vector<rref::RRef> handles;
    for (const auto& p : model->parameters()) handles.push_back(rref::make_local(p));
    dist_optim::DistributedOptimizer opt("sgd", handles, {{"lr", 0.1}});
    {
      dist_autograd::ContextGuard abandoned;
      auto [x0, y0] = data(0, 2);
      at::Tensor abandoned_loss = torch::mse_loss(ddp.forward(rows(x0, rank)), rows(y0, rank));
      dist_autograd::ContextGuard ctx;
      auto [x, y] = data(1, 2);
      at::Tensor loss = torch::mse_loss(ddp.forward(rows(x, rank)), rows(y, rank));
      try {
        dist_autograd::backward(abandoned.id(), {abandoned_loss});  // the old graph's taps run now
        dist_autograd::backward(ctx.id(), {loss});
        ddp::reduce_context_gradients(ddp, ctx.id());
        opt.step(ctx.id());
      } catch (const std::exception& e) {
        return absl::StrCat(name, ": ", e.what());
      }
      torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
      torch::mse_loss(ref->forward(x), y).backward();
      ref_opt.step();
    }
    const double d = max_diff(*model, *ref);
    if (!(d <= 1e-5)) return absl::StrCat(name, ": parameters differ from one process by ", d);
    return "";
  }
  if (name == "two_forwards_one_context") {
    // Two forwards under one distributed autograd context before its backward: the parameters get a gradient from
    // each graph's taps, which is an error naming one, as before taps were keyed by context (a key per forward let the
    // first graph's gradients pass unseen and averaged the second's alone: wrong gradients, no error).
    auto model = std::make_shared<Net>(false, false);
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create(name));
    dist_autograd::ContextGuard ctx;
    auto [x, y] = data(0, 2);
    at::Tensor loss = torch::mse_loss(ddp.forward(rows(x, rank)), rows(y, rank)) +
                      torch::mse_loss(ddp.forward(rows(x, rank) * 2), rows(y, rank));
    try {
      dist_autograd::backward(ctx.id(), {loss});
      ddp::reduce_context_gradients(ddp, ctx.id());
      return name + ": two forwards under one context reduced without an error";
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("got a gradient twice") == std::string::npos) {
        return absl::StrCat(name, ": an unexpected error: ", e.what());
      }
    }
    return "";
  }
  if (name == "buckets") {
    // Reverse registration order, the first bucket capped at first_bucket_bytes; rebuilt after one iteration.
    auto model = std::make_shared<Net>(false, false);  // fc1: 576 + 64 bytes, fc2: 256 + 16 bytes
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("buckets"),
                                          {.bucket_cap_bytes = 600, .first_bucket_bytes = 200});
    std::string err;
    auto s = ddp.stats();
    // Reverse order: fc2.bias (16), fc2.weight (256) -> first bucket (272 >= 200); fc1.bias (64), fc1.weight (512).
    if (s.bucket_bytes != std::vector<size_t>{272, 576}) err += "initial buckets; ";
    torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
    ddp.forward(at::ones({2, kIn}));
    if (!ddp.stats().rebuilt || ddp.stats().iterations != 1) err += "not rebuilt after the first iteration; ";
    return err;
  }
  if (name == "missing_gradient") {
    // Without find_unused_parameters, a parameter without gradient is an error naming it; the next iteration works.
    auto model = std::make_shared<Net>(true, false);
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("missing"));
    std::string err;
    try {
      torch::mse_loss(ddp.forward(at::ones({2, kIn}), false), at::zeros({2, kOut})).backward();
      err += "backward without the side branch succeeded; ";
    } catch (const std::exception& e) {
      const std::string m = e.what();
      if (m.find("side.weight") == std::string::npos || m.find("find_unused_parameters") == std::string::npos) {
        err += "error does not name the parameter and the option: " + m + "; ";
      }
    }
    torch::mse_loss(ddp.forward(at::ones({2, kIn}), true), at::zeros({2, kOut})).backward();
    return err;
  }
  if (name == "hook_throws") {
    // A communication hook that throws fails the backward with an error naming the hook, the bucket and the group,
    // with the hook's own message; the next iteration (the hook no longer throwing) works. It throws on every rank,
    // so no rank is left in a collective.
    auto model = std::make_shared<Net>(false, false);
    ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("hook"));
    bool fail = true;
    ddp.register_comm_hook([&fail](comm::ProcessGroup& group, at::Tensor bucket) {
      if (fail) throw std::runtime_error("the hook's own failure");
      return group.allreduce(bucket, comm::ReduceOp::kAvg);
    });
    std::string err;
    try {
      torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
      err += "backward with a throwing hook succeeded; ";
    } catch (const std::exception& e) {
      const std::string m = e.what();
      for (const char* part :
           {"the communication hook threw for bucket ", "process group 'hook'", "the hook's own failure"}) {
        if (m.find(part) == std::string::npos) err += absl::StrCat("error without \"", part, "\": ", m, "; ");
      }
    }
    fail = false;
    torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
    if (!model->parameters()[0].grad().defined()) err += "no gradient after the hook's failure; ";
    return err;
  }
  if (name == "shape_mismatch") {
    auto model = std::make_shared<Net>(false, false, rank == 1 ? kHidden + 1 : kHidden);
    try {
      ddp::DistributedDataParallel<Net> ddp(model, comm::ProcessGroup::create("shapes"));
      return "construction with different models succeeded";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (m.find("rank 1 of process group 'shapes'") == std::string::npos) return "error does not name rank 1: " + m;
    }
    // ZeRO likewise: each parameter's owner follows from the list (before, ranks with other lists broadcast from other
    // roots or sizes, and failed at a deadline naming nobody, or overwrote parameters silently).
    try {
      ddp::ZeroRedundancyOptimizer zero(
          model->parameters(), comm::ProcessGroup::create("zero-shapes"),
          [](std::vector<at::Tensor> shard) { return std::make_unique<torch::optim::SGD>(shard, 0.1); });
      return "a ZeroRedundancyOptimizer over different parameters was made";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (e.code() != absl::StatusCode::kFailedPrecondition ||
          m.find("ZeroRedundancyOptimizer: rank 1 of process group 'zero-shapes'") == std::string::npos) {
        return "the ZeroRedundancyOptimizer's error does not name rank 1: " + m;
      }
    }
    return "";
  }
  if (name == "buffers") {
    // Buffers (batch-norm statistics, updated differently on every rank) are rank 0's after each pre-forward.
    struct BnNet : torch::nn::Module {
      BnNet() {
        fc = register_module("fc", torch::nn::Linear(kIn, kOut));
        bn = register_module("bn", torch::nn::BatchNorm1d(kOut));
      }
      at::Tensor forward(const at::Tensor& x) { return bn(fc(x)); }
      torch::nn::Linear fc{nullptr};
      torch::nn::BatchNorm1d bn{nullptr};
    };
    auto model = std::make_shared<BnNet>();
    auto pg = comm::ProcessGroup::create("buffers");
    ddp::DistributedDataParallel<BnNet> ddp(model, pg);
    torch::mse_loss(ddp.forward(at::randn({4, kIn}) + rank), at::zeros({4, kOut})).backward();
    ddp.pre_forward();
    auto mean = model->bn->running_mean.clone();
    auto all = at::empty({world * kOut});
    comm::wait(pg->allgather(all, mean));
    if (!all.view({world, kOut}).eq(all.view({world, kOut})[0]).all().item<bool>())
      return "buffers differ after pre_forward";
    if (mean.abs().sum().item<double>() == 0) return "running statistics never updated";
    return "";
  }
  if (name == "dead_rank") {
    // The last rank dies between iterations: the next iteration fails on the others within the group's timeout, naming
    // the group and the collective (the rebuild's broadcast in forward, or a bucket's allreduce in backward).
    auto model = std::make_shared<Net>(false, false);
    auto pg = comm::ProcessGroup::create("ddp_dead", {}, {.timeout = std::chrono::milliseconds(3000)});
    ddp::DistributedDataParallel<Net> ddp(model, pg);
    torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
    if (rank == world - 1) _exit(9);
    try {
      torch::mse_loss(ddp.forward(at::ones({2, kIn})), at::zeros({2, kOut})).backward();
      return "an iteration succeeded without the dead rank";
    } catch (const std::exception& e) {
      const std::string m = e.what();
      if (m.find("process group 'ddp_dead'") == std::string::npos ||
          (m.find("allreduce") == std::string::npos && m.find("broadcast") == std::string::npos)) {
        return "error does not name the group and the operation: " + m;
      }
    }
    return "";
  }
  return "unknown scenario " + name;
}

}  // namespace

void register_scenarios() {
  register_scenario_runner(run);
  rpc::register_function("ddp_remote_tanh", [](at::Tensor x) { return torch::tanh(x); });
  nn::register_module(
      "ddp_test.embedding_bag", [] { return make_embedding(); },
      [](torch::nn::EmbeddingBag& m, at::Tensor ids, at::Tensor offsets) { return m->forward(ids, offsets); });
  // The parameter server's tables, one per scenario, created on first request (their owner is this worker).
  static std::mutex mu;
  static std::map<std::string, nn::RemoteModule> tables;
  rpc::register_function("ddp_test.embedding", [](std::string name) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = tables.find(name);
    if (it == tables.end()) {
      it = tables.emplace(name, nn::RemoteModule::create(rpc::get_worker_info().id, "ddp_test.embedding_bag")).first;
    }
    return it->second.module_rref().to_ivalue();
  });
  register_die_in();
  rpc::register_function("ddp_test.embedding_weight", [](std::string name) {
    std::lock_guard<std::mutex> lock(mu);
    return tables.at(name).local_module()->parameters().at(0).detach().clone();
  });
}

}  // namespace tandem::test
