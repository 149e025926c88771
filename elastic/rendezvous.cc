#include "tandem/elastic/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/elastic/detail/records.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/detail/version.h"
#include "tandem/rpc/store.h"

namespace tandem::elastic {
namespace {

namespace pb = tandem::wire;

std::chrono::milliseconds to_ms(absl::Duration d) {
  return std::max(std::chrono::milliseconds(1), absl::ToChronoMilliseconds(d));
}

std::string seconds(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), " s"); }

// A round's "closed" record at `key` (present: its writer wrote it), read within `wait`.
absl::StatusOr<pb::ElasticRound> read_closed(rpc::Store& store, const std::string& key, absl::Duration wait) {
  auto bytes = store.get(key, to_ms(wait));
  if (!bytes.ok()) return bytes.status();
  return detail::parse_round(*bytes, key);
}

}  // namespace

Rendezvous::Rendezvous(rpc::Store& store, RendezvousOptions options) : store_(store), options_(std::move(options)) {}

std::string Rendezvous::key(const std::string& suffix) const { return "rdzv/" + options_.run_id + "/" + suffix; }

std::string Rendezvous::round_key(const std::string& suffix) const {
  return key(absl::StrCat("r", round_, "/", suffix));
}

absl::StatusOr<RoundEnd> Rendezvous::recorded_end(absl::Duration wait) {
  const std::string k = round_key("ended");
  auto bytes = store_.get(k, to_ms(wait));
  if (!bytes.ok()) return bytes.status();
  auto end = detail::parse_end(*bytes, k);
  if (!end.ok()) return end.status();
  return RoundEnd{end->reason(), end->failure()};
}

absl::StatusOr<std::optional<RoundEnd>> Rendezvous::ended() {
  auto present = store_.check({round_key("ended")});
  if (!present.ok()) return present.status();
  if (!(*present)[0]) return std::optional<RoundEnd>();
  auto end = recorded_end(options_.keep_alive_interval);
  if (!end.ok()) return end.status();
  return std::optional<RoundEnd>(*end);
}

absl::StatusOr<bool> Rendezvous::first_to_add(const std::string& key) {
  auto n = store_.add(key, 1);
  if (!n.ok()) return n.status();
  return *n == 1;
}

absl::StatusOr<RoundEnd> Rendezvous::end_round(const std::string& reason, bool failure) {
  // This node's earlier end of this round claimed the record and failed midway (a store call): it writes again at
  // once, without a second vote (whose loss would make it wait a lost node's time for its own record).
  if (claimed_ == round_) return publish_end(reason, failure);
  auto won = first_to_add(round_key("end"));
  if (!won.ok()) return won.status();
  if (!*won) {  // another node ended it first; it records why right after its vote
    auto end = recorded_end(options_.keep_alive_interval * options_.keep_alive_max_attempt);
    if (end.status().code() != absl::StatusCode::kDeadlineExceeded) return end;
    // Nothing recorded in a lost node's time: the winner died, or its store calls failed, between its vote and the
    // record. This node ends the round in its place (before, every node's end failed here and the round never ended).
  }
  return publish_end(reason, failure);
}

// The nodes that end a round (the vote's winner at once, an outvoted node whose winner recorded nothing in a lost
// node's time) claim the right to record the end in turns: the first to add to r<k>/publish/<t> writes it, the others
// wait for its record (rpc::Store has no compare-and-set: a counter's add is the only step one node alone can win).
// - A winner that was only slow, and claims after an outvoted node did, finds turn 0 taken and returns the end that
//   node recorded: one end, counted once.
// - A claimer that records nothing in the time its store calls may take (its claim's reply and five more in
//   write_end(), each within a lost node's time, as tandem-run sets the store's timeout) died or failed after its
//   claim: the next turn is claimed. Each turn's claimer records the end or has stopped ending the round (its error
//   returned, its process gone), so there are at most as many turns as nodes that end the round.
// - A claimer slower than that (a process paused) is stopped by write_end()'s look for a record, short of a pause
//   between that look and its write: the record it then overwrites names another cause, but neither the failure nor
//   the round counter is counted twice.
absl::StatusOr<RoundEnd> Rendezvous::publish_end(const std::string& reason, bool failure) {
  // This node's earlier call claimed a turn and failed midway (tandem-run ends a round again as it leaves): it is not
  // writing now (one thread), so it writes at once instead of waiting out its own turn.
  if (claimed_ == round_) return write_end(reason, failure);
  constexpr int kWriterCalls = 6;
  const absl::Duration lost_after = options_.keep_alive_interval * options_.keep_alive_max_attempt;
  for (int64_t turn = 0;; ++turn) {
    auto claimed = first_to_add(round_key(absl::StrCat("publish/", turn)));
    if (!claimed.ok()) return claimed.status();
    if (*claimed) {
      claimed_ = round_;
      return write_end(reason, failure);
    }
    auto end = recorded_end(kWriterCalls * lost_after);
    if (end.status().code() != absl::StatusCode::kDeadlineExceeded) return end;
  }
}

// The failure is counted before "ended" (the next round's closer reads the count once it sees the end), the round
// counter moved on after it. Each count is taken by the first writer to add to a key of its own, so a second writer
// (publish_end()) counts nothing again. A writer that dies between that add and the count leaves a failure uncounted,
// or the round counter behind: join() steps over a round that has ended, so a counter behind costs a look, where one
// ahead would have the nodes skip the round the others form.
absl::StatusOr<RoundEnd> Rendezvous::write_end(const std::string& reason, bool failure) {
  auto recorded = ended();
  if (!recorded.ok()) return recorded.status();
  if (recorded->has_value()) return **recorded;  // a later turn's claimer recorded it: this one was slow
  // A writer whose store call failed after it took the count writes it again (tandem-run ends the round again as it
  // leaves): what it took is kept in counting_, so the failure is neither lost nor counted twice by it.
  if (failure && !(counting_.round == round_ && counting_.recorded)) {
    if (counting_.round != round_) {
      auto first = first_to_add(round_key("counted"));
      if (!first.ok()) return first.status();
      counting_ = Counting{round_, *first};
    }
    if (counting_.mine) {
      if (counting_.n == 0) {
        auto n = store_.add(key("failures"), 1);
        if (!n.ok()) return n.status();
        counting_.n = *n;
      }
      if (auto s = store_.set(key(absl::StrCat("failure/", counting_.n)), reason); !s.ok()) return s;
    }
    counting_.recorded = true;
  }
  pb::ElasticEnd end;
  end.set_wire_version(rpc::kWireVersion);
  end.set_reason(reason);
  end.set_failure(failure);
  if (auto s = store_.set(round_key("ended"), end.SerializeAsString()); !s.ok()) return s;
  auto first = first_to_add(round_key("advanced"));
  if (!first.ok()) return first.status();
  if (*first) {
    if (auto s = store_.add(key("round"), 1); !s.ok()) return s.status();
  }
  return RoundEnd{reason, failure};
}

// Round k's nodes from round k-1, counted when a node enters round k: its members (all that joined it, when it ended
// before closing) and those that waited for a place in it, less those that left (a member stopped by a signal, or a
// node that left while it waited) or were lost; at most max_nodes. Without this, a node that waited for a place (it
// ended round k-1 and joined round k at once) would close round k alone after a last call shorter than the members of
// round k-1 took to stop their workers: a round started only to end.
absl::StatusOr<int64_t> Rendezvous::expected_in(int64_t k) {
  if (k == 0) return 0;
  const std::string previous = key(absl::StrCat("r", k - 1, "/"));
  auto joined = store_.add(previous + "joined", 0);
  if (!joined.ok()) return joined.status();
  if (*joined < 0 || *joined > detail::kMaxCount) {
    return absl::DataLossError(absl::StrCat("rendezvous: the counter at ", previous, "joined reads ", *joined));
  }
  std::vector<std::string> gone;
  for (int64_t i = 0; i < *joined; ++i) {
    gone.push_back(absl::StrCat(previous, "left/", i));
    gone.push_back(absl::StrCat(previous, "lost/", i));
  }
  int64_t expected = *joined;
  constexpr size_t kKeysPerCheck = 64;  // etcd's default limit is 128 operations in one transaction
  for (size_t at = 0; at < gone.size(); at += kKeysPerCheck) {
    const std::vector<std::string> some(gone.begin() + at, gone.begin() + std::min(gone.size(), at + kKeysPerCheck));
    auto present = store_.check(some);
    if (!present.ok()) return present.status();
    for (size_t i = 0; i + 1 < present->size(); i += 2) {
      if ((*present)[i] || (*present)[i + 1]) --expected;
    }
  }
  return std::min<int64_t>(expected, options_.max_nodes);
}

absl::StatusOr<Round> Rendezvous::join() {
  const absl::Time deadline = absl::Now() + options_.join_timeout;
  auto current = store_.add(key("round"), 0);
  if (!current.ok()) return current.status();
  int64_t k = std::max(*current, round_ + 1);
  for (;;) {
    if (options_.max_restarts >= 0) {  // a job that has given up forms no more rounds
      auto failures = store_.add(key("failures"), 0);
      if (!failures.ok()) return failures.status();
      if (*failures > options_.max_restarts) {
        return absl::AbortedError(absl::StrCat("rendezvous '", options_.run_id, "': the job has used up its ",
                                               options_.max_restarts, " restarts"));
      }
    }
    if (options_.interrupted && options_.interrupted()) {  // before arriving: nothing to undo in round k
      return absl::CancelledError(absl::StrCat("rendezvous '", options_.run_id, "': node ", options_.host,
                                               " (launcher pid ", getpid(), ") left before joining round ", k));
    }
    round_ = k;
    index_ = -1;
    if (auto e = ended(); !e.ok()) {
      return e.status();
    } else if (e->has_value()) {
      ++k;
      continue;
    }
    auto arrived = store_.add(round_key("joined"), 1);
    if (!arrived.ok()) return arrived.status();
    if (*arrived < 1 || *arrived > detail::kMaxCount) {
      return absl::DataLossError(absl::StrCat("rendezvous: the counter at ", round_key("joined"), " reads ", *arrived));
    }
    const int index = static_cast<int>(*arrived - 1);
    pb::ElasticNode me;
    me.set_wire_version(rpc::kWireVersion);
    me.set_host(options_.host);
    me.set_nproc(options_.nproc);
    me.set_master_port(options_.master_port);
    me.set_pid(static_cast<int32_t>(getpid()));
    if (auto s = store_.set(round_key(absl::StrCat("node/", index)), me.SerializeAsString()); !s.ok()) return s;

    auto expected = expected_in(k);
    if (!expected.ok()) return expected.status();
    const absl::Time entered = absl::Now();
    const absl::Duration lost_after = options_.keep_alive_interval * options_.keep_alive_max_attempt;
    std::optional<absl::Time> min_since;  // when this node first saw min_nodes in the round
    std::optional<absl::Time> outvoted;   // when another node won the vote to close the round
    bool ended_unpublished = false;       // this node ended the round its closer never published
    bool asked_to_end = false;
    bool said_waiting = false;
    for (;;) {
      auto present = store_.check({round_key("closed"), round_key("ended")});
      if (!present.ok()) return present.status();
      // Closed first: a member of a round that has already ended still takes part (its monitor() then sees the end
      // at once), so every node goes through every round it is in and counts the same rounds.
      if ((*present)[0]) {
        auto closed = read_closed(store_, round_key("closed"), options_.keep_alive_interval);
        if (!closed.ok()) return closed.status();
        if (index < closed->nodes()) {
          auto round = finish_join(k, index, closed->nodes(), closed->restarts());
          if (!round.ok() && round.status().code() != absl::StatusCode::kAborted) return round.status();
          if (round.ok()) return round;
          break;  // a member never said where it is: the round was ended; join the next one
        }
        if ((*present)[1]) break;  // too late for a round that is over: join the next one
        // This node came too late for round k. If the job has room, it re-forms with this node (not a failure).
        if (closed->nodes() < options_.max_nodes && !asked_to_end) {
          asked_to_end = true;
          const std::string why =
              absl::StrCat("node ", options_.host, " (launcher pid ", getpid(), ") is waiting to join");
          if (auto s = end_round(why, /*failure=*/false); !s.ok()) return s.status();
        }
      } else if ((*present)[1]) {
        break;  // the round ended before it closed: join the next one
      } else {
        auto joined = store_.add(round_key("joined"), 0);
        if (!joined.ok()) return joined.status();
        const absl::Time now = absl::Now();
        if (*joined >= options_.min_nodes && !min_since) min_since = now;
        if (options_.waiting && !said_waiting && *joined < options_.max_nodes) {
          said_waiting = true;
          options_.waiting(k, *joined);
        }
        // After the last call, and once the returning nodes are in, or have taken as long as a lost node would (with
        // the defaults, last call 30 s, that time, 15 s, has passed already: nothing waits longer than before).
        const bool last_call_over = min_since && now >= *min_since + options_.last_call_timeout &&
                                    (*joined >= *expected || now >= entered + lost_after);
        if (outvoted) {
          // The node that won the vote has not published the round in the time its store calls may take (3 after its
          // vote, each within a lost node's time, as tandem-run sets the store's timeout; one more to spare): it died,
          // or its calls failed, between its vote and "closed". The round ends, not a failure, and every node
          // re-forms, instead of waiting for it until the join timeout.
          constexpr int kCloserCalls = 4;
          if (absl::Now() >= *outvoted + kCloserCalls * lost_after && !ended_unpublished) {
            ended_unpublished = true;
            if (auto s = end_round(absl::StrCat("the node that closed round ", k, " never published it"),
                                   /*failure=*/false);
                !s.ok()) {
              return s.status();
            }
          }
        } else if (*joined >= options_.max_nodes || last_call_over) {
          auto vote = store_.add(round_key("close"), 1);
          if (!vote.ok()) return vote.status();
          if (*vote != 1) outvoted = absl::Now();  // after the vote: the closer's calls begin no earlier
          if (*vote == 1) {  // this node closes the round: the first arrivals up to max_nodes are in
            auto final_count = store_.add(round_key("joined"), 0);
            auto failures = store_.add(key("failures"), 0);
            if (!final_count.ok()) return final_count.status();
            if (!failures.ok()) return failures.status();
            pb::ElasticRound closed;
            closed.set_wire_version(rpc::kWireVersion);
            closed.set_nodes(static_cast<int32_t>(std::min<int64_t>(*final_count, options_.max_nodes)));
            closed.set_restarts(static_cast<int32_t>(*failures));
            if (auto s = store_.set(round_key("closed"), closed.SerializeAsString()); !s.ok()) return s;
            continue;
          }
        }
      }
      if (options_.interrupted && options_.interrupted()) {
        // Left first, so that the next round does not count this node among those coming back; then the round ends
        // if this node was to be in it (not closed yet). A node waiting for a place in a closed round ends nothing.
        const std::string why =
            absl::StrCat("node ", options_.host, " (launcher pid ", getpid(), ") left while joining round ", k);
        index_ = index;  // leave() now, and the launcher's own later, say this node's place in round k
        if (auto s = leave(); !s.ok()) return s;
        if (!(*present)[0] && !(*present)[1] && index < options_.max_nodes) {  // it was to be a member
          if (auto e = end_round(why, /*failure=*/false); !e.ok()) return e.status();
        }
        return absl::CancelledError(absl::StrCat("rendezvous '", options_.run_id, "': ", why));
      }
      if (absl::Now() > deadline) {
        auto joined = store_.add(round_key("joined"), 0);
        return absl::DeadlineExceededError(
            absl::StrCat("rendezvous '", options_.run_id, "': ",
                         asked_to_end || (*present)[0] ? "the job is full: this node waited for a place"
                                                       : absl::StrCat("only ", joined.ok() ? *joined : 0, " of the ",
                                                                      options_.min_nodes, " nodes needed joined"),
                         " within the join timeout (", seconds(options_.join_timeout), ")"));
      }
      std::this_thread::sleep_for(to_ms(options_.poll_interval));
    }
    ++k;
  }
}

absl::StatusOr<Round> Rendezvous::finish_join(int64_t k, int index, int nodes, int restarts) {
  const absl::Duration lost_after = options_.keep_alive_interval * options_.keep_alive_max_attempt;
  std::vector<std::string> keys;
  for (int i = 0; i < nodes; ++i) keys.push_back(round_key(absl::StrCat("node/", i)));
  if (auto s = store_.wait(keys, to_ms(lost_after)); !s.ok()) {
    if (s.code() != absl::StatusCode::kDeadlineExceeded) return s;
    // A launcher counted itself in and died before it said where it is: re-form without it.
    if (auto e = end_round(absl::StrCat("a node joined round ", k, " but never published its address"),
                           /*failure=*/false);
        !e.ok()) {
      return e.status();
    }
    return absl::AbortedError("re-form");
  }
  Round r;
  r.round = k;
  r.node_rank = index;
  r.nnodes = nodes;
  r.restarts = restarts;
  for (int i = 0; i < nodes; ++i) {
    auto bytes = store_.get(keys[i], to_ms(options_.keep_alive_interval));
    if (!bytes.ok()) return bytes.status();
    auto node = detail::parse_node(*bytes, keys[i]);
    if (!node.ok()) return node.status();
    if (i < index) r.rank_offset += node->nproc();
    r.world_size += node->nproc();
    if (i == 0) {
      r.master_addr = node->host();
      r.master_port = node->master_port();
    }
  }
  index_ = index;
  nnodes_ = nodes;
  seen_beats_.assign(nodes, -1);
  seen_at_.assign(nodes, absl::Now());
  next_beat_ = absl::InfinitePast();
  return r;
}

absl::Status Rendezvous::heartbeat_check() {
  const absl::Time now = absl::Now();
  if (now < next_beat_) return absl::OkStatus();
  next_beat_ = now + options_.keep_alive_interval;
  if (auto s = store_.add(round_key(absl::StrCat("hb/", index_)), 1); !s.ok()) return s.status();
  const absl::Duration lost_after = options_.keep_alive_interval * options_.keep_alive_max_attempt;
  for (int j = 0; j < nnodes_; ++j) {
    if (j == index_) continue;
    auto beats = store_.add(round_key(absl::StrCat("hb/", j)), 0);
    if (!beats.ok()) return beats.status();
    if (*beats != seen_beats_[j]) {
      seen_beats_[j] = *beats;
      seen_at_[j] = now;
    } else if (now - seen_at_[j] > lost_after) {
      std::string who = absl::StrCat("node ", j);
      if (auto bytes = store_.get(round_key(absl::StrCat("node/", j)), to_ms(options_.keep_alive_interval));
          bytes.ok()) {
        if (auto node = detail::parse_node(*bytes, "node"); node.ok()) {
          absl::StrAppend(&who, " (", node->host(), ", launcher pid ", node->pid(), ")");
        }
      }
      // Not waited for in the next round (expected_in).
      if (auto s = store_.set(round_key(absl::StrCat("lost/", j)), ""); !s.ok()) return s;
      return end_round(absl::StrCat(who, " missed its heartbeats for ", seconds(now - seen_at_[j])),
                       /*failure=*/true)
          .status();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<RoundEnd>> Rendezvous::monitor() {
  if (index_ < 0) return absl::FailedPreconditionError("rendezvous: monitor() before join()");
  auto e = ended();
  if (!e.ok() || e->has_value()) return e;
  if (auto s = heartbeat_check(); !s.ok()) return s;
  return ended();
}

absl::Status Rendezvous::report_success() { return store_.set(round_key(absl::StrCat("ok/", index_)), ""); }

absl::StatusOr<bool> Rendezvous::all_succeeded() {
  std::vector<std::string> keys;
  for (int i = 0; i < nnodes_; ++i) keys.push_back(round_key(absl::StrCat("ok/", i)));
  auto present = store_.check(keys);
  if (!present.ok()) return present.status();
  return std::all_of(present->begin(), present->end(), [](bool b) { return b; });
}

absl::Status Rendezvous::leave() { return store_.set(round_key(absl::StrCat("left/", index_)), ""); }

absl::Status Rendezvous::wait_all_left(absl::Duration timeout) {
  std::vector<std::string> keys;
  for (int i = 0; i < nnodes_; ++i) keys.push_back(round_key(absl::StrCat("left/", i)));
  return store_.wait(keys, to_ms(timeout));
}

absl::StatusOr<std::vector<std::string>> Rendezvous::failures() {
  auto n = store_.add(key("failures"), 0);
  if (!n.ok()) return n.status();
  // A counter no launcher wrote (a damaged or foreign store) would have this wait a keep-alive interval per count.
  if (*n < 0 || *n > detail::kMaxCount) {
    return absl::DataLossError(absl::StrCat("rendezvous: the counter at ", key("failures"), " reads ", *n));
  }
  std::vector<std::string> out;
  for (int64_t i = 1; i <= *n; ++i) {
    auto reason = store_.get(key(absl::StrCat("failure/", i)), to_ms(options_.keep_alive_interval));
    out.push_back(reason.ok() ? *reason : absl::StrCat("(failure ", i, ": ", reason.status().message(), ")"));
  }
  return out;
}

}  // namespace tandem::elastic

namespace tandem::elastic {

bool is_this_machine(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool local = false;
  for (addrinfo* a = found; a && !local; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    // Port 0 of the address: binding works exactly when the address is one of this machine's.
    if (a->ai_family == AF_INET) reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_port = 0;
    if (a->ai_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_port = 0;
    local = bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
  }
  freeaddrinfo(found);
  return local;
}

absl::StatusOr<std::string> address_towards(const std::string& host) { return rpc::net::local_address_towards(host); }

}  // namespace tandem::elastic
