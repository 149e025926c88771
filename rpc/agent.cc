// Shutdown of the agent (rpc/detail/agent.h): graceful (drain, barrier, leave in order) and immediate.
#include <grpcpp/impl/codegen/service_type.h>

#include "absl/strings/str_cat.h"
#include "tandem/log/log.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/direct_transport.h"
#include "tandem/rpc/detail/fault_transport.h"
#include "tandem/rpc/detail/grpc_transport.h"
#include "tandem/rpc/extension.h"

namespace tandem::rpc::detail {

// Normally stopped by shutdown() already (a no-op then); otherwise the same grace as a graceful shutdown's stop.
Agent::~Agent() {
  stop(std::chrono::milliseconds(2000));
  lifeline_->cut();  // waits for completions running inside the lifeline
}

absl::Status Agent::drain_outgoing(absl::Time deadline) {
  MutexLock lock(&mu_);
  auto empty = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return outstanding_ == 0; };
  if (!mu_.AwaitWithDeadline(Condition(&empty), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(outstanding_, " outgoing calls still pending"));
  }
  return absl::OkStatus();
}

bool Agent::drain_incoming(absl::Time deadline) {
  const InCall* own = t_current_in_call_;  // a function that shuts its worker down does not wait for its own call
  MutexLock lock(&mu_);
  auto done = [this, own]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [raw, call] : in_calls_) {
      if (raw != own && call->client.load()) return false;
    }
    return true;
  };
  return mu_.AwaitWithDeadline(Condition(&done), deadline);
}

absl::Status Agent::shutdown(bool graceful) {
  absl::Status result;
  if (graceful) {
    const absl::Time deadline = absl::Now() + absl::FromChrono(options_.shutdown_timeout);
    auto left = [&] {
      return std::max(std::chrono::milliseconds(1), absl::ToChronoMilliseconds(deadline - absl::Now()));
    };
    for (const auto& hook : shutdown_hooks()) {
      if (absl::Status s = hook(deadline); !s.ok() && result.ok()) result = s;
    }
    if (absl::Status s = drain_outgoing(deadline); !s.ok() && result.ok()) result = s;
    if (result.ok()) result = barrier(*store_, "shutdown", rank_, world_size_, left());
    if (result.ok()) {
      // Rank 0 serves the store: it leaves last, once every other rank has read the barrier.
      if (rank_ != 0) {
        result = store_->set(absl::StrCat("left/", rank_), "");
      } else {
        std::vector<int> others;
        for (int r = 1; r < world_size_; ++r) others.push_back(r);
        result = wait_for_ranks(*store_, "left/", others, left(), "leave after the barrier");
      }
    }
    if (!result.ok()) {
      result =
          absl::Status(result.code(), absl::StrCat("graceful shutdown of worker '", name_, "': ", result.message()));
    }
  }
  // How long threads may take to finish what they run once stopped: a fixed share of the shutdown timeout, so a
  // worker that is shut down never waits on a function that does not return for longer than the user allowed.
  if (result.ok()) {
    TANDEM_LOG(kInfo, "rpc") << (graceful ? "left the job (graceful shutdown)"
                                          : "left the job (shutdown without waiting)");
  } else {
    TANDEM_LOG(kWarn, "rpc") << result.message();
  }
  const auto grace = std::min(options_.shutdown_timeout, std::chrono::milliseconds(graceful ? 2000 : 500));
  // Once every worker has left, clients' calls still running here (outside the job: nobody drained them) are let
  // finish and be answered first, for at most the grace, such as the call of a function that asked this worker to shut
  // down (an agent's "stop"), which stop() would otherwise answer with CANCELLED. A job member's call still running
  // now was given up by its caller (which drained its calls before the barrier): stop() answers it at once.
  if (graceful && result.ok() && !drain_incoming(absl::Now() + absl::FromChrono(grace))) {
    TANDEM_LOG(kWarn, "rpc") << "graceful shutdown of worker '" << name_ << "': clients' calls still run after "
                             << grace.count() << " ms; they are answered with CANCELLED";
  }
  stop(grace);
  return result;
}

void Agent::stop(std::chrono::milliseconds grace) {
  std::vector<std::shared_ptr<InCall>> in_calls;
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    for (auto& [_, call] : in_calls_) in_calls.push_back(call);
  }
  set_ready();                                    // releases calls parked before init completed; they see stopped_
  if (direct_) direct_->cap_reply_writes(grace);  // the answers below wait at most the grace for their connection
  // Calls still running here (a function that never returns) are answered now, so the servers can shut down; one
  // whose reply another thread is writing is left to it (the transports' stop below cuts that write short).
  for (auto& call : in_calls) {
    finish_once(call, absl::CancelledError(absl::StrCat("worker '", name_, "' shut down")), nullptr,
                /*unless_busy=*/true);
  }
  if (faults_) faults_->stop();  // held and delayed messages go now (and fail: the transports are stopping)
  bool transports_done = true;
  if (direct_) transports_done = direct_->stop(grace) && transports_done;  // fails its calls with CANCELLED
  if (grpc_) transports_done = grpc_->stop(grace) && transports_done;
  const bool pool_done = pool_ ? pool_->stop(grace) : true;
  const bool out_done = drain_outgoing(absl::Now() + absl::FromChrono(grace)).ok();
  stopped_cleanly_ = pool_done && out_done && transports_done;
}

}  // namespace tandem::rpc::detail
