#include "tests/checkpoint/scenarios.h"

#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "absl/strings/str_split.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/zero.h"
#include "tandem/rpc/rpc.h"
#include "tests/common/scenario.h"

namespace tandem::test {
namespace {

// A rank's part in the counter scenarios below: its group (named for the scenario), its checkpointer of `dir` and a
// state of one counter.
struct Counter {
  Counter(const std::string& scenario, const std::string& dir, int keep)
      : rank(rpc::get_worker_info().id), group(comm::ProcessGroup::create(scenario)), ckpt(dir, rank, {.keep = keep}) {
    state.add("counter", value);
  }
  // Restores, expecting the refusal: FAILED_PRECONDITION whose message holds each of `needles`; "" when so.
  std::string expect_refused(std::initializer_list<const char*> needles) {
    try {
      const std::optional<int64_t> step = ckpt.restore(state, group.get());
      return "restored " + (step ? "step " + std::to_string(*step) : std::string("nothing: a fresh start"));
    } catch (const Error& e) {
      const std::string m = e.what();
      if (e.code() != absl::StatusCode::kFailedPrecondition) return "error: " + m;
      for (const char* needle : needles) {
        if (m.find(needle) == std::string::npos) return "error: " + m;
      }
    }
    return "";
  }
  const int rank;
  std::shared_ptr<comm::ProcessGroup> group;
  checkpoint::Checkpointer ckpt;
  int64_t value = 0;
  checkpoint::State state;
};

// Every rank saves steps 1..3; one rank's newest file is then torn (cut in half): all ranks must resume from step 2,
// that rank included, and only from it.
std::string agree(const std::string& dir, const std::string& torn_rank) {
  Counter c("agree", dir, 3);
  for (int64_t step = 1; step <= 3; ++step) {
    c.value = 100 * step + c.rank;
    c.ckpt.save(step, c.state);
  }
  if (std::to_string(c.rank) == torn_rank) {
    const std::string path = c.ckpt.path(3);
    if (::truncate(path.c_str(), 40) != 0) return "cannot truncate " + path;
  }
  comm::wait(c.group->barrier());
  c.value = -1;
  const std::optional<int64_t> step = c.ckpt.restore(c.state, c.group.get());
  if (!step || *step != 2) return "resumed from " + (step ? std::to_string(*step) : "nothing") + ", not step 2";
  if (c.value != 200 + c.rank) return "counter " + std::to_string(c.value) + " after the restore";
  return "";
}

// Ranks 0 and 1 save steps 1 and 2 of their own state (Layout::kPerRank); the job then restores with 3 ranks: rank 2
// has no file, so every rank fails naming it (before, every rank started afresh, dropping the others' state).
std::string grown(const std::string& dir) {
  Counter c("grown", dir, 2);
  if (c.rank < 2) {
    for (int64_t step = 1; step <= 2; ++step) c.ckpt.save(step, c.state);
  }
  comm::wait(c.group->barrier());
  return c.expect_refused({"rank(s) 2 of the group", "up to step 2"});
}

// Every rank has steps but none that all have intact: rank 0 keeps steps 2 and 3, rank 1 steps 1 and 2 with 2 torn.
// Every rank fails (before, the second round found nothing below step 1 and every rank started afresh).
std::string no_common(const std::string& dir) {
  Counter c("no-common", dir, 2);
  for (int64_t step = c.rank == 0 ? 2 : 1; step <= (c.rank == 0 ? 3 : 2); ++step) c.ckpt.save(step, c.state);
  if (c.rank == 1 && ::truncate(c.ckpt.path(2).c_str(), 40) != 0) return "cannot truncate " + c.ckpt.path(2);
  comm::wait(c.group->barrier());
  return c.expect_refused({"none that every rank has intact"});
}

// The ZeRO scenarios' optimizer of each shard.
std::unique_ptr<torch::optim::Optimizer> adam(std::vector<at::Tensor> shard) {
  return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.01));
}

// ZeRO, sharded: train 2 steps, save, train 2 more; a fresh model and optimizer restored from the checkpoint and
// trained the same 2 steps must end bit-identical on every rank.
std::string zero(const std::string& dir) {
  const int rank = rpc::get_worker_info().id;
  auto group = comm::ProcessGroup::create("zero");
  auto make = [&] {
    torch::manual_seed(7);
    return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  };
  auto train = [&](torch::nn::Sequential& model, ddp::ZeroRedundancyOptimizer& opt, int64_t from, int64_t steps) {
    for (int64_t s = from; s < from + steps; ++s) {
      auto gen = at::detail::createCPUGenerator(500 + s);
      const at::Tensor x = at::randn({8, 6}, gen), y = at::randn({8, 3}, gen);
      opt.zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      opt.step();  // the same batch on every rank: no averaging needed
    }
  };
  auto model = make();
  ddp::ZeroRedundancyOptimizer opt(model->parameters(), group, adam);
  train(model, opt, 0, 2);
  checkpoint::Checkpointer ckpt(dir, rank);
  checkpoint::State state;
  state.add("model", *model).add("optimizer", opt);
  ckpt.save(2, state);
  train(model, opt, 2, 2);

  auto resumed = make();
  for (auto& p : resumed->parameters()) p.data().add_(1.0);  // not the saved values
  ddp::ZeroRedundancyOptimizer resumed_opt(resumed->parameters(), group, adam);
  checkpoint::State resumed_state;
  resumed_state.add("model", *resumed).add("optimizer", resumed_opt);
  const std::optional<int64_t> step = ckpt.restore(resumed_state, group.get());
  if (!step || *step != 2) return "resumed from " + (step ? std::to_string(*step) : "nothing");
  train(resumed, resumed_opt, 2, 2);
  auto a = model->parameters(), b = resumed->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].equal(b[i])) return "parameter " + std::to_string(i) + " differs from the uninterrupted run";
  }
  return "";
}

// ZeRO, consolidated, across world sizes: ranks 0 and 1 train 2 steps as a job of 2, save a consolidated checkpoint
// and take a third step; then all 3 ranks, a job of 3 with another partition, restore it and take the same third
// step. The parameters must equal those of the job of 2, to the bit: every owner got its parameters' state.
std::string zero_consolidated(const std::string& dir) {
  const int rank = rpc::get_worker_info().id;
  auto make = [&] {
    torch::manual_seed(7);
    return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 8),
                                 torch::nn::Tanh(), torch::nn::Linear(8, 3));
  };
  auto step = [&](torch::nn::Sequential& model, ddp::ZeroRedundancyOptimizer& opt, int64_t s) {
    auto gen = at::detail::createCPUGenerator(900 + s);
    const at::Tensor x = at::randn({8, 6}, gen), y = at::randn({8, 3}, gen);
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();  // the same batch on every rank: no averaging needed
  };
  std::vector<at::Tensor> two_ranks_result;
  if (rank < 2) {
    auto pair = comm::ProcessGroup::create("zero-pair", {0, 1});
    auto model = make();
    ddp::ZeroRedundancyOptimizer opt(model->parameters(), pair, adam);
    step(model, opt, 0);
    step(model, opt, 1);
    checkpoint::Checkpointer ckpt(dir, rank);
    checkpoint::State state;
    state.add("model", *model).add("optimizer", opt, checkpoint::State::Zero::kConsolidated);
    ckpt.save(2, state);  // collective over the pair
    step(model, opt, 2);
    for (auto& p : model->parameters()) two_ranks_result.push_back(p.detach().clone());
  }
  auto all = comm::ProcessGroup::create("zero-all");
  auto model = make();
  for (auto& p : model->parameters()) p.data().add_(1.0);  // not the saved values
  ddp::ZeroRedundancyOptimizer opt(model->parameters(), all, adam);
  checkpoint::Checkpointer ckpt(dir, rank);
  checkpoint::State state;
  state.add("model", *model).add("optimizer", opt, checkpoint::State::Zero::kConsolidated);
  const std::optional<int64_t> resumed = ckpt.restore(state, all.get(), checkpoint::Layout::kReplicated);
  if (!resumed || *resumed != 2) return "resumed from " + (resumed ? std::to_string(*resumed) : "nothing");
  step(model, opt, 2);
  auto params = model->parameters();
  for (size_t i = 0; i < two_ranks_result.size(); ++i) {
    if (!params[i].equal(two_ranks_result[i])) {
      return "parameter " + std::to_string(i) + " differs from the job of 2 after the same step";
    }
  }
  return "";
}

std::string run(const std::string& scenario) {
  std::vector<std::string> parts = absl::StrSplit(scenario, '|');
  if (parts[0] == "agree" && parts.size() == 3) return agree(parts[1], parts[2]);
  if (parts[0] == "zero" && parts.size() == 2) return zero(parts[1]);
  if (parts[0] == "grown" && parts.size() == 2) return grown(parts[1]);
  if (parts[0] == "no-common" && parts.size() == 2) return no_common(parts[1]);
  if (parts[0] == "zero-consolidated" && parts.size() == 2) return zero_consolidated(parts[1]);
  return "unknown scenario " + scenario;
}

}  // namespace

void register_scenarios() { register_scenario_runner(run); }

int write_forever() {
  const char* dir = std::getenv("TANDEM_TEST_DIR");
  if (!dir) return 2;
  checkpoint::Checkpointer ckpt(dir, 0);
  at::Tensor big = at::zeros({4 << 20});  // 16 MiB: a write takes long enough to be cut
  int64_t step = 0;
  checkpoint::State state;
  state.add("big", big).add("step", step);
  // After the newest step an earlier writer left: each writer's steps are newer than all before it.
  const std::vector<int64_t> before = ckpt.steps();
  for (step = before.empty() ? 1 : before.back() + 1;; ++step) {
    big.fill_(static_cast<double>(step));
    ckpt.save(step, state);
  }
}

}  // namespace tandem::test
