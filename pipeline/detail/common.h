// What the pipeline's driver (pipeline.cc) and its stage workers' runtime (runtime.cc) share: the names of the
// runtime's RPC handlers, the margins of their waits, and small helpers.
//
// Thread-safety: constants and stateless functions; the tests' send fault is set and called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "tandem/sync/sync.h"

namespace torch::nn {
class Module;
}

namespace tandem::pipeline::detail {

inline constexpr const char* kCreate = "__tandem.pipeline.create";
inline constexpr const char* kRun = "__tandem.pipeline.run";
inline constexpr const char* kAct = "__tandem.pipeline.act";
// The longest step timeout a pipeline takes (1e6 s, as the launcher's durations): longer ones would overflow the
// deadline arithmetic (Clock::now() + timeout); a timeout from the wire is clamped to it.
inline constexpr std::chrono::milliseconds kMaxTimeout{int64_t{1000000} * 1000};
inline std::chrono::milliseconds wire_timeout(int64_t ms) {
  return std::chrono::milliseconds(std::clamp<int64_t>(ms, 1, kMaxTimeout.count()));
}
inline constexpr const char* kAbort = "__tandem.pipeline.abort";
inline constexpr const char* kRelease = "__tandem.pipeline.release";
inline constexpr const char* kForward = "__tandem.pipeline.forward";
inline constexpr const char* kDone = "__tandem.pipeline.done";
inline constexpr const char* kPing = "__tandem.pipeline.ping";
inline constexpr const char* kTie = "__tandem.pipeline.tie";
inline constexpr const char* kGroup = "__tandem.pipeline.group";
inline constexpr const char* kAttach = "__tandem.pipeline.attach";
inline constexpr const char* kAttachReply = "__tandem.pipeline.attach_reply";
// How often a stage worker checks that the drivers of the pipelines it holds stages of are alive (a driver that died
// leaves its stages behind otherwise), and how long each check may take.
inline constexpr std::chrono::milliseconds kDriverCheck{1000};
// A worker's reply (its own error naming stage and micro-batch) must reach the driver before the driver's own wait
// on that worker runs out: the RPC carrying a plan gets the step's timeout plus this.
inline constexpr std::chrono::milliseconds kReplyMargin{2000};
// A step started without a call (runtime.h: go_key) that failed on a worker: its reply in the driver's inbox is
// (kErrorTag, status code, message).
inline constexpr const char* kErrorTag = "__tandem.pipeline.error";
// After the first failure, how long the driver waits for the other workers' errors (which name, e.g., the
// micro-batch a dead worker's neighbour could not send) before it reports.
inline constexpr std::chrono::milliseconds kErrorGrace{2000};

using Clock = std::chrono::steady_clock;

// Throws RpcError with `code` and "pipeline: <message>".
[[noreturn]] void fail(absl::StatusCode code, const std::string& message);
// Tests: `fault` is called by a driver before it sends worker `rank` its part of step `step` of pipeline `pipe`; what
// it throws fails the step's start there, as a shared-memory ring or a call that throws would (the workers already
// sent their parts are told to abandon the step). Null, the default: nothing. Thread-safe; send_fault_for_tests
// costs an atomic load when none is set.
void set_send_fault_for_tests(std::function<void(int64_t pipe, int64_t step, int rank)> fault);
void send_fault_for_tests(int64_t pipe, int64_t step, int rank);
// The turns this process posted in replicated stages' sums across the replicas (every pipeline held here, zeros
// included), for tests that need a worker to be inside such a sum; note_sum_posted counts one. Thread-safe.
int64_t sums_posted_for_tests();
void note_sum_posted();
// The system clock in microseconds (timeline events of different workers on one axis).
int64_t now_us();
// This worker's name, or "(local)" outside RPC.
std::string self_name();
// Held around every build of a model or of its layers in this process (stage builds, and the driver's own in
// from_sequential and from_layers): factories seed LibTorch's global generator (torch::manual_seed) to build the same
// weights everywhere, and two builds at once would draw from it interleaved. Guards no data: it orders the builds.
Mutex& build_mutex();
// A field of this process's /proc/self/status in KiB ("VmHWM": the peak resident memory so far, "VmRSS": now); -1
// where /proc does not tell.
int64_t status_kib(const char* field);
// This process's peak resident memory so far in KiB (getrusage's ru_maxrss: VmHWM, which /proc/self/clear_refs "5"
// resets, or the pre-exec image's if larger), -1 where it does not tell. About a microsecond, where reading
// /proc/self/status took 46-60 us in a stage worker: it is on the tail of every step.
int64_t peak_resident_kib();
// A layer's weight by parameters: its parameter count plus one (a layer without parameters still counts a little, so
// every stage gets a layer).
double parameter_weight(const torch::nn::Module& layer);
// The fastest of three forward + backward passes of `layer` on `x` in seconds (the first pays for allocations);
// `*out` gets the output, detached (the next layer's input).
double fastest_pass(const std::function<at::Tensor(const at::Tensor&)>& layer, const at::Tensor& x, at::Tensor* out);

}  // namespace tandem::pipeline::detail
