// RPC across real processes on 127.0.0.1. The test process is rank 0; ranks 1.. are children of this binary
// (tests/rpc/main.cc, scenario "serve" unless stated). Nothing here asserts on speed: where a bound on elapsed time is
// checked, it is the point of the test (an error arrives long before the call could have finished), with wide margins.
#include <ATen/ATen.h>
#include <signal.h>
#include <time.h>
#include <string>

#include <thread>

#include "tests/common/rpc_fixture.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

TEST_F(MultiprocRpc, SyncAsyncAndWorkerInfo) {
  start({.world_size = 3});
  EXPECT_EQ(rpc::get_worker_info().name, "worker0");
  EXPECT_EQ(rpc::get_worker_info("worker2").id, 2);
  EXPECT_EQ(rpc::get_worker_info(1).name, "worker1");
  EXPECT_EQ(rpc::get_all_worker_infos().size(), 3u);
  EXPECT_THROW(rpc::get_worker_info("nobody"), RpcError);

  at::Tensor sum = rpc::rpc_sync<at::Tensor>("worker1", "add", at::ones({2}), at::full({2}, 2.0));
  EXPECT_TRUE(sum.equal(at::full({2}, 3.0)));
  EXPECT_EQ(rpc::rpc_sync<std::string>(2, "whoami"), "worker2");
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "caller"), "worker0");
  EXPECT_EQ(rpc::rpc_sync<std::string>(0, "whoami"), "worker0");  // a call to oneself goes through the server too

  rpc::Future f = rpc::rpc_async("worker2", "add", at::ones({3}), at::ones({3}), milliseconds(5000));
  rpc::Future g = f.then([](const rpc::Future& x) { return c10::IValue(x.get<at::Tensor>().sum()); });
  EXPECT_EQ(g.get<at::Tensor>().item<float>(), 6.0f);
  // A nested call: worker1 calls worker2 from inside a registered function.
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "nested_add", std::string("worker2"), at::ones({2}))
                  .equal(at::full({2}, 2.0)));
}

// rpc_sync spins for a quick reply, and not for one its last call showed to be slow (a parameter server's forward
// pass): the spin would only take CPU from the callee on the same cores. The transport's count says whether a call was
// let spin; the second call's CPU time shows that it did not (a busy machine can only make that smaller). The calls
// run on a thread of their own: every kSpinProbeEvery-th slow call of a thread spins anyway, counted per thread, and
// this process may have run other tests' calls before (the function's last reply is its own, "spin_probe").
TEST_F(MultiprocRpc, SyncCallsDoNotSpinForRepliesKnownToBeSlow) {
  rpc::RpcOptions options = options_from_env();
  options.sync_spin = milliseconds(50);
  start({.world_size = 2}, options);
  if (rpc::transport_to("worker1") == "grpc")
    GTEST_SKIP() << "calls over gRPC never spin (sync_spin is the direct channel's)";
  std::thread([] {
    auto cpu_ms = [] {
      timespec t{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
      return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
    };
    int64_t spun = rpc::transport_stats().sync_calls_spun;
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "spin_probe", int64_t{300}), 1);  // spins 50 ms: nothing known yet
    EXPECT_EQ(rpc::transport_stats().sync_calls_spun, spun + 1);
    spun = rpc::transport_stats().sync_calls_spun;
    const double before = cpu_ms();
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "spin_probe", int64_t{300}), 1);
    EXPECT_EQ(rpc::transport_stats().sync_calls_spun, spun);
    // Spinning would be about 50 ms of CPU; sleeping, the call's own work (well under a millisecond here).
    EXPECT_LT(cpu_ms() - before, 10.0);
  }).join();
}

// The callee's thread that served a call polls for the next (RpcOptions::serve_spin, TANDEM_SERVE_SPIN_US when the
// option is left negative): a loop of rpc_sync finds it polling. The callee has one loop thread and polls for 20 ms,
// so each call after the first is found by the poll even on a busy machine (201 of 200 calls and the counts' call
// with four busy loops on two cores). With more threads asleep in the epoll set the kernel wakes one of them for each
// message, and on a busy machine that one may take it first: a CI run under load saw 0 hits of 48 polls in 2,000
// calls with the default 50 us and 16 threads (the callee backs off then, as it should). What this checks is that a
// worker's setting reaches its channel and that its polls find calls; the back-off is
// UnitDirectPlaces.AServingThreadPollsForTheNextCallAndBacksOffWhenNoneComes's.
TEST_F(MultiprocRpc, TheCalleePollsForTheNextOfBackToBackCalls) {
  const std::string poll_us = std::to_string(scaled(milliseconds(20)).count() * 1000);  // 200 ms under TSan
  start({.world_size = 2, .extra_env = {{"TANDEM_SERVE_SPIN_US", poll_us}, {"TANDEM_TEST_THREADS", "1"}}});
  if (rpc::transport_to("worker1") == "grpc") GTEST_SKIP() << "only the direct channel's threads poll";
  const auto before = rpc::rpc_sync<std::vector<int64_t>>("worker1", "serve_spin_counts");
  for (int i = 0; i < 200; ++i) rpc::rpc_sync<at::Tensor>("worker1", "add", at::ones({1}), at::ones({1}));
  const auto after = rpc::rpc_sync<std::vector<int64_t>>("worker1", "serve_spin_counts");
  ASSERT_EQ(before.size(), 2u);
  ASSERT_EQ(after.size(), 2u);
  EXPECT_GE(after[0] - before[0], 1) << "no poll";
  EXPECT_GE(after[1] - before[1], 150) << "hits " << after[1] - before[1] << ", polls " << after[0] - before[0];
}

TEST_F(MultiprocRpc, EveryDtypeAndViewRoundTripsBitExact) {
  start({.world_size = 2});
  for (auto dtype : all_dtypes()) {
    for (int64_t n : {0, 1, 1000, 300000}) {  // empty, tiny, and large enough to arrive in many TCP slices
      at::Tensor t = random_tensor(dtype, {n});
      at::Tensor back = rpc::rpc_sync<at::Tensor>("worker1", "echo", t);
      EXPECT_TRUE(bit_equal(back, t)) << c10::toString(dtype) << " n=" << n;
    }
  }
  at::Tensor base = random_tensor(at::kDouble, {64, 64});
  for (const at::Tensor& view : {base.t(), base.slice(1, 3, 60, 7), base.narrow(0, 10, 5), base.diagonal()}) {
    EXPECT_TRUE(bit_equal(rpc::rpc_sync<at::Tensor>("worker1", "echo", view), view));
  }
}

TEST_F(MultiprocRpc, ContainersScalarsAndTorchScript) {
  start({.world_size = 2});
  std::map<std::string, std::vector<int64_t>> m = {{"a", {1, 2}}, {"b", {}}};
  EXPECT_EQ((rpc::rpc_sync<std::map<std::string, std::vector<int64_t>>>("worker1", "echo", m)), m);
  auto tup = std::make_tuple(std::string("x"), 2.5, std::vector<at::Tensor>{at::ones({1})});
  auto back = rpc::rpc_sync<std::tuple<std::string, double, std::vector<at::Tensor>>>("worker1", "echo", tup);
  EXPECT_EQ(std::get<0>(back), "x");
  EXPECT_TRUE(std::get<2>(back)[0].equal(at::ones({1})));
  EXPECT_FALSE(rpc::rpc_sync<std::optional<int64_t>>("worker1", "echo", std::optional<int64_t>()).has_value());
  // TorchScript functions registered by name, with typed arguments checked against their schema.
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "script_scale", at::ones({2}), 3.0).equal(at::full({2}, 3.0)));
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "script_total", std::vector<int64_t>{1, 2, 3}), 6);
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "script_total", std::vector<int64_t>{}), 0);
  try {
    rpc::rpc_sync("worker1", "script_scale", std::string("not a tensor"), 1.0);
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument) << e.what();
  }
}

TEST_F(MultiprocRpc, ErrorsNameWorkerFunctionAndCause) {
  start({.world_size = 2});
  try {
    rpc::rpc_sync("worker1", "throw_error", std::string("the model diverged"));
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kUnknown);
    EXPECT_STREQ(
        e.what(),
        "UNKNOWN: rpc to worker 'worker1' (rank 1) calling 'throw_error': remote exception: the model diverged");
  }
  try {
    rpc::rpc_sync("worker1", "no_such_function", 1);
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("no function named 'no_such_function' is registered on worker 'worker1'"),
              std::string::npos);
  }
  try {
    rpc::rpc_sync("worker1", "add", std::string("x"), at::ones({1}));
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("argument 1: expected Tensor, got String"), std::string::npos) << e.what();
  }
  rpc::Future f = rpc::rpc_async("worker1", "fail_later", std::string("async failure"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_THROW(rpc::rpc_sync("nobody", "add"), RpcError);
  // The worker is still serving after all of that.
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpc, TimeoutFailsTheCallAtItsDeadline) {
  start({.world_size = 2});
  const auto t0 = Clock::now();
  rpc::Future f = rpc::rpc_async("worker1", "sleep_ms", int64_t{5000}, milliseconds(200));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded);
  // The error came from the 200 ms deadline, not from the reply (5 s): the scaled bound stays below it.
  EXPECT_LT(Clock::now() - t0, std::min(scaled(milliseconds(4000)), milliseconds(4900)));
  EXPECT_NE(f.status().message().find("no reply within 200 ms"), std::string::npos) << f.status();
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "sleep_ms", int64_t{1}), 1);
}

TEST_F(MultiprocRpc, KilledPeerFailsPendingCallsAndShutdownNamesIt) {
  rpc::RpcOptions options = options_from_env();
  options.shutdown_timeout = milliseconds(3000);
  start({.world_size = 3, .extra_env = {{"TANDEM_TEST_SHUTDOWN_MS", "3000"}}}, options);
  expect_clean_children_ = false;
  rpc::Future pending = rpc::rpc_async("worker1", "sleep_ms", int64_t{20000}, milliseconds(30000));
  std::this_thread::sleep_for(milliseconds(300));
  const auto t0 = Clock::now();
  job_->child(1).kill(SIGKILL);
  EXPECT_EQ(pending.status().code(), absl::StatusCode::kUnavailable) << pending.status();
  EXPECT_LT(Clock::now() - t0, std::min(scaled(milliseconds(10000)), milliseconds(29000)));  // before its 30 s deadline
  EXPECT_NE(pending.status().message().find("worker 'worker1' (rank 1)"), std::string::npos) << pending.status();
  // New calls to the dead worker fail fast too; the rest of the job still works.
  EXPECT_EQ(rpc::rpc_async("worker1", "whoami", milliseconds(20000)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker2", "whoami"), "worker2");
  // A graceful shutdown cannot complete without rank 1: it fails within its deadline, naming the missing rank. (Rank 1
  // had reached the shutdown barrier before it was killed, so it is missing from the leave step.)
  try {
    rpc::shutdown(true);
    FAIL() << "graceful shutdown succeeded without rank 1";
  } catch (const RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 did not leave after the barrier within"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(rpc::is_initialized());
  EXPECT_EQ(exit_code(job_->child(2).wait(milliseconds(20000))), 0) << job_->outputs();
}

// Polls `fn` on `to` until it returns `want` (bounded); returns what it last returned.
int64_t poll_for(const rpc::To& to, const std::string& fn, int64_t want) {
  const auto deadline = Clock::now() + scaled(milliseconds(10000));
  int64_t got = -1;
  while ((got = rpc::rpc_sync<int64_t>(to, fn)) != want && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  return got;
}

// One-way calls: each send completes once it is on its way, every function runs on the callee, a failing one is
// counted and told there (never answered), and sends to a dead worker fail UNAVAILABLE, naming it, without hanging.
TEST_F(MultiprocRpc, OneWayCallsRunWithoutRepliesAndTheirFailuresStayWithTheCallee) {
  start({.world_size = 3});
  const int64_t bumps = rpc::rpc_sync<int64_t>("worker1", "bumps");
  std::vector<rpc::Future> sent;
  for (int i = 0; i < 200; ++i)
    sent.push_back(rpc::rpc_oneway("worker1", "bump_tensor", at::ones({1000}), milliseconds(10000)));
  for (auto& f : sent) EXPECT_TRUE(f.status().ok()) << f.status();
  // Nothing orders them before a later call (another connection, other threads): the count gets there.
  EXPECT_EQ(poll_for("worker1", "bumps", bumps + 200), bumps + 200);
  const int64_t failures = rpc::rpc_sync<int64_t>("worker1", "oneway_failures");
  EXPECT_TRUE(rpc::rpc_oneway("worker1", "throw_error", std::string("boom")).status().ok());
  EXPECT_TRUE(rpc::rpc_oneway("worker1", "no_such_function").status().ok());
  EXPECT_EQ(poll_for("worker1", "oneway_failures", failures + 2), failures + 2);
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");  // the callee is fine
  // A tensor for the bulk path (4 MiB) goes by reference on the same-host channel: answered, then released.
  const auto stats = rpc::transport_stats();
  EXPECT_TRUE(rpc::rpc_oneway("worker1", "bump_tensor", at::ones({1 << 20}), milliseconds(10000)).status().ok());
  EXPECT_EQ(poll_for("worker1", "bumps", bumps + 201), bumps + 201);
  if (rpc::transport_to(1) == "direct") {
    EXPECT_EQ(rpc::transport_stats().tensors_by_reference, stats.tensors_by_reference + 1);
  }

  expect_clean_children_ = false;
  job_->child(2).kill(SIGKILL);
  EXPECT_NE(job_->child(2).wait(milliseconds(10000)), -1);
  const auto t0 = Clock::now();
  absl::Status s;
  do {  // the first sends may still reach the socket's buffer before the close is seen
    s = rpc::rpc_oneway("worker2", "bump", milliseconds(2000)).status();
  } while (s.ok() && Clock::now() - t0 < scaled(milliseconds(10000)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("worker 'worker2' (rank 2)"), std::string::npos) << s;
  rpc::shutdown(false);  // rank 2 cannot leave gracefully
}

// Messages (register_message): sent one-way on the direct channel they run inline on its thread, with the caller known
// and no call record; called otherwise (rpc_sync, or over gRPC) they are functions; their failures are counted and told
// on the callee, which keeps serving.
TEST_F(MultiprocRpc, MessagesRunInlineOneWayAndAsFunctionsOtherwise) {
  start({.world_size = 2});
  const bool direct = rpc::transport_to(1) == "direct";
  const int64_t bumps = rpc::rpc_sync<int64_t>("worker1", "bumps");
  const int64_t inline_before = rpc::rpc_sync<int64_t>("worker1", "inline_messages");
  std::vector<rpc::Future> sent;
  for (int i = 0; i < 100; ++i) sent.push_back(rpc::rpc_oneway("worker1", "bump_message", at::ones({1000})));
  for (auto& f : sent) EXPECT_TRUE(f.status().ok()) << f.status();
  EXPECT_EQ(poll_for("worker1", "bumps", bumps + 100), bumps + 100);
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "inline_messages"), inline_before + (direct ? 100 : 0));
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "message_caller"), "worker0/0");
  // Called and answered: None, and not inline.
  EXPECT_TRUE(rpc::rpc_sync("worker1", "bump_message", at::ones({3})).isNone());
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "bumps"), bumps + 101);
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "inline_messages"), inline_before + (direct ? 100 : 0));
  // Arguments that do not convert, and a message that throws: counted and told on the callee.
  const int64_t failures = rpc::rpc_sync<int64_t>("worker1", "oneway_failures");
  EXPECT_TRUE(rpc::rpc_oneway("worker1", "bump_message", std::string("not a tensor")).status().ok());
  EXPECT_TRUE(rpc::rpc_oneway("worker1", "bump_message").status().ok());
  EXPECT_TRUE(rpc::rpc_oneway("worker1", "message_throw", std::string("boom")).status().ok());
  EXPECT_EQ(poll_for("worker1", "oneway_failures", failures + 3), failures + 3);
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "bumps"), bumps + 101);
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  // A name is a function or a message once.
  EXPECT_THROW(rpc::register_message("bump_message", [](at::Tensor) {}), RpcError);
  EXPECT_THROW(rpc::register_message("whoami", [] {}), RpcError);
  rpc::shutdown(true);
}

TEST_F(MultiprocRpc, UnauthenticatedCallersAreRejected) {
  start({.world_size = 2});
  pb::Request request;
  request.set_function("whoami");
  grpc::ByteBuffer response;
  for (const std::string& token : {std::string(), rpc::auth::derive_token("guess"), job_->secret()}) {
    grpc::Status s = raw_call(1, make_frame(request, ""), &response, token);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "token '" << token << "': " << s.error_message();
  }
  EXPECT_TRUE(raw_error(1, make_frame(request, "")).ok());  // the job's own token is accepted
}

TEST_F(MultiprocRpc, WorkerWithWrongSecretCannotJoin) {
  rpc::RpcOptions options = options_from_env();
  options.init_timeout = milliseconds(3000);
  options =
      launch({.world_size = 2, .extra_env = {{"TANDEM_SECRET", "not-the-job-secret"}, {"TANDEM_TEST_INIT_MS", "3000"}}},
             options);
  expect_clean_children_ = false;
  try {
    rpc::init_rpc("worker0", 0, 2, options);
    FAIL() << "joined with an intruder";
  } catch (const RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 did not join"), std::string::npos) << e.what();
  }
  EXPECT_EQ(exit_code(job_->child(1).wait(milliseconds(20000))), 3);
  EXPECT_NE(job_->child(1).output().find("UNAUTHENTICATED"), std::string::npos) << job_->outputs();
}

TEST_F(MultiprocRpc, MalformedMessagesGetErrorRepliesAndTheWorkerSurvives) {
  start({.world_size = 2});
  pb::Request ok;
  ok.set_function("whoami");
  EXPECT_TRUE(raw_error(1, make_frame(ok, "")).ok());

  EXPECT_EQ(raw_error(1, raw_buffer("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(raw_error(1, raw_buffer("garbage that is not a frame")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(raw_error(1, raw_buffer(std::string("\xff\xff\x00\x00", 4) + "short")).code(),
            absl::StatusCode::kInvalidArgument);

  pb::Request lying;  // claims 1 MiB of floats, sends 64 bytes
  lying.set_function("echo");
  lying.mutable_args()->add_values()->set_tensor(0);
  auto* meta = lying.mutable_args()->add_tensors();
  meta->set_dtype(static_cast<int>(at::kFloat));
  meta->add_sizes(1 << 18);
  meta->set_nbytes(1 << 20);
  auto s = raw_error(1, make_frame(lying, std::string(64, 'x')));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("exceed the payload"), std::string::npos) << s;

  meta->set_nbytes(12345);  // does not match the sizes
  EXPECT_EQ(raw_error(1, make_frame(lying, std::string(12345, 'x'))).code(), absl::StatusCode::kInvalidArgument);
  meta->set_dtype(99);
  EXPECT_EQ(raw_error(1, make_frame(lying, std::string(64, 'x'))).code(), absl::StatusCode::kInvalidArgument);

  pb::Request wrong_args;  // a well-formed frame whose arguments do not fit the function
  wrong_args.set_function("add");
  wrong_args.mutable_args()->add_values()->set_i(1);
  EXPECT_EQ(raw_error(1, make_frame(wrong_args, "")).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpc, OversizedMessagesAreRefused) {
  constexpr int kLimit = 1 << 20;
  rpc::RpcOptions options = options_from_env();
  options.max_message_bytes = kLimit;
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_MAX_MSG", std::to_string(kLimit)}}}, options);
  at::Tensor big = at::zeros({kLimit / 2}, at::kFloat);  // 2 MiB
  try {
    rpc::rpc_sync("worker1", "echo", big);
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kResourceExhausted) << e.what();
    EXPECT_NE(std::string(e.what()).find("worker 'worker1'"), std::string::npos) << e.what();
  }
  // A request and its reply under the limit.
  EXPECT_EQ(rpc::rpc_async("worker1", "echo", at::zeros({kLimit / 8})).status().code(), absl::StatusCode::kOk);
  // A small request whose reply (2 MiB) would exceed it: refused by the callee, an error naming it and the limit; the
  // connection and the worker go on.
  try {
    rpc::rpc_sync("worker1", "pattern", static_cast<int64_t>(at::kFloat), std::vector<int64_t>{kLimit / 2});
    FAIL() << "a reply above the message limit was delivered";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kResourceExhausted) << e.what();
    EXPECT_NE(std::string(e.what()).find("worker 'worker1'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("exceeds the message limit"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpc, ThousandConcurrentAsyncCalls) {
  start({.world_size = 3});
  std::vector<rpc::Future> futures;
  for (int64_t i = 0; i < 1000; ++i) futures.push_back(rpc::rpc_async(1 + i % 2, "echo", i));
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(futures[i].get<int64_t>(), i);
}

TEST_F(MultiprocRpc, AsyncFunctionsDoNotHoldServerThreads) {
  // Two server threads on worker1, six callers parked in gather_sum: the reply goes out when the sixth arrives.
  rpc::RpcOptions options = options_from_env();
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_THREADS", "2"}}}, options);
  std::vector<rpc::Future> futures;
  for (int i = 0; i < 6; ++i) futures.push_back(rpc::rpc_async("worker1", "gather_sum", int64_t{6}, at::ones({2})));
  for (auto& f : futures) EXPECT_TRUE(f.get<at::Tensor>().equal(at::full({2}, 6.0)));
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "later", int64_t{50}, int64_t{7}), 7);
}

TEST_F(MultiprocRpc, GracefulShutdownWaitsForCallsInFlight) {
  start({.world_size = 3});
  std::vector<rpc::Future> futures;
  for (int i = 0; i < 40; ++i) futures.push_back(rpc::rpc_async(1 + i % 2, "sleep_ms", int64_t{100}));
  rpc::shutdown(true);  // returns only after every call above completed and all workers arrived
  for (int i = 0; i < 40; ++i) EXPECT_EQ(futures[i].get<int64_t>(), 1 + i % 2);
  for (int code : job_->wait_children(milliseconds(30000))) EXPECT_EQ(code, 0) << job_->outputs();
}

TEST_F(MultiprocRpc, NonGracefulShutdownCancelsAndCanReinit) {
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_SHUTDOWN_MS", "2000"}}});
  expect_clean_children_ = false;  // its graceful shutdown cannot meet rank 0 at the barrier
  rpc::Future f = rpc::rpc_async("worker1", "sleep_ms", int64_t{10000});
  rpc::shutdown(false);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kCancelled) << f.status();
  EXPECT_FALSE(rpc::is_initialized());
  EXPECT_EQ(rpc::rpc_async("worker1", "whoami").status().code(), absl::StatusCode::kFailedPrecondition);
  job_->wait_children(milliseconds(20000));
  // The same process can join a new job.
  start({.world_size = 2});
  expect_clean_children_ = true;
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpc, DuplicateNamesAreRejected) {
  rpc::RpcOptions options = options_from_env();
  options.init_timeout = milliseconds(10000);
  options = launch({.world_size = 2, .extra_env = {{"TANDEM_TEST_NAME", "worker0"}}}, options);
  expect_clean_children_ = false;
  try {
    rpc::init_rpc("worker0", 0, 2, options);
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("worker name 'worker0' is used by another rank"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(exit_code(job_->child(1).wait(milliseconds(20000))), 3);
}

TEST_F(MultiprocRpc, ExitWithoutShutdownDoesNotHang) {
  Job job(JobSpec{.world_size = 1});
  Process p({self_exe(), "--worker", "exit_without_shutdown"}, job.env_for(0));
  EXPECT_EQ(exit_code(p.wait(milliseconds(20000))), 0) << p.output();
  EXPECT_NE(p.output().find("leaving without shutdown"), std::string::npos);
}

// A worker that returns from main while a peer's calls run on it: a static its function built after init_rpc is
// destroyed in exit, and RPC stops before that (before, the calls ran on into the destroyed static: SIGSEGV in exit,
// in most of these rounds).
TEST_F(MultiprocRpc, ExitWhileCalledStopsRpcBeforeStaticsAreDestroyed) {
  for (int round = 0; round < 5; ++round) {
    Job job(JobSpec{.world_size = 2, .scenario = "exit_while_called"});
    Process p({self_exe(), "--worker", "exit_while_called"}, job.env_for(0));
    EXPECT_EQ(exit_code(p.wait(milliseconds(30000))), 0) << "round " << round << ": " << p.output();
    EXPECT_NE(p.output().find("leaving while called"), std::string::npos) << p.output();
    for (int code : job.wait_children(milliseconds(30000))) EXPECT_EQ(code, 0) << job.outputs();
  }
}

TEST_F(MultiprocRpc, ValueCodecsAndTheirWaits) {
  // tests/rpc/main.cc registers a codec for c10::Device whose decoding waits 100 ms; the callee's function runs after
  // that wait, and the reply (which carries the device back) is delivered to the caller after its own wait.
  start({.world_size = 2});
  for (bool sync : {true, false}) {
    const c10::IValue cpu(c10::Device("cpu"));
    const int waits_here = g_device_waits_done.load();
    auto [device, waits_seen] =
        sync ? rpc::rpc_sync<std::tuple<c10::IValue, int64_t>>("worker1", "device_echo", cpu)
             : rpc::rpc_async("worker1", "device_echo", cpu).get<std::tuple<c10::IValue, int64_t>>();
    EXPECT_TRUE(device.isDevice());
    EXPECT_EQ(device.toDevice().str(), "cpu");
    EXPECT_GE(waits_seen, 1);  // the callee's decode wait had completed before the function ran
    EXPECT_EQ(g_device_waits_done.load(), waits_here + 1);  // and the caller's, before it saw the reply
  }
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
}

TEST_F(MultiprocRpc, TlsJob) {
  const TempDir temp;
  const std::string& dir = temp.path();
  if (!make_test_certificates(dir)) GTEST_SKIP() << "openssl cannot make test certificates here";
  rpc::RpcOptions options = options_from_env();
  options.tls = tls_options(dir);
  start({.world_size = 2, .extra_env = {{"TANDEM_TEST_TLS_DIR", dir}}}, options);
  EXPECT_EQ(rpc::transport_to(1), "grpc");  // the direct channel is plaintext: a TLS job does not use it
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>("worker1", "add", at::ones({2}), at::ones({2})).equal(at::full({2}, 2.0)));
  // A plaintext client cannot talk to a TLS worker even with the right token.
  pb::Request request;
  request.set_function("whoami");
  grpc::ByteBuffer response;
  EXPECT_FALSE(raw_call(1, make_frame(request, ""), &response, rpc::auth::derive_token(job_->secret())).ok());
}

TEST_F(MultiprocRpc, TlsFromTheEnvironment) {
  // TANDEM_TLS_CERT/KEY/CA turn TLS on in a program that sets no RpcOptions::tls: here and in the child alike.
  const TempDir temp;
  const std::string& dir = temp.path();
  if (!make_test_certificates(dir)) GTEST_SKIP() << "openssl cannot make test certificates here";
  const std::map<std::string, std::string> env = {{"TANDEM_TLS_CERT", dir + "/node.crt"},
                                                  {"TANDEM_TLS_KEY", dir + "/node.key"},
                                                  {"TANDEM_TLS_CA", dir + "/ca.crt"}};
  for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
  start({.world_size = 2, .extra_env = env});
  for (const auto& [k, v] : env) unsetenv(k.c_str());
  EXPECT_EQ(rpc::transport_to(1), "grpc");
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  pb::Request request;
  request.set_function("whoami");
  grpc::ByteBuffer response;
  EXPECT_FALSE(raw_call(1, make_frame(request, ""), &response, rpc::auth::derive_token(job_->secret())).ok());
}

TEST(UnitRpcTlsEnvironment, IncompleteOrUnreadableIsAnErrorNamingTheVariable) {
  setenv("TANDEM_TLS_CERT", "/etc/hostname", 1);
  expect_error([] { rpc::init_rpc("alone", 0, 1); }, absl::StatusCode::kInvalidArgument,
               {"worker 'alone'", "missing: TANDEM_TLS_KEY, TANDEM_TLS_CA"});
  setenv("TANDEM_TLS_KEY", "/etc/hostname", 1);
  setenv("TANDEM_TLS_CA", "/nonexistent/ca.crt", 1);
  expect_error([] { rpc::init_rpc("alone", 0, 1); }, absl::StatusCode::kFailedPrecondition,
               {"cannot read TANDEM_TLS_CA='/nonexistent/ca.crt'"});
  for (const char* v : {"TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"}) unsetenv(v);
  EXPECT_FALSE(rpc::is_initialized());
}

}  // namespace
}  // namespace tandem::test
