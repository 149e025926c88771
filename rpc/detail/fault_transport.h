// The fault-injecting transport of rpc/fault_injection.h: wraps the agent's transports (requests this worker sends)
// and its request handler (replies this worker gives).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "tandem/rpc/fault_injection.h"
#include "tandem/rpc/transport.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::detail {

// The rules of one worker, their counters, held and scheduled messages. Shared by every wrapped transport of an agent.
class FaultInjector {
 public:
  FaultInjector(std::vector<FaultRule> rules, std::string self);
  ~FaultInjector();

  // Names of the job's workers by rank (known after rendezvous).
  void set_peers(std::vector<std::string> names);
  // `inner` with the rules applied to the requests it carries.
  std::unique_ptr<Transport> wrap(Transport* inner);
  // `handler` with the rules applied to the replies of the requests it gets.
  IncomingFn wrap_incoming(IncomingFn handler);
  // Runs what is held or scheduled now (the messages go out, or their callers fail) and stops the timer.
  void stop();

 private:
  friend class FaultTransport;
  using Task = std::function<void(bool stopping)>;

  std::string name_of(int rank) const;
  // The rule that applies to the next message to `to` of `kind` calling `function`, counting it; null for none.
  const FaultRule* match(const std::string& to, FaultRule::Kind kind, const std::string& function);
  void schedule(absl::Time at, Task task);
  // Holds `send` until the next message to `to` went out (release) or `at most`.
  void hold(const std::string& to, absl::Duration at_most, Task send);
  void release(const std::string& to);
  void run_timer();

  const std::vector<FaultRule> rules_;
  const std::string self_;
  Mutex mu_;
  std::vector<std::string> names_ ABSL_GUARDED_BY(mu_);
  std::vector<int> seen_ ABSL_GUARDED_BY(mu_);  // matching messages counted per rule
  std::multimap<absl::Time, Task> timer_ ABSL_GUARDED_BY(mu_);
  std::multimap<std::string, std::shared_ptr<Task>> held_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// A copy of `frame` whose header length no longer matches its size.
grpc::ByteBuffer corrupt_frame(const grpc::ByteBuffer& frame);

}  // namespace tandem::rpc::detail
