#include "tests/pipeline/stages.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/metrics/metrics.h"
#include "tandem/nn/remote_module.h"
#include "tandem/pipeline/detail/common.h"
#include "tandem/pipeline/detail/runtime.h"
#include "tandem/pipeline/layers.h"
#include "tandem/pipeline/local.h"
#include "tandem/pipeline/pipeline.h"
#include "tandem/rpc/registry.h"
#include "tests/common/test_env.h"

namespace tandem::test {

using pipeline::detail::status_kib;

torch::nn::Sequential make_pipe_mlp(int64_t layers, int64_t width, int64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  for (int64_t i = 0; i < layers; ++i) {
    m->push_back(torch::nn::Linear(width, width));
    m->push_back(torch::nn::Tanh());
  }
  m->to(torch::kDouble);
  return m;
}

namespace {

std::vector<at::Tensor> stage_params(int64_t pipe, int64_t stage) {
  auto m = pipeline::local_stage(pipe, static_cast<int>(stage));
  if (!m) throw std::invalid_argument("no such stage here");
  return m->parameters();
}

// A float64 Linear(4, 4) that computes the identity.
torch::nn::Linear identity_linear() {
  torch::nn::Linear lin(4, 4);
  lin->to(torch::kDouble);
  torch::NoGradGuard no_grad;
  lin->weight.copy_(torch::eye(4, torch::kDouble));
  lin->bias.zero_();
  return lin;
}

// An identity layer that fails on a marked row (first value 999): throws (mode 1) or dies (mode 2).
struct Faulty : torch::nn::Module {
  explicit Faulty(int64_t mode) : mode(mode) { lin = register_module("lin", identity_linear()); }
  at::Tensor forward(const at::Tensor& x) {
    if (mode != 0 && x.select(1, 0).eq(999).any().item<bool>()) {
      if (mode == 2) _exit(9);
      throw std::runtime_error("a marked row reached the faulty stage");
    }
    return lin->forward(x);
  }
  int64_t mode;
  torch::nn::Linear lin{nullptr};
};

// A float64 identity Linear(4, 4) whose forward, when a row's first value is 999, waits until worker `peer` has posted
// a turn in a sum across the replicas (pipe_sums_posted there; at most 60 s), then kills its process with exit code 9.
struct DiesAfterSum : torch::nn::Module {
  explicit DiesAfterSum(int64_t peer) : peer(peer) { lin = register_module("lin", identity_linear()); }
  at::Tensor forward(const at::Tensor& x) {
    if (x.select(1, 0).eq(999).any().item<bool>()) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (rpc::rpc_sync<int64_t>(static_cast<int>(peer), "pipe_sums_posted") == 0 &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      _exit(9);
    }
    return lin->forward(x);
  }
  int64_t peer;
  torch::nn::Linear lin{nullptr};
};

// An identity Linear(4, 4) whose backward sleeps `ms` milliseconds (a hook on its output's gradient); counts its
// forwards in this process (slow_forwards).
std::atomic<int64_t> slow_forwards{0};
std::atomic<int64_t> slow_builds{0};  // pipe_slow_build's builds ended in this process
// Every forward of such modules in this process ('f' with gradients, 'i' without: its start) and every backward ('b':
// its end), in order, with the steady clock's microseconds.
std::mutex slow_log_mu;
std::vector<int64_t> slow_log;  // kind, time, kind, time, ...
void note(char kind, int64_t t) {
  std::lock_guard<std::mutex> lock(slow_log_mu);
  slow_log.insert(slow_log.end(), {kind, t});
}
int64_t steady_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
struct SlowBackward : torch::nn::Module {
  explicit SlowBackward(int64_t ms) : ms(ms) { lin = register_module("lin", identity_linear()); }
  at::Tensor forward(const at::Tensor& x) {
    ++slow_forwards;
    note(at::GradMode::is_enabled() ? 'f' : 'i', steady_us());
    at::Tensor y = lin->forward(x);
    if (y.requires_grad()) {
      const int64_t wait = ms;
      y.register_hook([wait](const at::Tensor& g) {
        std::this_thread::sleep_for(std::chrono::milliseconds(wait));
        note('b', steady_us());
        return g;
      });
    }
    return y;
  }
  int64_t ms;
  torch::nn::Linear lin{nullptr};
};

// An identity Linear(4, 4) whose forward stalls for `ms` milliseconds, or until pipe_unstall is called here (or
// unstall_stages()); a new one stalls again.
std::atomic<bool> unstalled{false};
struct Stall : torch::nn::Module {
  explicit Stall(int64_t ms) : ms(ms) {
    lin = register_module("lin", identity_linear());
    unstalled.store(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (!unstalled.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return lin->forward(x);
  }
  int64_t ms;
  torch::nn::Linear lin{nullptr};
};

}  // namespace

void unstall_stages() { unstalled.store(true); }

torch::nn::Sequential make_pipe_layers(int64_t begin, int64_t end) {
  torch::nn::Sequential part;
  for (int64_t i = begin; i < end; ++i) {
    if (i % 2 == 1) {
      part->push_back(torch::nn::Tanh());
      continue;
    }
    torch::manual_seed(7000 + i);  // layer i is the same whatever range it is built in
    torch::nn::Linear lin(kPipeLayersWidth, kPipeLayersWidth);
    lin->to(torch::kDouble);
    part->push_back(lin);
  }
  return part;
}

bool reset_peak_memory() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return clear_refs.good();
}

MaskedBlockImpl::MaskedBlockImpl(int64_t seed, bool last) : last(last) {
  torch::manual_seed(seed);
  lin = register_module("lin", torch::nn::Linear(4, 4));
  lin->to(torch::kDouble);
}

c10::IValue masked_block_forward(MaskedBlock& block, const at::Tensor& x, const at::Tensor& mask, double scale,
                                 const std::vector<at::Tensor>& aux) {
  if (aux.size() != 2) throw std::invalid_argument("pipe_masked takes [a, b]");
  const at::Tensor keep = mask.to(at::kDouble);
  const at::Tensor z = block->lin->forward(x + 0.1 * aux[1]);
  if (block->last) return z * keep + aux[0];
  const at::Tensor h = torch::tanh(z * scale) * keep;
  return c10::ivalue::Tuple::create({h, mask, scale, c10::List<at::Tensor>({0.5 * aux[0] + h.narrow(1, 0, 1), h})});
}

torch::nn::Sequential make_pipe_dropout_bn(int64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(4, 6), torch::nn::Dropout(0.5), torch::nn::Linear(6, 6),
                          torch::nn::BatchNorm1d(6), torch::nn::Tanh(), torch::nn::Linear(6, 4));
  m->to(torch::kDouble);
  return m;
}

void register_pipeline_stages() {
  nn::register_module("pipe_mlp", make_pipe_mlp);
  nn::register_module("pipe_linear", [](int64_t in, int64_t out) {
    torch::nn::Linear l(in, out);
    l->to(torch::kDouble);
    return l;
  });
  nn::register_module("pipe_faulty", [](int64_t mode) { return std::make_shared<Faulty>(mode); });
  nn::register_module("pipe_dies_after_sum", [](int64_t peer) { return std::make_shared<DiesAfterSum>(peer); });
  rpc::register_function("pipe_sums_posted", [] { return pipeline::detail::sums_posted_for_tests(); });
  rpc::register_function("pipe_grads", [](int64_t pipe, int64_t stage, int64_t context) {
    const auto grads = dist_autograd::get_gradients(context);
    std::vector<at::Tensor> out;
    for (const auto& p : stage_params(pipe, stage)) out.push_back(grads.contains(p) ? grads[p] : at::zeros_like(p));
    return out;
  });
  rpc::register_function("pipe_dot_grads", [](int64_t pipe, int64_t stage) {
    std::vector<at::Tensor> out;
    for (const auto& p : stage_params(pipe, stage)) out.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
    return out;
  });
  nn::register_module("pipe_dropout_bn", make_pipe_dropout_bn);
  nn::register_module(
      "pipe_masked", [](int64_t seed, bool last) { return MaskedBlock(seed, last); },
      [](MaskedBlock& block, at::Tensor x, at::Tensor mask, double scale, std::vector<at::Tensor> aux) {
        return masked_block_forward(block, x, mask, scale, aux);
      });
  pipeline::register_layers("pipe_layers", {.n_layers = kPipeLayers, .build = make_pipe_layers});
  pipeline::register_layers("pipe_big_layers", {.n_layers = kBigLayers, .build = [](int64_t begin, int64_t end) {
                                                  torch::nn::Sequential part;
                                                  for (int64_t i = begin; i < end; ++i) {
                                                    torch::manual_seed(9000 + i);
                                                    part->push_back(torch::nn::Linear(kBigWidth, kBigWidth));
                                                  }
                                                  return part;
                                                }});
  rpc::register_function("pipe_memory_kib", [](bool reset_peak) {
    const bool reset = reset_peak && reset_peak_memory();
    return std::vector<int64_t>{status_kib("VmRSS"), status_kib("VmHWM"), reset ? 1 : 0};
  });
  nn::register_module("pipe_slow_backward", [](int64_t ms) { return std::make_shared<SlowBackward>(ms); });
  nn::register_module("pipe_slow_build", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    torch::nn::Linear l(4, 4);
    l->to(torch::kDouble);
    ++slow_builds;
    return l;
  });
  rpc::register_function("pipe_slow_builds", [] { return slow_builds.load(); });
  nn::register_module("pipe_stall", [](int64_t ms) { return std::make_shared<Stall>(ms); });
  rpc::register_function("pipe_unstall", [] { unstalled.store(true); });
  // {calls, errors} of this worker's pings of the driver `peer` (pipeline/detail/common.h: kPing), from its metrics.
  rpc::register_function("pipe_pings", [](std::string peer) {
    std::vector<int64_t> out{0, 0};
    for (const auto& c : metrics::snapshot().calls) {
      if (c.peer == peer && c.function == pipeline::detail::kPing && c.direction == "out") out = {c.calls, c.errors};
    }
    return out;
  });
  // Makes parameter `name` of a stage held here one element of its dtype, value 1 (set_data: the stage's parameter
  // list and its ties keep the same tensor), after creation's checks.
  rpc::register_function("pipe_shrink_param", [](int64_t pipe, int64_t stage, std::string name) {
    auto m = pipeline::local_stage(pipe, static_cast<int>(stage));
    if (!m) throw std::invalid_argument("no such stage here");
    at::Tensor p = m->named_parameters()[name];
    p.set_data(at::ones({1}, at::TensorOptions().dtype(p.scalar_type())));
  });
  // Parameter `name` of a stage held here as complex128 (`complex`) or back as float64 (its real part): its forward
  // then throws, and its zeros in the replicas' sum have a dtype collectives refuse (the post of its turn throws).
  rpc::register_function("pipe_complex_param", [](int64_t pipe, int64_t stage, std::string name, bool complex) {
    auto m = pipeline::local_stage(pipe, static_cast<int>(stage));
    if (!m) throw std::invalid_argument("no such stage here");
    at::Tensor p = m->named_parameters()[name];
    p.set_data(complex ? p.detach().to(at::kComplexDouble) : at::real(p.detach()).clone());
  });
  rpc::register_function("pipe_slow_forwards", [] { return slow_forwards.load(); });
  rpc::register_function("pipe_slow_log", [] {
    std::lock_guard<std::mutex> lock(slow_log_mu);
    return slow_log;
  });
  rpc::register_function("pipe_seed", [](int64_t seed) { torch::manual_seed(seed); });
  rpc::register_function("pipe_plans", [] {
    return std::vector<int64_t>{pipeline::detail::plans_received(), pipeline::local_plan_count(),
                                pipeline::detail::runs_started_directly(), pipeline::detail::runs_ended()};
  });
  rpc::register_function("pipe_buffers", [](int64_t pipe, int64_t stage) {
    auto m = pipeline::local_stage(pipe, static_cast<int>(stage));
    if (!m) throw std::invalid_argument("no such stage here");
    std::vector<at::Tensor> out;
    for (const auto& b : m->buffers()) out.push_back(b.detach().to(at::kDouble));
    return out;
  });
  rpc::register_function("pipe_training", [](int64_t pipe, int64_t stage) {
    auto m = pipeline::local_stage(pipe, static_cast<int>(stage));
    if (!m) throw std::invalid_argument("no such stage here");
    bool all = true;
    for (const auto& c : m->modules()) all = all && c->is_training();
    return all;
  });
  rpc::register_function("pipe_stage_count", [] { return pipeline::local_stage_count(); });
  rpc::register_function("pipe_contexts", [] { return dist_autograd::stats().contexts; });
  // Builds a pipeline on worker1 and worker2 from this worker, keeps it, and dies a second later (a driver that died).
  rpc::register_function("pipe_create_and_die", [] {
    static auto* kept = new std::vector<pipeline::Pipeline>;
    kept->push_back(pipeline::Pipeline::create(
        {{1, "pipe_linear", {int64_t{4}, int64_t{4}}}, {2, "pipe_linear", {int64_t{4}, int64_t{4}}}}));
    die_in(std::chrono::milliseconds(1000));
    return kept->back().id();
  });
  rpc::register_function("pipe_params", [](int64_t pipe, int64_t stage) {
    std::vector<at::Tensor> out;
    for (const auto& p : stage_params(pipe, stage)) out.push_back(p.detach().clone());
    return out;
  });
}

}  // namespace tandem::test
