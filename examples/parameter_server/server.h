// The parameter server of examples/parameter_server (also driven by bench/ps_bench.cc).
//
// Rank 0 ("ps") owns the model, built as an nn::RemoteModule from a registered factory; ranks 1..N are trainers.
// A trainer step: forward through the RemoteModule (the model runs on the server), loss here, distributed backward
// (gradients land in the server's context), and
//   - synchronous mode: that is all. As each trainer's backward pass is done on the server (its backward-part hook,
//     dist_autograd.h), the server adds its gradients to the round's and, once all N arrived, applies their average
//     with one optimizer step; the replies to their backward passes wait for it, so no trainer's next forward can see
//     a half-updated model. A trainer's step sends one forward to the server (each backward part is one trainer's
//     step); no message of its own for the round (a submit call per step, before: 1-3% of the steps/s). A round that
//     cannot complete before its first trainer's backward call would time out (another trainer hung, or died where no
//     launcher ends the job) fails its trainers a little earlier, naming the trainers it waited for, and drops its
//     gradients; a trainer's second step into a round it still waits in is refused;
//   - asynchronous mode: a DistributedOptimizer step of the trainer's own (Hogwild: trainers never wait for each other,
//     a gradient may be computed against weights another trainer has just updated).
// In synchronous mode the server's metrics (metrics/metrics.h) have the time its rounds' steps took, which every
// trainer waits for: gauges tandem_ps_step_seconds_total and tandem_ps_steps_total.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "tandem/nn/remote_module.h"

namespace tandem::examples {

struct ServerOptions {
  std::string model = "cnn";  // "cnn" (2 conv + pooling + FC, Fashion-MNIST) or "mlp" (784-512-512-10)
  std::string optimizer = "adam";
  double lr = 1e-3;
  int trainers = 2;
  bool sync = true;      // synchronous mode (the round in the backward pass); false: asynchronous (see the top)
  bool evaluate = true;  // load the test set for evaluate()
  // Synchronous mode: the server saves the model, its optimizer and the number of rounds (optimizer steps) every
  // `checkpoint_every` rounds, and resumes from the newest on start (checkpoint/checkpoint.h). The trainers' place
  // follows from the rounds (rounds_done()), so only the server saves. Asynchronous mode: the server saves its model
  // at each checkpoint_barrier(), after every trainer saved its own optimizer state.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 50;  // at least 1, as `trainers` is: start_parameter_server() refuses less
};

// The server's RPC worker threads in bench/ps_bench.cc (both sides' servers): the CPUs this process may use
// (cluster/cpus.h: its affinity, bounded by its container's CPU quota), at least 2. None of the server's functions
// waits for another worker, so threads beyond the cores only let the trainers' requests preempt each other. Tandem's
// direct channel no longer wakes more threads than cores (docs/rpc.md, "Threads": with RPC's default of 16 the server
// ran at 0.59-0.61 of the machine's limit against 0.73-0.75 with 2 before that, and at the same speed after), so the
// example keeps RPC's default; PyTorch's server in the same design still gains from it (320 against 270 steps/s with
// its default of 16, README).
int default_server_threads();
// Registers the model factories and the server's functions (every rank, before init_rpc).
void register_parameter_server();
// On rank 0, after init_rpc: builds the model and starts serving trainers. Throws tandem::Error (INVALID_ARGUMENT,
// naming the field) for options out of range, before any work.
void start_parameter_server(const ServerOptions& options);
// On rank 0: waits until every trainer called done(). Meanwhile it keeps a call to each trainer that has not in flight
// (ps.alive, each within `probe_timeout`, the next once it is answered; looked at every second): throws tandem::Error
// naming the trainer when one reported its failure (report_failure(), ABORTED with the trainer's reason; it wins over
// a probe's error) or did not answer (UNAVAILABLE with the call's error: it died, or hangs where no launcher ends the
// job). No other bound: a job trains as long as its trainers live.
void wait_for_trainers(std::chrono::milliseconds probe_timeout);

// Trainer side.
nn::RemoteModule server_model();  // the model on "ps"
int64_t rounds_done();            // steps the server's checkpoint holds (sync: rounds; > 0 after a resume)
// Asynchronous mode with checkpoints: waits until every trainer reached `step`; the server then saves its model.
void checkpoint_barrier(int64_t step);
uint64_t model_hash();  // parameters_hash (examples/data/cnn.h) of the server's model
double evaluate();      // test accuracy of the current model, computed on the server
void done();            // this trainer has finished
// A trainer that fails tells the server why (best effort, within min(RPC's timeout, 5 s); never throws), so that the
// server ends at once naming it, also where no launcher ends the job.
void report_failure(const std::string& why) noexcept;

}  // namespace tandem::examples
