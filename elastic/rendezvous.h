// The launchers' elastic rendezvous: how the tandem-run of each node agrees, round after round, on who is in the job.
//
//   elastic::Rendezvous rdzv(store, {.run_id = "job1", .min_nodes = 1, .max_nodes = 4, .nproc = 2, .host = ip});
//   for (;;) {
//     auto round = rdzv.join();                   // blocks until a round closes with this node in it
//     ... start the workers with round->rank_offset, world_size, master_addr:master_port ...
//     while (running) { auto end = rdzv.monitor(); ... every --monitor-interval ... }
//     rdzv.end_round(why, /*failure=*/true);     // a worker failed: every node stops its workers and joins again
//   }
//
// Rounds. Round k opens when round k-1 ends. A launcher joins it by arriving (its arrival order is its node rank); the
// round closes once max_nodes have arrived, or min_nodes have and `last_call` has passed since there were min_nodes,
// and also the nodes of round k-1 that come back are in (those that did not leave and were not lost, as counted when
// this node arrived; each stops its workers first) or keep_alive_interval × keep_alive_max_attempt has passed since
// this node arrived; later arrivals wait. A
// launcher that finds itself waiting ends the running round (not a failure), if the round has room for it: the job
// re-forms with it, as torchrun's agents do when a node waits. A round ends when any node calls end_round(): a worker
// failed (a failure), a node missed its heartbeats for keep_alive_interval × keep_alive_max_attempt (a failure: a lost
// node), a node waits to join, or a launcher leaves (a signal).
//
// Heartbeats are counters, compared on each observer's own clock: no clock synchronisation between nodes is assumed.
//
// Everything lives in a Store (rpc/store.h) under rdzv/<run_id>/: the c10d-style backend is a store served by one of
// the launchers (a single point of failure: when it dies the others fail with UNAVAILABLE naming it); a store on etcd
// removes it.
//
// Thread-safety: one Rendezvous is used by one thread. Errors (absl::Status): DEADLINE_EXCEEDED when fewer than
// min_nodes joined within join_timeout (naming how many did); ABORTED when the job has used up its restarts;
// CANCELLED when RendezvousOptions::interrupted stopped a join;
// UNAVAILABLE when the store cannot be reached;
// FAILED_PRECONDITION for a record written by a launcher of another Tandem build.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::rpc {
class Store;
}

namespace tandem::elastic {

struct RendezvousOptions {
  std::string run_id = "none";  // torchrun's --rdzv-id: launchers of one job share it
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc = 1;          // this node's workers
  std::string host;       // where the other nodes reach this node's workers
  int master_port = 0;    // a free port on `host` for this round (the launcher picks a fresh one per round)
  int max_restarts = -1;  // when >= 0, join() refuses (ABORTED) once more rounds than this ended by a failure
  // torchrun's --rdzv-conf keys of the same names.
  absl::Duration join_timeout = absl::Seconds(600);
  absl::Duration last_call_timeout = absl::Seconds(30);
  absl::Duration keep_alive_interval = absl::Seconds(5);
  int keep_alive_max_attempt = 3;
  // How often join() looks at the store while it waits.
  absl::Duration poll_interval = absl::Milliseconds(20);
  // Asked between join()'s looks at the store (optional): once it returns true (the launcher got SIGTERM), join()
  // stops waiting and returns CANCELLED. This node then leaves the round it waited in (left/<i>), and ends it (not
  // as a failure) if it was to be a member, so that the others re-form at once without it.
  std::function<bool()> interrupted;
  // Called (optional) once per round in which join() waits for other nodes after this node arrived: the round, and
  // how many nodes were in it then. tandem-run says so, so that a user sees what a launcher waits for.
  std::function<void(int64_t round, int64_t joined)> waiting;
};

// One closed round, as this node sees it.
struct Round {
  int64_t round = 0;
  int node_rank = 0;        // GROUP_RANK
  int nnodes = 0;           // GROUP_WORLD_SIZE
  int rank_offset = 0;      // the global rank of this node's first worker
  int world_size = 0;       // WORLD_SIZE
  std::string master_addr;  // node 0's host and port: its rank 0 serves the workers' store there
  int master_port = 0;
  int restarts = 0;  // TORCHELASTIC_RESTART_COUNT: rounds ended by a failure before this one
};

// Why a round ended.
struct RoundEnd {
  std::string reason;
  bool failure = false;
};

class Rendezvous {
 public:
  // `store` must outlive the Rendezvous.
  Rendezvous(rpc::Store& store, RendezvousOptions options);

  // Joins the next round and blocks until it closes with this node in it. `master_port` is read from the options at
  // each call (set a fresh one before it).
  absl::StatusOr<Round> join();
  RendezvousOptions& options() { return options_; }

  // While the round runs, call at least every keep_alive_interval: sends this node's heartbeat, and checks the
  // others'. Returns why the round ended (it may be this call that ended it: a node missed its heartbeats), or
  // nullopt while it goes on.
  absl::StatusOr<std::optional<RoundEnd>> monitor();

  // Ends the current round for every node. The first end of a round recorded wins; a failure is counted, and the
  // round counter moved on, once. Returns the end that won: this call's, or the one another node recorded first. When
  // the node that won the vote to end the round records nothing within keep_alive_interval × keep_alive_max_attempt
  // (it died, or its store calls failed, after its vote), this call ends the round in its place, as a node that was
  // outvoted at the same time may too: see publish_end() for how one of them records it.
  absl::StatusOr<RoundEnd> end_round(const std::string& reason, bool failure);

  // This node's workers all exited 0. Then monitor() until all_succeeded() (or the round ends: then join again).
  absl::Status report_success();
  // Whether every node of the round has reported success.
  absl::StatusOr<bool> all_succeeded();
  // Says this launcher is done with the store. The launcher serving the store calls wait_all_left() before it stops
  // serving, so that no other launcher loses the store before it has seen the end.
  absl::Status leave();
  absl::Status wait_all_left(absl::Duration timeout);

  // How many rounds ended by a failure, and their reasons, oldest first.
  absl::StatusOr<std::vector<std::string>> failures();

 private:
  std::string key(const std::string& suffix) const;
  std::string round_key(const std::string& suffix) const;
  absl::StatusOr<std::optional<RoundEnd>> ended();
  // The current round's end as recorded, waiting for it up to `wait`.
  absl::StatusOr<RoundEnd> recorded_end(absl::Duration wait);
  // Records this node's end of the current round, or returns the end another node recorded (end_round()).
  absl::StatusOr<RoundEnd> publish_end(const std::string& reason, bool failure);
  absl::StatusOr<RoundEnd> write_end(const std::string& reason, bool failure);
  // Whether this call is the first to add to the counter at `key`: a vote, won once whoever asks.
  absl::StatusOr<bool> first_to_add(const std::string& key);
  absl::StatusOr<Round> finish_join(int64_t k, int index, int nodes, int restarts);
  absl::Status heartbeat_check();
  // The nodes round k waits for before its last call: see join().
  absl::StatusOr<int64_t> expected_in(int64_t k);

  rpc::Store& store_;
  RendezvousOptions options_;
  int64_t round_ = -1;  // the round this node is in (after join)
  int index_ = -1;      // its node rank in it
  int nnodes_ = 0;
  int64_t claimed_ = -1;  // the last round whose end this node claimed to write (publish_end())
  // The failure count of the round this node last wrote an end of (write_end()): whether it took the count (the first
  // to add to r<k>/counted), the number the failures counter gave it, and whether the count is recorded.
  struct Counting {
    int64_t round = -1;
    bool mine = false;
    int64_t n = 0;
    bool recorded = false;
  };
  Counting counting_;
  // Heartbeats seen: each other node's last counter and when it last changed (this node's clock).
  std::vector<int64_t> seen_beats_;
  std::vector<absl::Time> seen_at_;
  absl::Time next_beat_ = absl::InfinitePast();
};

}  // namespace tandem::elastic

namespace tandem::elastic {

// A store on etcd's v3 API at `endpoint` ("host:port" of a member, plaintext: etcd's own authentication and TLS are
// not used yet): the etcd backend (tandem-run --rdzv-backend etcd), with no single point of failure beyond the etcd
// cluster. Keys live under /tandem/ (a finished job's stay: give each job its own run id). `op_timeout` bounds each
// operation; get() and wait() look again every 10 ms within their own timeouts. The rendezvous's values are not
// authenticated with the job secret on this backend: whoever may write to the etcd cluster may join the job.
std::unique_ptr<rpc::Store> connect_etcd_store(const std::string& endpoint, std::chrono::milliseconds op_timeout);

// Whether `host` names this machine (an address of it can be bound): the launcher there serves the c10d-style store.
bool is_this_machine(const std::string& host);
// The address of this machine that reaches `host` (no packet is sent): what the other nodes dial for its workers.
absl::StatusOr<std::string> address_towards(const std::string& host);

}  // namespace tandem::elastic
