// A stage worker's runtime: the stages it holds (built on the driver's request), one executor thread per pipeline
// that runs the plan of each step in order (forwards and backwards of its stages, activations and gradients to and
// from the neighbouring stages' workers through the mailbox, p2p.h), the gradients it delivers once every worker of
// the step finished its run, and the check that each pipeline's driver is alive. It serves the RPC handlers named in
// common.h, which are registered in every process that links the pipeline library (at start-up, before init_rpc).
//
// Thread-safety: handlers run on RPC threads; a pipeline's work runs on its executor thread.
#pragma once

#include <cstdint>

namespace tandem::pipeline::detail {

// Makes sure this process serves the runtime's handlers (they are registered at start-up; calling this keeps the
// runtime linked into programs that use only the driver).
void ensure_runtime();
// How many plans this process has received from drivers (each is kept for the steps of its shape that follow).
int64_t plans_received();

}  // namespace tandem::pipeline::detail
