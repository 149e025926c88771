// A stage worker's runtime: the stages it holds (built on the driver's request), one executor thread per pipeline
// that runs the plan of each step in order (forwards and backwards of its stages, activations and gradients to and
// from the neighbouring stages' workers through the mailbox, p2p.h), the gradients it delivers once every worker of
// the step finished its run, and the check that each pipeline's driver is alive. It serves the RPC handlers named in
// common.h, which are registered in every process that links the pipeline library (at start-up, before init_rpc).
//
// Thread-safety: handlers run on RPC threads; a pipeline's work runs on its executor thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "tandem/pipeline/detail/common.h"

namespace tandem::pipeline::detail {

// Makes sure this process serves the runtime's handlers (they are registered at start-up; calling this keeps the
// runtime linked into programs that use only the driver).
void ensure_runtime();
// How many plans this process has received from drivers (each is kept for the steps of its shape that follow).
int64_t plans_received();
// How many step runs a driver on this host started here without a call (go_key).
int64_t runs_started_directly();
// How many step runs ended here (answered: done, failed or abandoned).
int64_t runs_ended();

class Inbox;  // shm_p2p.h
class Outlet;
// Same-host deliveries are on unless TANDEM_PIPELINE_SHM=0 (then every message goes by RPC: for comparing the two,
// and for tests of the RPC path's failures).
bool shared_memory_enabled();

// Asks worker `to` for a ring in its inbox for pipeline `pipe` (__tandem.pipeline.attach) and opens it, once per
// process: every caller gets the same outlet (its sends are serialised), or the same null when there is none to have
// (switched off, another host, the pipeline not held there, the call failed: the caller sends by RPC, which reports
// what is wrong with the peer). drop_outlets() forgets a pipeline's. Never throws.
// `function`: kAttach (a stage worker's inbox) or kAttachReply (a driver's, below).
std::shared_ptr<Outlet> attach_outlet(int to, int64_t pipe, std::chrono::milliseconds timeout,
                                      const char* function = kAttach);
void drop_outlets(int64_t pipe);

// A driver's inbox for its pipeline's replies: the stage workers on its host write each step's reply there
// (__tandem.pipeline.attach_reply asks for a ring in it) and complete the step's call with None. Made by the first
// call (`create`); dropped by drop_driver_inbox when the pipeline goes.
std::shared_ptr<Inbox> driver_inbox(int64_t pipe, bool create);
void drop_driver_inbox(int64_t pipe);

}  // namespace tandem::pipeline::detail
