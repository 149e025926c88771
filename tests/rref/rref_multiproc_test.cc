// RRefs across real processes: the test process is rank 0, ranks 1.. are `rref_tests --worker serve` children.
#include <ATen/ATen.h>
#include <signal.h>

#include <thread>

#include "tandem/rref/rref.h"
#include "tests/common/rpc_fixture.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

class MultiprocRRef : public MultiprocRpc {
 protected:
  // Stats of worker `rank` (this one included): owned, known forks, user refs, pending children, pending confirmations.
  static std::vector<int64_t> stats_of(int rank) { return rpc::rpc_sync<std::vector<int64_t>>(rank, "rref_stats"); }

  // Waits (bounded) until every worker's counts are zero; returns the last counts seen otherwise.
  static std::string wait_all_zero(int world, milliseconds timeout) {
    const auto deadline = Clock::now() + scaled(timeout);
    std::string last;
    for (;;) {
      bool zero = true;
      last.clear();
      for (int r = 0; r < world; ++r) {
        auto s = stats_of(r);
        for (auto v : s) zero &= v == 0;
        last += "rank " + std::to_string(r) + ": [" + std::to_string(s[0]) + " " + std::to_string(s[1]) + " " +
                std::to_string(s[2]) + " " + std::to_string(s[3]) + " " + std::to_string(s[4]) + "] ";
      }
      if (zero) return "";
      if (Clock::now() > deadline) return last;
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
};

TEST_F(MultiprocRRef, RemoteReturnsAtOnceAndToHereFetches) {
  start({.world_size = 2});
  rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{5});
  EXPECT_EQ(r.owner(), 1);
  EXPECT_EQ(r.owner_name(), "worker1");
  EXPECT_FALSE(r.is_owner());
  EXPECT_TRUE(r.to_here<at::Tensor>().equal(at::arange(5, at::kFloat)));
  // The creation's acknowledgement travels independently of the fetch: confirmation follows, it need not precede.
  EXPECT_TRUE(poll_until(scaled(milliseconds(10000)), [&] { return r.confirmed_by_owner(); }));
  EXPECT_THROW(r.local_value(), RpcError);  // only the owner holds the value
  rref::TypedRRef<at::Tensor> typed = rref::remote_as<at::Tensor>(1, "make_tensor", int64_t{3});
  EXPECT_TRUE(typed.to_here().equal(at::arange(3, at::kFloat)));
  rref::TypedRRef<std::string> wrong = rref::remote_as<std::string>(1, "make_tensor", int64_t{3});
  try {
    wrong.to_here();  // the value is not a string
    FAIL() << "a tensor converted to a string";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument) << e.what();
  }
}

TEST_F(MultiprocRRef, EveryForkPath) {
  start({.world_size = 3});
  rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{5});  // sum 10
  using SumResult = std::tuple<double, bool, bool>;
  // user -> owner: the owner sees its own value.
  EXPECT_EQ(rpc::rpc_sync<SumResult>("worker1", "sum_rref", r.to_ivalue()), SumResult(10, true, true));
  // user -> user: a new user reference, confirmed by the owner before the function runs.
  EXPECT_EQ(rpc::rpc_sync<SumResult>("worker2", "sum_rref", r.to_ivalue()), SumResult(10, false, true));
  // owner -> user, as a return value.
  rref::RRef owned_by_1 = rref::RRef::from_ivalue(rpc::rpc_sync("worker1", "own_value", int64_t{3}));
  EXPECT_EQ(owned_by_1.owner(), 1);
  EXPECT_TRUE(owned_by_1.confirmed_by_owner());
  EXPECT_TRUE(owned_by_1.to_here<at::Tensor>().equal(at::full({3}, 2.0)));
  // Returned from a user (user -> user in a reply) and from the owner (owner -> user in a reply).
  rref::RRef via_user = rref::RRef::from_ivalue(rpc::rpc_sync("worker2", "echo_rref", r.to_ivalue()));
  rref::RRef via_owner = rref::RRef::from_ivalue(rpc::rpc_sync("worker1", "echo_rref", r.to_ivalue()));
  EXPECT_EQ(via_user.to_here<at::Tensor>().sum().item<double>(), 10);
  EXPECT_EQ(via_owner.to_here<at::Tensor>().sum().item<double>(), 10);
  // Owned here: owner -> user to worker1, and back to the owner (this worker).
  rref::RRef mine = rref::make_local(c10::IValue(at::ones({4})));
  EXPECT_TRUE(mine.is_owner());
  EXPECT_TRUE(mine.local_value().toTensor().equal(at::ones({4})));
  EXPECT_EQ(rpc::rpc_sync<SumResult>("worker1", "sum_rref", mine.to_ivalue()), SumResult(4, false, true));
  rref::RRef back = rref::RRef::from_ivalue(rpc::rpc_sync("worker1", "echo_rref", mine.to_ivalue()));
  EXPECT_TRUE(back.is_owner());
  // As arguments of remote(): to a user and to the owner; the results stay where they were computed.
  EXPECT_EQ(rref::remote("worker2", "sum_rref", r.to_ivalue()).to_here<SumResult>(), SumResult(10, false, true));
  EXPECT_EQ(rref::remote("worker1", "sum_rref", r.to_ivalue()).to_here<SumResult>(), SumResult(10, true, true));
}

// An RRef whose value is another RRef of the same owner: freeing the outer value releases the inner handle, which
// must not take the owner's lock again (it aborted the owner before).
TEST_F(MultiprocRRef, AnRRefOfAnRRefIsFreedWithItsValue) {
  start({.world_size = 2});
  rref::RRef inner = rref::remote("worker1", "make_tensor", int64_t{3});       // sum 3
  rref::RRef outer = rref::remote("worker1", "echo_rref", inner.to_ivalue());  // its value: a handle of `inner`
  rref::RRef fetched = rref::RRef::from_ivalue(outer.to_here());
  EXPECT_EQ(fetched.owner(), 1);
  EXPECT_EQ(fetched.to_here<at::Tensor>().sum().item<double>(), 3);
  outer = rref::RRef();  // worker1 frees the outer value, and with it its handle of `inner`
  fetched = rref::RRef();
  inner = rref::RRef();
  EXPECT_EQ(wait_all_zero(2, milliseconds(20000)), "");
}

TEST_F(MultiprocRRef, ChainsOfWorkers) {
  start({.world_size = 4});
  rref::RRef r = rref::remote("worker3", "make_tensor", int64_t{4});  // sum 6
  // A (rank 0) -> B -> C -> owner, and A -> B -> C ending on users.
  EXPECT_EQ(
      rpc::rpc_sync<double>("worker1", "forward_rref", std::vector<std::string>{"worker2", "worker3"}, r.to_ivalue()),
      6);
  EXPECT_EQ(rpc::rpc_sync<double>("worker1", "forward_rref", std::vector<std::string>{"worker2", "worker1", "worker2"},
                                  r.to_ivalue()),
            6);
  r = rref::RRef();
  EXPECT_EQ(wait_all_zero(4, milliseconds(20000)), "");
}

TEST_F(MultiprocRRef, RemoteObjects) {
  start({.world_size = 2});
  rref::RRef counter = rref::remote_object("worker1", "Counter", int64_t{10});
  EXPECT_EQ(counter.rpc_sync<int64_t>("add", int64_t{5}), 15);
  EXPECT_EQ(counter.rpc_async("get").get<int64_t>(), 15);
  rref::RRef t = counter.remote("as_tensor", int64_t{3});  // the result stays on the owner
  EXPECT_EQ(t.owner(), 1);
  EXPECT_TRUE(t.to_here<at::Tensor>().equal(at::full({3}, 15.0)));
  try {
    counter.rpc_sync("no_such_method");
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("class 'Counter' has no method 'no_such_method'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(counter.to_here(), RpcError);  // an object is not a value that can be sent
  EXPECT_THROW(rref::remote_object("worker1", "NoSuchClass").to_here(), RpcError);
}

TEST_F(MultiprocRRef, ErrorsNameTheOwner) {
  start({.world_size = 2});
  try {
    rref::remote("worker1", "fail", std::string("bad init")).to_here();
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kUnknown);
    EXPECT_NE(std::string(e.what()).find("owned by worker1 (rank 1)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad init"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rref::remote("worker1", "no_such_function").to_here_async().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(MultiprocRRef, ConcurrentForksAndDeletionsLeaveNothing) {
  start({.world_size = 3});
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&ok] {
      for (int i = 0; i < 50; ++i) {
        rref::RRef r = rref::remote(1 + i % 2, "make_tensor", int64_t{3});
        rpc::Future a = rpc::rpc_async(2 - i % 2, "sum_rref", r.to_ivalue());
        rpc::Future b = rpc::rpc_async(1 + i % 2, "sum_rref", r.to_ivalue());
        ok += std::get<0>(a.get<std::tuple<double, bool, bool>>()) == 3;
        ok += std::get<0>(b.get<std::tuple<double, bool, bool>>()) == 3;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 400);
  EXPECT_EQ(wait_all_zero(3, milliseconds(20000)), "");
}

TEST_F(MultiprocRRef, SlowHundredThousandRRefsLeaveNoLeak) {
  // Created on worker1, passed to worker2 (which holds them) and back to their owner, then dropped everywhere.
  start({.world_size = 3});
  constexpr int kTotal = 100000, kBatch = 1000;
  for (int b = 0; b < kTotal / kBatch; ++b) {
    std::vector<c10::IValue> batch;
    for (int i = 0; i < kBatch; ++i) batch.push_back(rref::remote("worker1", "make_tensor", int64_t{1}).to_ivalue());
    rpc::Future held = rpc::rpc_async("worker2", "hold", batch);
    if (b % 10 == 0) rpc::rpc_sync("worker1", "hold", batch);  // some go back to their owner too
    ASSERT_TRUE(held.status().ok()) << held.status();
    if (b % 10 == 9) {
      rpc::rpc_sync("worker2", "drop_held");
      rpc::rpc_sync("worker1", "drop_held");
    }
  }
  rpc::rpc_sync("worker2", "drop_held");
  rpc::rpc_sync("worker1", "drop_held");
  EXPECT_EQ(wait_all_zero(3, milliseconds(120000)), "");
}

TEST_F(MultiprocRRef, KilledOwnerFailsWithinTheDeadline) {
  start({.world_size = 3, .extra_env = {{"TANDEM_TEST_SHUTDOWN_MS", "3000"}}});
  expect_clean_children_ = false;
  rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{3});
  ASSERT_TRUE(r.to_here<at::Tensor>().defined());
  rref::RRef counter = rref::remote_object("worker1", "Counter", int64_t{1});
  ASSERT_EQ(counter.rpc_sync<int64_t>("get"), 1);
  job_->child(1).kill(SIGKILL);
  job_->child(1).wait(milliseconds(10000));
  const auto t0 = Clock::now();
  try {
    r.to_here(milliseconds(20000));
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kUnavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(counter.rpc_sync("get", milliseconds(20000)), RpcError);
  // Failed by the owner's death, not at the calls' 20 s deadlines: the scaled bound stays below them.
  EXPECT_LT(Clock::now() - t0, std::min(scaled(milliseconds(15000)), milliseconds(19000)));
  r = rref::RRef();  // deleting references to a dead owner is not an error for the user
  counter = rref::RRef();
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker2", "whoami"), "worker2");
  rpc::shutdown(false);
}

// A reference its owner sends is provisional until the receiver accepts it: a reply nobody decodes (here it comes after
// the caller's timeout) frees the owner's value after RRefOptions::unaccepted_ttl. Before, the owner kept the fork,
// and the value, until the job ended. A reference that is received and held stays past that time.
TEST_F(MultiprocRRef, AReferenceItsOwnerSentThatNobodyDecodedIsFreedAfterTheTtl) {
  // Scaled: the accept of the reference worker1 holds must come within it.
  const milliseconds ttl = scaled(milliseconds(1500));
  rref::configure({.probe_interval = milliseconds(100), .unaccepted_ttl = ttl});
  start({.world_size = 2});
  rref::RRef held = rref::make_local(c10::IValue(at::ones({2})));
  rpc::rpc_sync("worker1", "hold", std::vector<c10::IValue>{held.to_ivalue()});
  held = rref::RRef();
  // worker1 asks this worker for a reference it owns and gives up after 200 ms; the reply, 600 ms late, is dropped.
  const auto asked = Clock::now();
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "call_with_timeout", int64_t{0}, std::string("own_value_late"),
                                   int64_t{3}, int64_t{600}, int64_t{200}),
            static_cast<int64_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(poll_until(scaled(milliseconds(5000)), [] { return stats_of(0)[0] == 2; }))
      << "the late reply's value was never made";
  // Freed after the ttl (checked every 100 ms), not before; the held one stays (were it dropped at its own expiry, the
  // count would be 0 once the late one's came, within 600 ms and a probe of this).
  EXPECT_TRUE(poll_until(ttl + scaled(milliseconds(10000)), [] { return stats_of(0)[0] == 1; }))
      << "the value of a reference nobody decoded is still kept";
  EXPECT_GE(Clock::now() - asked, milliseconds(600) + ttl);
  std::this_thread::sleep_for(milliseconds(1500));
  EXPECT_EQ(stats_of(0)[0], 1) << "the reference worker1 holds lost its value";
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "drop_held"), 1);
  EXPECT_TRUE(poll_until(scaled(milliseconds(5000)), [] { return stats_of(0)[0] == 0; }));
  rpc::shutdown(true);
  rref::configure({});
}

TEST_F(MultiprocRRef, KilledUserIsDroppedByTheOwner) {
  rref::configure({.probe_interval = milliseconds(200)});
  start({.world_size = 3, .extra_env = {{"TANDEM_TEST_SHUTDOWN_MS", "3000"}}});
  expect_clean_children_ = false;
  {
    rref::RRef mine = rref::make_local(c10::IValue(at::ones({2})));
    rpc::rpc_sync("worker2", "hold", std::vector<c10::IValue>{mine.to_ivalue()});
    EXPECT_EQ(stats_of(0)[1], 1);  // worker2's reference is known here
  }
  EXPECT_EQ(stats_of(0)[0], 1);  // kept alive by worker2 alone
  job_->child(2).kill(SIGKILL);
  const auto deadline = Clock::now() + scaled(milliseconds(15000));
  while (stats_of(0)[0] != 0 && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(stats_of(0)[0], 0) << "the dead user's reference still keeps the value";
  rpc::shutdown(false);
  rref::configure({});
}

}  // namespace
}  // namespace tandem::test

namespace tandem::test {
namespace {

TEST_F(MultiprocRRef, AnOwnerCallingItselfKeepsItsValues) {
  start({.world_size = 2});
  // A value made in a call to this worker itself and returned at once: its only handle dies in the reply, before the
  // reply is decoded here; the value must survive that.
  for (int i = 0; i < 50; ++i) {
    rref::RRef mine = rref::RRef::from_ivalue(rpc::rpc_sync("worker0", "own_value", int64_t{2}));
    EXPECT_TRUE(mine.is_owner());
    EXPECT_TRUE(mine.local_value().toTensor().equal(at::full({2}, 2.0)));
  }
  {
    // remote() to itself: local_value() is allowed where the value lives, and waits for it.
    rref::RRef r = rref::remote("worker0", "make_tensor", int64_t{4});
    EXPECT_TRUE(r.local_value().toTensor().equal(at::arange(4, at::kFloat)));
  }
  EXPECT_EQ(wait_all_zero(2, milliseconds(10000)), "") << "after the handles die";
}

}  // namespace
}  // namespace tandem::test

namespace tandem::test {
namespace {

// Faults between the workers (rpc/fault_injection.h): each ends in the documented error or is recovered, and every
// count returns to zero.
class MultiprocRRefFaults : public MultiprocRRef {
 protected:
  // This worker (rank 0) applies `mine`, worker1 `theirs`; calls time out after `rpc_ms`.
  void start_with(const std::string& mine, const std::string& theirs, int rpc_ms = 20000) {
    rpc::RpcOptions options = options_from_env();
    options.rpc_timeout = milliseconds(rpc_ms);
    if (!mine.empty()) options.faults = rpc::parse_faults(mine).value();
    JobSpec spec{.world_size = 2};
    if (!theirs.empty()) spec.extra_env["TANDEM_TEST_FAULTS"] = theirs;
    start(spec, options);
  }
};

TEST_F(MultiprocRRefFaults, LostDeleteNoteIsSentAgainAndTheOwnerFreesTheValue) {
  start_with("drop worker0->worker1 request fn=__tandem.rref.delete nth=1", "", /*rpc_ms=*/1000);
  {
    rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{5});
    EXPECT_TRUE(r.to_here<at::Tensor>().equal(at::arange(5, at::kFloat)));
  }  // its delete note is lost once; the batcher sends it again after the note's deadline
  EXPECT_EQ(wait_all_zero(2, milliseconds(20000)), "");
  EXPECT_EQ(rref::stats().failed_notes, 0);
}

TEST_F(MultiprocRRefFaults, FetchWhoseReplyNeverComesFailsAtItsDeadlineNamingTheOwner) {
  start_with("", "drop worker1->worker0 reply fn=__tandem.rref.fetch nth=1");
  {
    rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{5});
    try {
      r.to_here(milliseconds(500));
      ADD_FAILURE() << "no error";
    } catch (const RpcError& e) {
      EXPECT_EQ(e.code(), absl::StatusCode::kDeadlineExceeded) << e.what();
      EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(r.to_here<at::Tensor>().equal(at::arange(5, at::kFloat)));  // the next fetch works
  }
  EXPECT_EQ(wait_all_zero(2, milliseconds(20000)), "");
}

TEST_F(MultiprocRRefFaults, FetchCutMidTensorIsUnavailableAndTheNextOneWorks) {
  start_with("", "cut worker1->worker0 reply fn=__tandem.rref.fetch nth=1");
  {
    rref::RRef r = rref::remote("worker1", "make_tensor", int64_t{1} << 18);  // 1 MiB: the cut falls in its bytes
    try {
      (void)r.to_here_async().value();
      ADD_FAILURE() << "no error";
    } catch (const RpcError& e) {
      EXPECT_EQ(e.code(), absl::StatusCode::kUnavailable) << e.what();
      EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
    }
    EXPECT_EQ(r.to_here<at::Tensor>().numel(), int64_t{1} << 18);
  }
  EXPECT_EQ(wait_all_zero(2, milliseconds(20000)), "");
}

}  // namespace
}  // namespace tandem::test
