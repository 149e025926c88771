// bench/run.sh elastic — the worker of Tandem's side (bench/elastic_driver.py starts it under tandem-run, kills rank 1
// mid-run and times the restart). A small DDP job: MLP 784-256-10, SGD, batch 64 per rank of fixed random data, one
// intra-op thread; rank 0 saves a checkpoint every 10 steps (Checkpointer, fsync'd) and every rank resumes from the
// newest on start. The same job as bench/peer_elastic.py.
//
// Each completed step prints one line: {"event":"step","restart":R,"step":S,"t":<seconds since the epoch>}, and the
// start of the process {"event":"start","restart":R,"t":...}; the driver computes the figures from them.
// Flags: --steps N (the job's total), --step-ms M (a pause after each step, so the run lasts long enough to be
// killed mid-way), --checkpoint-dir D.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "tandem/checkpoint/checkpoint.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace comm = tandem::comm;
namespace ddp = tandem::ddp;
namespace rpc = tandem::rpc;
namespace checkpoint = tandem::checkpoint;

namespace {

double wall_s() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

void event(const char* what, int restart, int64_t step) {
  std::printf("{\"event\":\"%s\",\"restart\":%d,\"step\":%lld,\"t\":%.6f}\n", what, restart,
              static_cast<long long>(step), wall_s());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const double started = wall_s();
  int64_t steps = 400;
  int step_ms = 10;
  std::string dir = "/tmp/tandem-elastic-bench";
  CLI::App app{"One worker of the elastic-training benchmark (bench/elastic_driver.py starts and kills them)",
               "elastic_bench"};
  app.add_option("--steps", steps, "training steps");
  app.add_option("--step-ms", step_ms, "compute time of a step");
  app.add_option("--checkpoint-dir", dir, "where checkpoints go");
  tandem::tools::parse_flags(app, argc, argv);
  const char* restart_env = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int restart = restart_env ? std::atoi(restart_env) : 0;
  std::printf("{\"event\":\"start\",\"restart\":%d,\"step\":-1,\"t\":%.6f}\n", restart, started);
  at::set_num_threads(1);
  rpc::init_rpc();
  auto pg = comm::ProcessGroup::create("elastic_bench", {}, {.timeout = std::chrono::seconds(60)});

  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
  ddp::DistributedDataParallel<torch::nn::SequentialImpl> net(model.ptr(), pg);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  const at::Tensor x = at::randn({64, 784}), y = at::randint(0, 10, {64}, at::kLong);

  int64_t step = 0;
  checkpoint::Checkpointer ckpt(dir, pg->rank());
  checkpoint::State state;
  state.add("model", *model).add("optimizer", opt).add("step", step);
  (void)ckpt.restore(state, pg.get(), checkpoint::Layout::kReplicated);

  while (step < steps) {
    opt.zero_grad();
    at::cross_entropy_loss(net.forward(x), y).backward();
    opt.step();
    ++step;
    if (pg->rank() == 0) {
      event("step", restart, step);
      if (step % 10 == 0) ckpt.save(step, state);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
  }
  rpc::shutdown();
  return 0;
}
