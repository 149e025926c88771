// The launchers' rendezvous (elastic/rendezvous.h), several "nodes" as threads of one process, on each backend: a
// Tandem store served on 127.0.0.1, and a real etcd (Debian's etcd-server) started on 127.0.0.1 for each test, with
// ports chosen at run time. The launchers themselves: tests/elastic/launchers.sh.
#include "tandem/elastic/rendezvous.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/store.h"
#include "tests/common/files.h"
#include "tests/common/time_scale.h"

namespace tandem::elastic {
namespace {

constexpr char kSecret[] = "elastic-test-secret";

// A free port for etcd and the stores (rpc/detail/net.h: below the ephemeral range, so no port another test binds
// to port 0 or connects from can take it before the listener binds it).
int free_port() {
  auto port = rpc::net::pick_listen_port();
  if (!port.ok()) throw std::runtime_error(port.status().ToString());
  return *port;
}

// The last 2000 bytes of the file at `path` (its directory is removed with the test's etcd).
std::string read_log(const std::string& path) {
  const std::string text = test::read_file(path);
  return text.size() > 2000 ? text.substr(text.size() - 2000) : text;
}

// A one-member etcd cluster on 127.0.0.1, in a temporary directory, for one test.
class Etcd {
 public:
  ~Etcd() { stop(); }
  // Starts it and waits until it answers; false (and a reason in `why`) when it cannot.
  bool start(std::string* why) {
    char tmpl[] = "/tmp/tandem-etcd-XXXXXX";
    if (!::mkdtemp(tmpl)) {
      *why = std::string("mkdtemp: ") + std::strerror(errno);
      return false;
    }
    dir_ = tmpl;
    const int client = free_port(), peer = free_port();
    endpoint_ = "127.0.0.1:" + std::to_string(client);
    const std::string c = "http://" + endpoint_, p = "http://127.0.0.1:" + std::to_string(peer);
    // Made before the fork (strings, files): the child makes only async-signal-safe calls, then execs (this process
    // may have threads holding malloc's locks).
    const std::string log = dir_ + "/etcd.log", data = dir_ + "/data", cluster = "t=" + p;
    const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (log_fd < 0 || null_fd < 0) {
      *why = "cannot open " + log + " or /dev/null: " + std::strerror(errno);
      return false;
    }
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test killed at its ctest timeout leaves no etcd behind
      if (::getppid() != parent) ::_exit(1);
      ::dup2(log_fd, STDERR_FILENO);  // dup2's copies do not close on exec
      ::dup2(null_fd, STDOUT_FILENO);
      ::execl("/usr/bin/etcd", "etcd", "--name", "t", "--data-dir", data.c_str(), "--listen-client-urls", c.c_str(),
              "--advertise-client-urls", c.c_str(), "--listen-peer-urls", p.c_str(), "--initial-advertise-peer-urls",
              p.c_str(), "--initial-cluster", cluster.c_str(), nullptr);
      ::_exit(127);
    }
    ::close(log_fd);
    ::close(null_fd);
    auto probe = connect_etcd_store(endpoint_, std::chrono::milliseconds(500));
    for (int i = 0; i < 100; ++i) {
      if (probe->check({"probe"}).ok()) return true;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        *why = "etcd exited at start; its log: " + read_log(log);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    *why = "etcd did not answer within 10 s";
    return false;
  }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
    dir_.clear();
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  pid_t pid_ = -1;
  std::string dir_, endpoint_;
};

// Every test on each backend: "tandem" (the c10d-style store one launcher serves) and "etcd".
class UnitElastic : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "etcd") {
      // The test command installs etcd (scripts/setup.sh): elsewhere the etcd cases are skipped, saying why; an
      // installed etcd that does not start is a failure.
      if (::access("/usr/bin/etcd", X_OK) != 0) {
        GTEST_SKIP() << "etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)";
      }
      std::string why;
      ASSERT_TRUE(etcd_.start(&why)) << why;
      return;
    }
    auto s = rpc::serve_store("127.0.0.1:0", kSecret);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }
  std::unique_ptr<rpc::Store> store(std::chrono::milliseconds op_timeout = std::chrono::seconds(10)) {
    if (GetParam() == "etcd") return connect_etcd_store(etcd_.endpoint(), op_timeout);
    return rpc::connect_store(address_, kSecret, op_timeout);
  }
  // The store goes away (its launcher, or the etcd cluster, died).
  void lose_store() {
    server_.reset();
    etcd_.stop();
  }

  RendezvousOptions node(const std::string& host, int min, int max, int nproc = 1) {
    RendezvousOptions o;
    o.run_id = "job";
    o.min_nodes = min;
    o.max_nodes = max;
    o.nproc = nproc;
    o.host = host;
    o.master_port = 1000 + static_cast<int>(host.back());
    o.join_timeout = absl::Seconds(20);
    o.last_call_timeout = absl::Milliseconds(300);
    o.keep_alive_interval = absl::Milliseconds(50);
    o.keep_alive_max_attempt = 3;
    o.poll_interval = absl::Milliseconds(5);
    return o;
  }

  Etcd etcd_;
  std::unique_ptr<rpc::StoreServer> server_;
  std::string address_;
};

// Runs monitor() until the round ends (or `limit` passes).
std::optional<RoundEnd> monitor_until_end(Rendezvous& r, absl::Duration limit) {
  const absl::Time stop = absl::Now() + limit;
  while (absl::Now() < stop) {
    auto e = r.monitor();
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return std::nullopt;
    if (e->has_value()) return **e;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return std::nullopt;
}

// Every node joins its next round at the same time; their rounds, in the nodes' order.
std::vector<absl::StatusOr<Round>> join_together(const std::vector<Rendezvous*>& nodes) {
  std::vector<std::future<absl::StatusOr<Round>>> joins;
  for (Rendezvous* n : nodes) joins.push_back(std::async(std::launch::async, [n] { return n->join(); }));
  std::vector<absl::StatusOr<Round>> rounds;
  for (auto& j : joins) rounds.push_back(j.get());
  return rounds;
}

// Every node ends its round at the same time as a failure ("node <i> failed"); their ends, in the nodes' order.
std::vector<absl::StatusOr<RoundEnd>> end_together(const std::vector<Rendezvous*>& nodes) {
  std::vector<std::future<absl::StatusOr<RoundEnd>>> ends;
  for (size_t i = 0; i < nodes.size(); ++i) {
    Rendezvous* n = nodes[i];
    ends.push_back(
        std::async(std::launch::async, [n, i] { return n->end_round(absl::StrCat("node ", i, " failed"), true); }));
  }
  std::vector<absl::StatusOr<RoundEnd>> out;
  for (auto& e : ends) out.push_back(e.get());
  return out;
}

// A node's store whose first add to `key` stalls once made, until release() (or a minute): the node voted, then
// stopped (its process paused, its store slow) while the others went on.
class StallAfterAdd : public rpc::Store {
 public:
  StallAfterAdd(std::unique_ptr<rpc::Store> inner, std::string key)
      : inner_(std::move(inner)), key_(std::move(key)), released_(release_.get_future()) {}
  // Ready once the add has been made and stalls. Called once.
  std::future<void> stalled() { return stalled_.get_future(); }
  // Called once.
  void release() { release_.set_value(); }

  absl::StatusOr<int64_t> add(const std::string& key, int64_t delta) override {
    auto n = inner_->add(key, delta);
    if (key == key_ && !done_) {
      done_ = true;
      stalled_.set_value();
      (void)released_.wait_for(std::chrono::minutes(1));
    }
    return n;
  }
  absl::Status set(const std::string& key, const std::string& value) override { return inner_->set(key, value); }
  absl::StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->get(key, timeout);
  }
  absl::Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    return inner_->wait(keys, timeout);
  }
  absl::StatusOr<std::vector<bool>> check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  absl::Status remove(const std::string& key) override { return inner_->remove(key); }

 private:
  std::unique_ptr<rpc::Store> inner_;
  const std::string key_;
  bool done_ = false;  // used by its Rendezvous's one thread
  std::promise<void> stalled_, release_;
  std::future<void> released_;
};

TEST_P(UnitElastic, ARoundAtMaxNodesClosesAtOnceWithRanksInArrivalOrder) {
  auto sa = store(), sb = store(), sc = store();
  // A last call longer than the join timeout: had the round waited for it at max_nodes, join() would fail.
  auto opts = [&](const std::string& host, int nproc) {
    auto o = node(host, 2, 3, nproc);
    o.last_call_timeout = absl::Hours(1);
    o.join_timeout = absl::Seconds(10);
    return o;
  };
  Rendezvous a(*sa, opts("hostA", 2)), b(*sb, opts("hostB", 1)), c(*sc, opts("hostC", 4));
  // Arrivals one after another, so the order is known.
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  while (sa->add("rdzv/job/r0/joined", 0).value_or(0) < 1) absl::SleepFor(absl::Milliseconds(1));
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  while (sa->add("rdzv/job/r0/joined", 0).value_or(0) < 2) absl::SleepFor(absl::Milliseconds(1));
  auto rc = c.join();
  auto ra = fa.get(), rb = fb.get();
  ASSERT_TRUE(ra.ok() && rb.ok() && rc.ok()) << ra.status() << rb.status() << rc.status();
  EXPECT_EQ(ra->node_rank, 0);
  EXPECT_EQ(rb->node_rank, 1);
  EXPECT_EQ(rc->node_rank, 2);
  for (const Round* r : {&*ra, &*rb, &*rc}) {
    EXPECT_EQ(r->round, 0);
    EXPECT_EQ(r->nnodes, 3);
    EXPECT_EQ(r->world_size, 7);
    EXPECT_EQ(r->master_addr, "hostA");
    EXPECT_EQ(r->master_port, 1000 + 'A');
    EXPECT_EQ(r->restarts, 0);
  }
  EXPECT_EQ(ra->rank_offset, 0);
  EXPECT_EQ(rb->rank_offset, 2);
  EXPECT_EQ(rc->rank_offset, 3);
}

TEST_P(UnitElastic, ALateNodeWaitsThenTheJobReformsWithItAndThatIsNoFailure) {
  auto sa = store(), sb = store(), sc = store();
  // b is not monitored (it beats) while a's monitor waits for c's join to end the round: with the 150 ms of the
  // others, a slow join (ThreadSanitizer, etcd) had a lose b first and end the round as a failure.
  RendezvousOptions oa = node("hostA", 2, 4), ob = node("hostB", 2, 4), oc = node("hostC", 2, 4);
  for (auto* o : {&oa, &ob, &oc}) o->keep_alive_interval = absl::Milliseconds(500);  // lost after 1.5 s
  Rendezvous a(*sa, oa), b(*sb, ob), c(*sc, oc);
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  auto rb = b.join();
  auto ra = fa.get();
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
  EXPECT_EQ(ra->nnodes, 2);  // closed after the last call, with min_nodes

  // A third node arrives while round 0 runs: it ends the round and the three form round 1.
  auto fc = std::async(std::launch::async, [&] { return c.join(); });
  auto ea = monitor_until_end(a, absl::Seconds(10));
  auto eb = monitor_until_end(b, absl::Seconds(10));
  ASSERT_TRUE(ea && eb);
  EXPECT_FALSE(ea->failure);
  EXPECT_NE(ea->reason.find("hostC"), std::string::npos) << ea->reason;
  EXPECT_NE(ea->reason.find("waiting to join"), std::string::npos) << ea->reason;
  auto fa1 = std::async(std::launch::async, [&] { return a.join(); });
  auto rb1 = b.join();
  auto ra1 = fa1.get(), rc1 = fc.get();
  ASSERT_TRUE(ra1.ok() && rb1.ok() && rc1.ok()) << ra1.status() << rb1.status() << rc1.status();
  EXPECT_EQ(ra1->round, 1);
  EXPECT_EQ(ra1->nnodes, 3);
  EXPECT_EQ(rc1->world_size, 3);
  std::set<int> ranks{ra1->node_rank, rb1->node_rank, rc1->node_rank};
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(ra1->restarts, 0) << "a membership change counted as a restart";
  EXPECT_TRUE(a.failures().value().empty());
}

// A node waiting for a place ends the running round and joins the next at once; the round's member, still stopping
// its workers, arrives later than the last call. The next round waits for it (up to the time that would make it a
// lost node): before, the waiting node closed that round alone, a round started only to end.
TEST_P(UnitElastic, TheNextRoundWaitsForThePreviousRoundsNodesStoppingTheirWorkers) {
  auto sa = store(), sc = store();
  RendezvousOptions oa = node("hostA", 1, 2), oc = node("hostC", 1, 2);
  for (auto* o : {&oa, &oc}) o->keep_alive_interval = absl::Milliseconds(500);  // lost after 1.5 s
  Rendezvous a(*sa, oa), c(*sc, oc);
  auto ra = a.join();
  ASSERT_TRUE(ra.ok()) << ra.status();
  EXPECT_EQ(ra->nnodes, 1);
  auto fc = std::async(std::launch::async, [&] { return c.join(); });
  auto ea = monitor_until_end(a, absl::Seconds(10));
  ASSERT_TRUE(ea);
  EXPECT_NE(ea->reason.find("waiting to join"), std::string::npos) << ea->reason;
  absl::SleepFor(absl::Milliseconds(800));  // a stops its workers: longer than the last call (300 ms)
  auto ra1 = a.join();
  auto rc1 = fc.get();
  ASSERT_TRUE(ra1.ok() && rc1.ok()) << ra1.status() << rc1.status();
  EXPECT_EQ(rc1->round, 1);
  EXPECT_EQ(rc1->nnodes, 2) << "the waiting node formed round 1 alone";
  EXPECT_EQ(ra1->round, 1);
  EXPECT_EQ(ra1->nnodes, 2);
}

TEST_P(UnitElastic, AnInterruptedJoinLeavesAtOnceAndTheOthersReformWithoutIt) {
  auto sa = store(), sb = store();
  RendezvousOptions ob = node("hostB", 2, 2);  // waits for a second node
  std::atomic<bool> stop{false};
  ob.interrupted = [&stop] { return stop.load(); };
  Rendezvous b(*sb, ob);
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time asked = absl::Now();
  stop = true;  // the launcher got SIGTERM while it waited
  auto rb = fb.get();
  EXPECT_EQ(rb.status().code(), absl::StatusCode::kCancelled) << rb.status();
  EXPECT_NE(rb.status().message().find("node hostB (launcher pid"), std::string::npos) << rb.status();
  // Not after the join timeout (20 s here): at its next look at the store.
  EXPECT_LT(absl::Now() - asked, absl::FromChrono(test::scaled(std::chrono::milliseconds(5000))));

  // The round it waited in ended as a leave, not a failure; a node that comes now forms the next round alone.
  Rendezvous a(*sa, node("hostA", 1, 2));
  auto ra = a.join();
  ASSERT_TRUE(ra.ok()) << ra.status();
  EXPECT_EQ(ra->round, 1);
  EXPECT_EQ(ra->nnodes, 1);
  EXPECT_EQ(ra->restarts, 0);
  auto failures = a.failures();
  ASSERT_TRUE(failures.ok());
  EXPECT_TRUE(failures->empty());
}

TEST_P(UnitElastic, ANodeThatStopsBeatingIsDroppedWithinTheStatedTime) {
  auto sa = store(), sb = store();
  Rendezvous a(*sa, node("hostA", 1, 2)), b(*sb, node("hostB", 1, 2));
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  auto ra = a.join();
  ASSERT_TRUE(ra.ok() && fb.get().ok());
  ASSERT_FALSE(b.monitor().value().has_value());
  // b beats once, then falls silent (its launcher died). The others drop it within keep_alive_interval ×
  // keep_alive_max_attempt (150 ms) plus one interval between checks.
  const absl::Time silent = absl::Now();
  auto end = monitor_until_end(a, absl::FromChrono(test::scaled(std::chrono::milliseconds(10000))));
  const absl::Duration took = absl::Now() - silent;
  ASSERT_TRUE(end);
  EXPECT_TRUE(end->failure);
  EXPECT_NE(end->reason.find(" (hostB, launcher pid"), std::string::npos) << end->reason;
  EXPECT_NE(end->reason.find("missed its heartbeats"), std::string::npos) << end->reason;
  // A bound, not a timing claim: the stated bound is 0.2 s here.
  EXPECT_LT(took, absl::FromChrono(test::scaled(std::chrono::milliseconds(5000))));
  auto failures = a.failures();
  ASSERT_TRUE(failures.ok());
  ASSERT_EQ(failures->size(), 1u);
  EXPECT_EQ((*failures)[0], end->reason);

  // The survivor carries on alone (min_nodes 1), and the restart is counted.
  auto again = a.join();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->nnodes, 1);
  EXPECT_EQ(again->restarts, 1);
}

TEST_P(UnitElastic, TheFirstEndOfARoundWinsAndAFailureCountsOnce) {
  auto sa = store(), sb = store();
  Rendezvous a(*sa, node("hostA", 2, 2)), b(*sb, node("hostB", 2, 2));
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  ASSERT_TRUE(a.join().ok());
  ASSERT_TRUE(fb.get().ok());
  auto won = b.end_round("rank 1 failed first", true);
  ASSERT_TRUE(won.ok());
  EXPECT_EQ(won->reason, "rank 1 failed first");
  // The later end learns which one won (the launcher names that cause, not its own workers' failure after it).
  auto lost = a.end_round("rank 0 failed second", true);
  ASSERT_TRUE(lost.ok());
  EXPECT_EQ(lost->reason, "rank 1 failed first");
  EXPECT_TRUE(lost->failure);
  auto end = a.monitor();
  ASSERT_TRUE(end.ok() && end->has_value());
  EXPECT_EQ((*end)->reason, "rank 1 failed first");
  EXPECT_EQ(a.failures().value(), std::vector<std::string>{"rank 1 failed first"});
  // Both join round 1, whose restart count says one failure happened.
  auto fb1 = std::async(std::launch::async, [&] { return b.join(); });
  auto ra1 = a.join();
  ASSERT_TRUE(ra1.ok() && fb1.get().ok());
  EXPECT_EQ(ra1->round, 1);
  EXPECT_EQ(ra1->restarts, 1);
}

// A node that won the vote to close round 0 and died before publishing it (its vote here, its "closed" never): the
// others end the round once a lost node's time passed and re-form in round 1, not a failure, instead of waiting for
// it until the join timeout (20 s here).
TEST_P(UnitElastic, ARoundWhoseCloserNeverPublishedItEndsAndTheNodesReform) {
  auto sa = store(), sb = store();
  ASSERT_EQ(sa->add("rdzv/job/r0/close", 1).value_or(0), 1);
  Rendezvous a(*sa, node("hostA", 2, 2)), b(*sb, node("hostB", 2, 2));
  const absl::Time t0 = absl::Now();
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  auto ra = a.join();
  auto rb = fb.get();
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  EXPECT_EQ(ra->round, 1);
  EXPECT_EQ(rb->round, 1);
  EXPECT_EQ(ra->restarts, 0);
  EXPECT_EQ(ra->nnodes, 2);
  EXPECT_EQ(a.failures().value(), std::vector<std::string>{});
}

// A node that won the vote to end a round and died before recording the end (its vote here, its "ended" never; in
// round 1 it had also claimed the right to write it, r1/publish/0): the outvoted nodes, ending the round at the same
// time, take the end over once a lost node's time has passed. One of them records it and the other reads it, the
// failure counts once and the round counter moves on once a round, and the nodes re-form. Before, each outvoted
// end_round failed (DEADLINE_EXCEEDED) after that time and the round never ended: the job could not re-form.
TEST_P(UnitElastic, ARoundWhoseEnderDiedBeforeRecordingItIsEndedOnceByTheOthers) {
  auto sa = store(), sb = store();
  auto opts = [&](const std::string& host) {
    auto o = node(host, 2, 2);
    o.keep_alive_interval = absl::Milliseconds(100);  // lost after 300 ms; a claimer waited for 6 x that
    return o;
  };
  Rendezvous a(*sa, opts("hostA")), b(*sb, opts("hostB"));
  for (int k = 0; k < 2; ++k) {
    auto joined = join_together({&a, &b});
    ASSERT_TRUE(joined[0].ok() && joined[1].ok()) << joined[0].status() << joined[1].status();
    ASSERT_EQ(joined[0]->round, k);
    EXPECT_EQ(joined[0]->restarts, k);
    const std::string r = absl::StrCat("rdzv/job/r", k, "/");
    ASSERT_EQ(sa->add(r + "end", 1).value_or(0), 1);
    if (k == 1) ASSERT_EQ(sa->add(r + "publish/0", 1).value_or(0), 1);
    auto ends = end_together({&a, &b});
    ASSERT_TRUE(ends[0].ok() && ends[1].ok()) << ends[0].status() << ends[1].status();
    EXPECT_EQ(ends[0]->reason, ends[1]->reason) << "both recorded an end";
    EXPECT_TRUE(ends[0]->failure);
    auto seen = a.monitor();
    ASSERT_TRUE(seen.ok() && seen->has_value()) << seen.status();
    EXPECT_EQ((*seen)->reason, ends[0]->reason);
    EXPECT_EQ(sa->add("rdzv/job/round", 0).value_or(-1), k + 1);
    EXPECT_EQ(a.failures().value().size(), static_cast<size_t>(k + 1));
  }
  auto joined = join_together({&a, &b});
  ASSERT_TRUE(joined[0].ok() && joined[1].ok()) << joined[0].status() << joined[1].status();
  EXPECT_EQ(joined[0]->round, 2);
  EXPECT_EQ(joined[1]->round, 2);
  EXPECT_EQ(joined[0]->restarts, 2);
}

// The node that won the vote to end a round was only slow: it stalls right after its vote while the others, ending
// the round too, take the end over. When it goes on it records nothing of its own: it returns the end they recorded,
// the failure has counted once and the round counter moved on once (the three meet again in round 1, not 2).
TEST_P(UnitElastic, AnEnderThatWasOnlySlowFindsTheEndTakenOverAndRecordsNothing) {
  auto sa = store(), sb = store();
  StallAfterAdd sc(store(), "rdzv/job/r0/end");
  auto opts = [&](const std::string& host) {
    auto o = node(host, 3, 3);
    o.keep_alive_interval = absl::Milliseconds(100);  // lost after 300 ms
    return o;
  };
  Rendezvous a(*sa, opts("hostA")), b(*sb, opts("hostB")), c(sc, opts("hostC"));
  auto joined = join_together({&a, &b, &c});
  for (const auto& j : joined) ASSERT_TRUE(j.ok()) << j.status();
  std::future<void> stalled = sc.stalled();
  auto fc = std::async(std::launch::async, [&] { return c.end_round("the slow node's end", true); });
  ASSERT_EQ(stalled.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto ends = end_together({&a, &b});
  sc.release();
  auto ec = fc.get();
  ASSERT_TRUE(ends[0].ok() && ends[1].ok() && ec.ok()) << ends[0].status() << ends[1].status() << ec.status();
  EXPECT_EQ(ends[0]->reason, ends[1]->reason);
  EXPECT_EQ(ec->reason, ends[0]->reason) << "the slow node recorded its own end after the others'";
  EXPECT_EQ(a.failures().value(), std::vector<std::string>{ends[0]->reason});
  EXPECT_EQ(sa->add("rdzv/job/round", 0).value_or(-1), 1);
  joined = join_together({&a, &b, &c});
  for (const auto& j : joined) {
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->round, 1);
    EXPECT_EQ(j->restarts, 1);
  }
}

// A round's checks name a key per node, beyond the 128 operations etcd takes in one transaction.
TEST_P(UnitElastic, TheStoreChecksAndWaitsForMoreKeysThanOneTransactionHolds) {
  auto st = store();
  std::vector<std::string> keys, set;
  for (int i = 0; i < 300; ++i) {
    keys.push_back(absl::StrCat("many/", i));
    if (i % 3 != 1) {
      ASSERT_TRUE(st->set(keys.back(), "x").ok());
      set.push_back(keys.back());
    }
  }
  auto present = st->check(keys);
  ASSERT_TRUE(present.ok()) << present.status();
  ASSERT_EQ(present->size(), keys.size());
  for (int i = 0; i < 300; ++i) EXPECT_EQ((*present)[i], i % 3 != 1) << keys[i];
  EXPECT_TRUE(st->wait(set, std::chrono::seconds(10)).ok());
  EXPECT_EQ(st->wait(keys, std::chrono::milliseconds(200)).code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_P(UnitElastic, SuccessIsTheJobsOnlyWhenEveryNodeSucceeded) {
  auto sa = store(), sb = store();
  Rendezvous a(*sa, node("hostA", 2, 2)), b(*sb, node("hostB", 2, 2));
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  ASSERT_TRUE(a.join().ok());
  ASSERT_TRUE(fb.get().ok());
  ASSERT_TRUE(a.report_success().ok());
  EXPECT_FALSE(a.all_succeeded().value());
  ASSERT_TRUE(b.report_success().ok());
  EXPECT_TRUE(a.all_succeeded().value());
  ASSERT_TRUE(b.leave().ok());
  EXPECT_EQ(a.wait_all_left(absl::Milliseconds(100)).code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(a.leave().ok());
  EXPECT_TRUE(a.wait_all_left(absl::Seconds(5)).ok());
}

TEST_P(UnitElastic, TooFewNodesWithinTheJoinTimeoutIsAnErrorSayingHowMany) {
  auto s = store();
  auto o = node("hostA", 2, 3);
  o.join_timeout = absl::Milliseconds(200);
  Rendezvous a(*s, o);
  auto r = a.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("only 1 of the 2 nodes needed joined"), std::string::npos) << r.status();
}

TEST_P(UnitElastic, ARecordOfAnotherBuildIsRefusedNamingBothVersions) {
  auto s = store();
  wire::ElasticRound other;
  other.set_wire_version(99);
  other.set_nodes(1);
  ASSERT_TRUE(s->set("rdzv/job/r0/closed", other.SerializeAsString()).ok());
  Rendezvous a(*s, node("hostA", 1, 1));
  auto r = a.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("wire version 99"), std::string::npos) << r.status();
}

TEST_P(UnitElastic, AStoreThatIsGoneIsUnavailableNotAHang) {
  auto s = store(std::chrono::milliseconds(300));
  lose_store();
  auto o = node("hostA", 1, 1);
  Rendezvous a(*s, o);
  const absl::Time start = absl::Now();
  auto r = a.join();
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(r.status().code() == absl::StatusCode::kUnavailable ||
              r.status().code() == absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_LT(absl::Now() - start, absl::FromChrono(test::scaled(std::chrono::milliseconds(10000))));
}

INSTANTIATE_TEST_SUITE_P(UnitElastic, UnitElastic, ::testing::Values("tandem", "etcd"),
                         [](const auto& info) { return info.param; });

TEST(UnitElasticStore, ThePortIsNeverShared) {
  auto first = rpc::serve_store("127.0.0.1:0", kSecret);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = rpc::serve_store("127.0.0.1:" + std::to_string((*first)->port()), kSecret);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(is_this_machine("127.0.0.1"));
  EXPECT_FALSE(is_this_machine("192.0.2.1"));  // TEST-NET-1: never a local address
}

}  // namespace
}  // namespace tandem::elastic
