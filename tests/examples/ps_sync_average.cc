// The parameter server's synchronous mode (examples/parameter_server/server.h) takes one optimizer step per round
// with the average of every trainer's gradient: three rounds of two trainers, each checked against the same steps
// taken in one process (the same model, the same batches, LibTorch's SGD with the server's momentum). The rounds after
// the first also check that a round starts from no gradient (the sums are cleared) and that momentum carries over.
// Run under tandem-run --nproc-per-node 3 (tests/examples/CMakeLists.txt): rank 0 serves, ranks 1 and 2 train and
// each compares the server's parameters after every round. A mismatch: a message naming the round and the parameter,
// exit code 1.
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/parameter_server/server.h"
#include "tandem/cluster/environment.h"
#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/rpc/rpc.h"

using namespace tandem;

namespace {

constexpr int kTrainers = 2, kRounds = 3, kBatch = 16;
constexpr double kLr = 0.05;  // SGD's, with the server's momentum 0.9 (server.cc)

// Trainer `t`'s batch in round `round`: drawn alike on every rank, so each trainer knows the other's too.
std::pair<at::Tensor, at::Tensor> batch(int t, int round) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * t + round);
  return {at::randn({kBatch, 1, 28, 28}, gen), at::randint(0, 10, {kBatch}, gen, at::kLong)};
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits, y);
}

std::vector<at::Tensor> server_parameters(const nn::RemoteModule& model) {
  std::vector<at::Tensor> out;
  for (const auto& r : model.remote_parameters()) out.push_back(r.to_here<at::Tensor>());
  return out;
}

// The server's "mlp" (server.cc, make_mlp) in this process, starting from the server's parameters.
torch::nn::Sequential local_mlp(const std::vector<at::Tensor>& from) {
  namespace tn = torch::nn;
  tn::Sequential m(tn::Flatten(), tn::Linear(784, 512), tn::ReLU(), tn::Linear(512, 512), tn::ReLU(),
                   tn::Linear(512, 10));
  auto params = m->parameters();
  if (params.size() != from.size()) throw std::runtime_error("the server's model has another number of parameters");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(from[i]);
  return m;
}

// Returns "" or what differs.
std::string train(int rank) {
  nn::RemoteModule model = examples::server_model();
  // No trainer has stepped yet: the server's parameters are round 1's start (its round waits for both trainers).
  torch::nn::Sequential local = local_mlp(server_parameters(model));
  torch::optim::SGD sgd(local->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
  for (int round = 1; round <= kRounds; ++round) {
    auto [x, y] = batch(rank, round);
    {
      dist_autograd::ContextGuard ctx;
      at::Tensor loss = loss_of(model.forward(x), y);
      dist_autograd::backward(ctx.id(), {loss});  // returns once the round's step is taken (sync mode)
    }
    // The same round here: every trainer's gradient, averaged, one step.
    sgd.zero_grad();
    auto params = local->parameters();
    for (int t = 1; t <= kTrainers; ++t) {
      auto [tx, ty] = batch(t, round);
      loss_of(local->forward(tx), ty).backward();  // accumulates: the sum of the trainers' gradients
    }
    for (auto& p : params) p.mutable_grad().div_(kTrainers);
    sgd.step();
    // Before the other trainer's next backward reaches the server, the model cannot change: this trainer has not sent
    // its own next step, and the round waits for it.
    const std::vector<at::Tensor> got = server_parameters(model);
    for (size_t i = 0; i < params.size(); ++i) {
      if (!at::allclose(got[i], params[i].detach(), 1e-4, 1e-6)) {
        return "round " + std::to_string(round) + ", parameter " + std::to_string(i) +
               ": the server's differs from the average step by up to " +
               std::to_string((got[i] - params[i].detach()).abs().max().item<double>());
      }
    }
  }
  return "";
}

}  // namespace

int main() {
  try {
    examples::register_parameter_server();
    auto place = cluster::worker_place();
    if (!place.ok() || place->world_size != kTrainers + 1) {
      std::fprintf(stderr, "ps_sync_average: run with tandem-run --nproc-per-node %d\n", kTrainers + 1);
      return 2;
    }
    const int rank = place->rank;
    rpc::RpcOptions options;
    options.master_addr = place->master_addr;
    options.master_port = place->master_port;
    rpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank), rank, place->world_size, options);
    std::string err;
    if (rank == 0) {
      examples::ServerOptions server;
      server.model = "mlp";
      server.optimizer = "sgd";
      server.lr = kLr;
      server.trainers = kTrainers;
      server.evaluate = false;
      examples::start_parameter_server(server);
      examples::wait_for_trainers(std::chrono::seconds(30));
    } else {
      err = train(rank);
      examples::done();
    }
    rpc::shutdown(true);
    if (!err.empty()) {
      std::fprintf(stderr, "ps_sync_average: trainer %d: %s\n", rank, err.c_str());
      return 1;
    }
    if (rank != 0) std::printf("trainer %d: %d rounds equal the average step\n", rank, kRounds);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_sync_average: %s\n", e.what());
    return 1;
  }
}
