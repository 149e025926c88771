// The job's key-value store, served by rank 0 and used for rendezvous, barriers and (later) collective set-up.
//
// Every operation has a deadline; get() and wait() block until the keys exist or the timeout passes
// (DEADLINE_EXCEEDED). A dead store gives UNAVAILABLE. Values are bytes; add() keeps a decimal counter.
//
// Thread-safety: Store implementations may be used from any number of threads.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class Channel;
class Service;
}  // namespace grpc

namespace tandem::rpc {

class Store {
 public:
  virtual ~Store() = default;
  virtual absl::Status set(const std::string& key, const std::string& value) = 0;
  virtual absl::StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the counter at `key` (created at 0) and returns the new value.
  virtual absl::StatusOr<int64_t> add(const std::string& key, int64_t delta) = 0;
  virtual absl::Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Whether each key exists, without waiting.
  virtual absl::StatusOr<std::vector<bool>> check(const std::vector<std::string>& keys) = 0;
  virtual absl::Status remove(const std::string& key) = 0;
};

// A store reached over gRPC, authenticating with the job token. With `wait_for_ready` an operation waits (within its
// deadline) for the store's server to come up, as rendezvous needs; without it an unreachable store fails at once.
// `op_timeout` bounds set, add, check and remove; the agent passes init_timeout or rpc_timeout, the default is for
// tools and tests that have no RpcOptions.
std::unique_ptr<Store> connect_store(std::shared_ptr<grpc::Channel> channel, std::string token, bool wait_for_ready,
                                     std::chrono::milliseconds op_timeout = std::chrono::seconds(30));

// The service rank 0 adds to its gRPC server. Calls without `token` are rejected with UNAUTHENTICATED; a call with
// `client_token` (a client outside the job, when not empty) may read (get, wait, check) and gets PERMISSION_DENIED
// for set, add and delete.
std::unique_ptr<grpc::Service> make_store_service(std::string token, std::string client_token = "");

// A store served on its own, outside any agent: the launchers' elastic rendezvous (elastic/). It listens on
// `address` ("host:port"; port 0 picks one) until destroyed, and accepts calls carrying the token derived from
// `secret`. The port is never shared (no SO_REUSEPORT): a port in use fails with UNAVAILABLE, which is how one of
// several launchers started with the same endpoint becomes its host; an address that cannot be bound for another
// reason (not this machine's, a port it may not use) fails with FAILED_PRECONDITION and the system's reason.
class StoreServer {
 public:
  virtual ~StoreServer() = default;
  virtual int port() const = 0;
};
absl::StatusOr<std::unique_ptr<StoreServer>> serve_store(const std::string& address, const std::string& secret);

// A client of a store served by serve_store() with the same `secret`. Each operation waits for the server to be
// reachable within its own deadline (`op_timeout` for set, add, check and remove), then fails with UNAVAILABLE or
// DEADLINE_EXCEEDED naming the operation and the key.
std::unique_ptr<Store> connect_store(const std::string& address, const std::string& secret,
                                     std::chrono::milliseconds op_timeout);

// Waits until the key `prefix + r` exists for every rank r in `ranks`. On timeout the error names the missing ranks:
// "ranks 1, 3 did not <what> within 3000 ms".
absl::Status wait_for_ranks(Store& store, const std::string& prefix, const std::vector<int>& ranks,
                            std::chrono::milliseconds timeout, const std::string& what);

// Blocks until all `world_size` ranks called barrier with the same `name`, or `timeout` passes; the error then names
// the ranks that did not arrive. Each name is one barrier, used once.
absl::Status barrier(Store& store, const std::string& name, int rank, int world_size,
                     std::chrono::milliseconds timeout);

}  // namespace tandem::rpc
