// The parameter server of examples/parameter_server (also driven by bench/ps_bench.cc).
//
// Rank 0 ("ps") owns the model, built as an nn::RemoteModule from a registered factory; ranks 1..N are trainers.
// A trainer step: forward through the RemoteModule (the model runs on the server), loss here, distributed backward
// (gradients land in the server's context), then
//   - synchronous mode: submit(context) — the server sums the trainers' gradients and, once all N submitted, applies
//     their average with one optimizer step and releases them all (no trainer's forward can see a half-updated model);
//   - asynchronous mode: a DistributedOptimizer step of the trainer's own (Hogwild: trainers never wait for each other,
//     a gradient may be computed against weights another trainer has just updated).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "nn/remote_module.h"

namespace tandem::examples {

struct ServerOptions {
  std::string model = "cnn";  // "cnn" (2 conv + pooling + FC, Fashion-MNIST) or "mlp" (784-512-512-10)
  std::string optimizer = "adam";
  double lr = 1e-3;
  int trainers = 2;
  bool evaluate = true;  // load the test set for evaluate()
};

// Registers the model factories and the server's functions (every rank, before init_rpc).
void register_parameter_server();
// On rank 0, after init_rpc: builds the model and starts serving trainers.
void start_parameter_server(const ServerOptions& options);
// On rank 0: waits until every trainer called done() (false when `timeout` ran out first).
bool wait_for_trainers(std::chrono::milliseconds timeout);

// Trainer side.
nn::RemoteModule server_model();  // the model on "ps"
void submit(int64_t context_id);  // synchronous mode: waits for the averaged step
double evaluate();                // test accuracy of the current model, computed on the server
void done();                      // this trainer has finished

}  // namespace tandem::examples
