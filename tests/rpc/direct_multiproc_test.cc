// The direct channel and its bulk path, across real processes: which path a call takes, each path forced, the
// fall-back when cross-memory reads are impossible, and clients that do not play by the rules.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include <gmock/gmock.h>

#include "absl/strings/str_split.h"
#include "tandem/rpc/detail/direct.h"
#include "tandem/rpc/detail/version.h"
#include "tandem/rpc/store.h"
#include "tandem/sync/sync.h"
#include "tests/common/files.h"
#include "tests/common/rpc_fixture.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

class MultiprocDirect : public MultiprocRpc {
 protected:
  // A job whose workers (this one included) may use the direct channel, whatever TANDEM_TRANSPORT says outside.
  void start_direct(JobSpec spec, rpc::RpcOptions options = options_from_env()) {
    options.transport = "auto";
    spec.extra_env["TANDEM_TRANSPORT"] = "auto";
    start(spec, options);
  }

  // Worker `rank`'s direct-channel address, from its rendezvous record.
  std::string direct_address(int rank) {
    auto channel = rpc::net::make_channel("127.0.0.1:" + std::to_string(job_->port()), nullptr, -1);
    auto store = rpc::connect_store(channel, rpc::auth::derive_token(job_->secret()), false);
    auto record = store->get("worker/" + std::to_string(rank), milliseconds(5000));
    EXPECT_TRUE(record.ok()) << record.status();
    tandem::wire::RendezvousRecord parsed;
    if (!parsed.ParseFromString(record.value_or(""))) return "";
    return parsed.worker().direct_address();
  }

  // A raw Unix-domain socket to `address`, for bytes no worker would send.
  static int raw_connect(const std::string& address) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, address.data(), address.size());
    const socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + address.size();
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      close(fd);
      return -1;
    }
    timeval tv{10, 0};  // nothing below waits longer
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
  }

  // Whether the server closed `fd` (read returns EOF or an error) within its receive timeout.
  static bool closed_by_peer(int fd) {
    char buf[256];
    for (;;) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return true;
      if (n < 0 && errno == EAGAIN) return false;  // timed out: still open
    }
  }
};

TEST_F(MultiprocDirect, SameHostPeersUseTheDirectChannel) {
  start_direct({.world_size = 3});
  EXPECT_EQ(rpc::transport_to("worker1"), "direct");
  EXPECT_EQ(rpc::transport_to(2), "direct");
  const auto before = rpc::transport_stats();
  EXPECT_TRUE(rpc::rpc_sync<at::Tensor>(1, "add", at::ones({2}), at::ones({2})).equal(at::full({2}, 2.0)));
  EXPECT_EQ(rpc::rpc_async(2, "whoami").get<std::string>(), "worker2");
  const auto after = rpc::transport_stats();
  EXPECT_EQ(after.direct_calls - before.direct_calls, 2);
  EXPECT_EQ(after.grpc_calls, before.grpc_calls);
}

// More functions sleeping at once than the callee has cores: each still gets a thread (the ones beyond the places are
// presumed blocked, and the callee's transport_stats() says so), and all of them finish.
TEST_F(MultiprocDirect, FunctionsBlockedOutOfSightDoNotHoldBackTheOthers) {
  start({.world_size = 2});
  ASSERT_EQ(rpc::transport_to(1), "direct");
  // Once a call has run there, worker1's init_rpc has returned: calls that arrive before wait on its pool instead.
  ASSERT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");
  cpu_set_t cpus;
  ASSERT_EQ(sched_getaffinity(0, sizeof(cpus), &cpus), 0);  // the callee's too: tandem's children inherit it
  const int calls = CPU_COUNT(&cpus) + 1;
  std::vector<rpc::Future> futures;
  for (int i = 0; i < calls; ++i) futures.push_back(rpc::rpc_async("worker1", "sleep_ms", int64_t{500}));
  for (auto& f : futures) EXPECT_EQ(f.get<int64_t>(), 1);
  const auto counts = rpc::rpc_sync<std::vector<int64_t>>("worker1", "place_counts");
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_GE(counts[1], 1) << "no sleeping function was presumed blocked; lent " << counts[0] << ", calls " << calls;
}

TEST_F(MultiprocDirect, GrpcCanBeForced) {
  rpc::RpcOptions options = options_from_env();
  options.transport = "grpc";
  start({.world_size = 2, .extra_env = {{"TANDEM_TRANSPORT", "grpc"}}}, options);
  EXPECT_EQ(rpc::transport_to(1), "grpc");
  const auto before = rpc::transport_stats();
  EXPECT_EQ(rpc::rpc_sync<std::string>(1, "whoami"), "worker1");
  EXPECT_EQ(rpc::rpc_async(1, "whoami").get<std::string>(), "worker1");
  const auto after = rpc::transport_stats();
  EXPECT_EQ(after.grpc_calls - before.grpc_calls, 2);
  EXPECT_EQ(after.direct_calls, before.direct_calls);
}

// Every dtype, sync and async, through the bulk path (read from the caller's memory) and, with the bulk path off,
// through the socket: bit-exact both ways, and the counters show which path carried the tensors.
void check_bulk_round_trips(int64_t expected_by_reference) {
  const auto before = rpc::transport_stats();
  int64_t sent = 0;
  for (auto dtype : all_dtypes()) {
    at::Tensor t = random_tensor(dtype, {300000});  // over the 1 KiB threshold set below
    EXPECT_TRUE(bit_equal(rpc::rpc_sync<at::Tensor>("worker1", "echo", t), t)) << c10::toString(dtype);
    EXPECT_TRUE(bit_equal(rpc::rpc_async("worker1", "echo", t).get<at::Tensor>(), t)) << c10::toString(dtype);
    sent += 2;
  }
  at::Tensor view = random_tensor(at::kFloat, {512, 512}).t();  // packed first, then read by reference
  EXPECT_TRUE(bit_equal(rpc::rpc_sync<at::Tensor>("worker1", "echo", view), view));
  ++sent;
  EXPECT_EQ(rpc::transport_stats().tensors_by_reference - before.tensors_by_reference,
            expected_by_reference < 0 ? sent : expected_by_reference);
}

TEST_F(MultiprocDirect, BulkPathReadsLargeTensorsFromTheCallersMemory) {
  rpc::RpcOptions options = options_from_env();
  options.bulk_min_bytes = 1024;
  start_direct({.world_size = 2}, options);
  ASSERT_EQ(rpc::transport_to(1), "direct");
  check_bulk_round_trips(/*expected_by_reference=*/-1);  // all of them
}

TEST_F(MultiprocDirect, BulkPathCanBeTurnedOff) {
  rpc::RpcOptions options = options_from_env();
  options.bulk_min_bytes = 0;
  start_direct({.world_size = 2}, options);
  ASSERT_EQ(rpc::transport_to(1), "direct");
  check_bulk_round_trips(/*expected_by_reference=*/0);
}

TEST_F(MultiprocDirect, BulkPathFallsBackWhenThePeerCannotReadOurMemory) {
  // A worker in its own pid namespace cannot name our process: the handshake's probe read fails, so large tensors
  // travel through the socket instead, and nothing else changes.
  if (std::system("unshare --pid --fork true >/dev/null 2>&1") != 0) GTEST_SKIP() << "cannot make a pid namespace here";
  job_ = std::make_unique<Job>(JobSpec{.world_size = 1});  // only for its port and secret
  const auto env = job_->env_for(1);
  std::map<std::string, std::string> child_env = env;
  child_env["WORLD_SIZE"] = "2";
  child_env["TANDEM_TRANSPORT"] = "auto";
  Process child({"/usr/bin/unshare", "--pid", "--fork", self_exe(), "--worker", "serve"}, child_env);
  rpc::RpcOptions options = options_from_env();
  options.transport = "auto";
  options.bulk_min_bytes = 1024;
  options.master_addr = "127.0.0.1";
  options.master_port = job_->port();
  options.secret = job_->secret();
  rpc::init_rpc("worker0", 0, 2, options);
  ASSERT_EQ(rpc::transport_to(1), "direct");
  check_bulk_round_trips(/*expected_by_reference=*/0);
  rpc::shutdown(true);
  EXPECT_EQ(exit_code(child.wait(milliseconds(30000))), 0) << child.output();
}

// Stops process `pid` (SIGSTOP) and returns once every thread of it is stopped: the signal takes effect after kill()
// returns, and a thread still running meanwhile could read a request sent at once.
bool stop_fully(pid_t pid) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  return poll_until(scaled(milliseconds(10000)), [&] {
    for (const auto& task : std::filesystem::directory_iterator(tasks)) {
      // The state follows the command name in parentheses, which may itself hold spaces or parentheses.
      const std::string stat = read_file(task.path().string() + "/stat");
      const size_t close = stat.rfind(')');
      if (close == std::string::npos || close + 2 >= stat.size() || stat[close + 2] != 'T') return false;
    }
    return true;
  });
}

// A call whose tensors go by reference times out before the callee reads them (the callee is stopped): once it goes
// on, it refuses the call (the caller may have freed or reused that memory) instead of running it on what it reads.
// The caller still holds the tensor here, so a callee without the lease check would read it intact and run the call.
TEST_F(MultiprocDirect, ACallWhoseCallerLetGoOfItsTensorsBeforeTheyWereReadIsNotRun) {
  rpc::RpcOptions options = options_from_env();
  options.bulk_min_bytes = 1024;
  start_direct({.world_size = 2}, options);
  ASSERT_EQ(rpc::transport_to(1), "direct");
  const int64_t bumps = rpc::rpc_sync<int64_t>("worker1", "bumps");
  const int64_t lapsed = rpc::rpc_sync<int64_t>("worker1", "leases_lapsed");
  const at::Tensor t = at::ones({1 << 16});  // 256 KiB: by reference
  ASSERT_TRUE(stop_fully(job_->child(1).pid()));
  rpc::Future late = rpc::rpc_async("worker1", "bump_tensor", t, milliseconds(300));
  EXPECT_FALSE(late.wait_for(scaled(milliseconds(20000))) && late.status().ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  job_->child(1).kill(SIGCONT);
  EXPECT_TRUE(poll_until(scaled(milliseconds(20000)), [&] {
    return rpc::rpc_sync<int64_t>("worker1", "leases_lapsed") > lapsed;
  })) << "the late request was never refused";
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "bumps"), bumps) << "the call ran after its caller let go of its tensor";
  // A call in time reads its tensor by reference and runs.
  const int64_t by_reference = rpc::transport_stats().tensors_by_reference;
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "bump_tensor", t), bumps + 1);
  EXPECT_EQ(rpc::transport_stats().tensors_by_reference, by_reference + 1);
}

// A shutdown without waiting, while a reply cannot be written (its caller stopped reading), and, with
// `another_call_running`, a second call of that caller still running here (its CANCELLED answer waits for the
// connection the stalled reply holds): the shutdown takes less than 10 s (before, the first waited for the writer's
// hold on the call, the second for its answer's write: each up to the reply's deadline, the RPC timeout, 60 s here).
class MultiprocDirectStalledReply : public MultiprocDirect {
 protected:
  void shut_down_behind_a_stalled_reply(bool another_call_running) {
    static std::atomic<bool> entered, hanging, go, release;
    entered = hanging = go = release = false;
    // The other test of this suite registered them in this process before, when both run in one
    // (scripts/ctest_by_suite.py).
    rpc::unregister_function("test.big_reply");
    rpc::unregister_function("test.hang");
    rpc::register_function("test.big_reply", [] {
      {
        // Said to be a wait (it lends this thread's place, as Tandem's own waits do), so that the place is not
        // presumed blocked and the reply's writer, waiting for room later, lends it again: what is waited for below.
        BlockingScope waiting;
        entered = true;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!go.load() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(milliseconds(1));
      }
      return at::ones({16 << 20});  // 64 MiB, written into the socket (no bulk path)
    });
    rpc::register_function("test.hang", [] {
      BlockingScope waiting;
      hanging = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!release.load() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(milliseconds(1));
      return int64_t{0};
    });
    rpc::RpcOptions options = options_from_env();
    options.bulk_min_bytes = 0;
    options.rpc_timeout = std::chrono::seconds(60);
    start_direct({.world_size = 2}, options);
    ASSERT_EQ(rpc::transport_to(1), "direct");
    expect_clean_children_ = false;
    rpc::rpc_sync("worker1", "call_in_background", int64_t{0}, std::string("test.big_reply"));
    if (another_call_running) rpc::rpc_sync("worker1", "call_in_background", int64_t{0}, std::string("test.hang"));
    ASSERT_TRUE(poll_until(std::chrono::seconds(20), [&] { return entered && (hanging || !another_call_running); }));
    job_->child(1).kill(SIGSTOP);  // the caller stops reading
    const int64_t lent = rpc::transport_stats().places_lent;
    go = true;
    // The reply fills the socket and its writer waits for room, holding the call (a wait that lends its place): the
    // shutdown must come after that, or the test would pass without testing it.
    ASSERT_TRUE(poll_until(scaled(std::chrono::seconds(20)), [&] { return rpc::transport_stats().places_lent > lent; }))
        << "the reply's writer never waited";
    const auto t0 = std::chrono::steady_clock::now();
    rpc::shutdown(false);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    release = true;
    job_->child(1).kill(SIGKILL);
  }
};

TEST_F(MultiprocDirectStalledReply, NonGracefulShutdownDoesNotWaitForAStalledReply) {
  shut_down_behind_a_stalled_reply(false);
}

TEST_F(MultiprocDirectStalledReply, NonGracefulShutdownDoesNotWaitBehindAStalledReplyToAnswerAnotherCall) {
  shut_down_behind_a_stalled_reply(true);
}

// A callback of a call that ran out of time and blocks (here until the test ends; a note batch sent again from its
// callback would, writing to a peer that stopped reading) does not hold back another call's deadline: before, the
// transport's one timer thread ran both, so the second call completed only once the first's callback returned.
TEST_F(MultiprocDirect, ABlockedTimeoutCallbackDoesNotDelayOtherDeadlines) {
  start_direct({.world_size = 2});
  ASSERT_EQ(rpc::transport_to(1), "direct");
  using Clock = std::chrono::steady_clock;
  auto released = std::make_shared<std::atomic<bool>>(false);
  auto second_done = std::make_shared<std::atomic<int64_t>>(0);  // ms after t0, once completed
  const auto t0 = Clock::now();
  rpc::Future first = rpc::rpc_async("worker1", "sleep_ms", int64_t{2500}, milliseconds(200));
  first.add_callback([released](const rpc::Future&) {
    const auto until = Clock::now() + scaled(std::chrono::seconds(20));  // a bound for the test, not the point
    while (!released->load() && Clock::now() < until) std::this_thread::sleep_for(milliseconds(1));
  });
  rpc::Future second = rpc::rpc_async("worker1", "sleep_ms", int64_t{2500}, milliseconds(600));
  second.add_callback([second_done, t0](const rpc::Future&) {
    second_done->store(std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count() + 1);
  });
  // Past the bound checked below, under any time scale: a second call held back by the first's callback completes
  // only after the release.
  poll_until(scaled(std::chrono::seconds(10)), [&] { return second_done->load() != 0; });
  released->store(true);
  EXPECT_EQ(first.status().code(), absl::StatusCode::kDeadlineExceeded) << first.status();
  EXPECT_EQ(second.status().code(), absl::StatusCode::kDeadlineExceeded) << second.status();
  EXPECT_GT(second_done->load(), 0);
  // Its 600 ms deadline and some slack; the first call's callback holds its thread until the release.
  EXPECT_LT(second_done->load(), (milliseconds(600) + scaled(milliseconds(1400))).count())
      << "the second call's deadline waited for the first call's callback";
}

// The direct channel's TCP route in one process over loopback (no namespaces needed): the challenge handshake both
// ways, frames large and small both ways, the async connection's replies read by the epoll threads, and refusals.
TEST(UnitDirectTcp, HandshakeAndFramesOverLoopback) {
  const std::string token = rpc::auth::derive_token("unit-secret");
  const auto soon = [] { return absl::Now() + absl::Seconds(10); };
  rpc::direct::Channel::Callbacks echo;
  echo.on_request = [](const std::shared_ptr<rpc::direct::Conn>& conn, rpc::direct::Message m) {
    (void)conn->write(rpc::direct::Kind::kResponse, m.call_id, m.body, absl::Now() + absl::Seconds(10));
  };
  auto server = rpc::direct::Channel::start(token, 2, 64 << 20, absl::Seconds(10), echo, "127.0.0.1");
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->tcp_address();
  ASSERT_EQ(address.rfind("tcp:127.0.0.1:", 0), 0u) << address;

  Mutex mu;
  std::map<uint64_t, size_t> replies;
  rpc::direct::Channel::Callbacks client_callbacks;
  client_callbacks.on_response = [&](const std::shared_ptr<rpc::direct::Conn>&, rpc::direct::Message m) {
    MutexLock lock(&mu);
    replies[m.call_id] = m.body.Length();
  };
  auto client = rpc::direct::Channel::start(token, 1, 64 << 20, absl::Seconds(10), client_callbacks);
  ASSERT_TRUE(client.ok());
  auto sync = (*client)->connect(address, 3, /*for_responses=*/false, soon());
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_FALSE((*sync)->cma_ok);
  for (const std::string& body : {std::string(12 << 20, 'x'), std::string("small")}) {
    grpc::Slice slice(body);
    ASSERT_TRUE((*sync)->write(rpc::direct::Kind::kRequest, 9, grpc::ByteBuffer(&slice, 1), soon()).ok());
    auto reply = (*sync)->read(64 << 20, soon());
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->kind, rpc::direct::Kind::kResponse);
    EXPECT_EQ(reply->call_id, 9u);
    grpc::Slice flat;
    ASSERT_TRUE(reply->body.buffer().DumpToSingleSlice(&flat).ok());
    EXPECT_TRUE(std::string(reinterpret_cast<const char*>(flat.begin()), flat.size()) == body);
  }
  auto async = (*client)->connect(address, 3, /*for_responses=*/true, soon());
  ASSERT_TRUE(async.ok()) << async.status();
  for (uint64_t id = 1; id <= 32; ++id) {
    grpc::Slice slice(std::string(id * 1000, 'y'));
    ASSERT_TRUE((*async)->write(rpc::direct::Kind::kRequest, id, grpc::ByteBuffer(&slice, 1), soon()).ok());
  }
  const absl::Time until = soon();
  MutexLock lock(&mu);
  mu.AwaitWithDeadline(Condition(
                           +[](std::map<uint64_t, size_t>* r) { return r->size() == 32; }, &replies),
                       until);
  ASSERT_EQ(replies.size(), 32u);
  for (const auto& [id, bytes] : replies) EXPECT_EQ(bytes, id * 1000);

  // Another secret: refused, and named as such; an address nobody listens on: UNAVAILABLE.
  auto stranger = rpc::direct::Channel::start(rpc::auth::derive_token("guess"), 1, 1 << 20, absl::Seconds(10), {});
  ASSERT_TRUE(stranger.ok());
  EXPECT_EQ((*stranger)->connect(address, 3, false, soon()).status().code(), absl::StatusCode::kUnauthenticated);
  (*stranger)->stop(milliseconds(1000));
  server->reset();  // its listener closed
  auto gone = (*client)->connect(address, 3, false, soon());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  (*client)->stop(milliseconds(1000));
}

// Whoever holds a worker's Unix-socket name (bound after the worker died) gets no job token from a member that
// connects: the hello proves the token without carrying it, and a server that cannot prove it in turn is refused
// (before, a Unix-socket hello carried the token in clear).
TEST(UnitDirectHandshake, AServerHoldingTheSocketNameLearnsNoTokenAndIsRefused) {
  const std::string token = rpc::auth::derive_token("unit-secret");
  const std::string name = "tandem-test-squat-" + std::to_string(getpid());
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // abstract, as the channel's own names
  const socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  ASSERT_EQ(listen(listener, 1), 0);
  const auto soon = [] { return absl::Now() + absl::Seconds(10); };
  std::string hello_bytes;
  std::thread squatter([&] {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    rpc::direct::Conn conn(fd);
    (void)conn.write(rpc::direct::Kind::kChallenge, 0, rpc::direct::encode_challenge(rpc::auth::random_secret()),
                     soon());
    auto hello = conn.read(1 << 16, soon());
    if (hello.ok()) {
      grpc::Slice flat;
      if (hello->body.buffer().DumpToSingleSlice(&flat).ok()) {
        hello_bytes.assign(reinterpret_cast<const char*>(flat.begin()), flat.size());
      }
    }
    tandem::wire::DirectWelcome welcome;  // no proof: it does not hold the token
    welcome.set_wire_version(rpc::kWireVersion);
    welcome.set_cma_ok(true);
    grpc::Slice welcome_bytes(welcome.SerializeAsString());
    (void)conn.write(rpc::direct::Kind::kWelcome, 0, grpc::ByteBuffer(&welcome_bytes, 1), soon());
  });
  auto member = rpc::direct::Channel::start(token, 1, 1 << 20, absl::Seconds(10), {});
  ASSERT_TRUE(member.ok()) << member.status();
  auto conn = (*member)->connect(name, 3, /*for_responses=*/false, soon());
  squatter.join();
  close(listener);
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnauthenticated) << conn.status();
  ASSERT_FALSE(hello_bytes.empty()) << "the member sent no hello";
  EXPECT_EQ(hello_bytes.find(token), std::string::npos) << "the hello carries the job token";
  (*member)->stop(milliseconds(1000));
}

// A message that waits for the socket behind another (whose peer has stopped reading) gives up at its own deadline,
// not the other's, having written nothing: the connection stays usable (before, it waited out the other writer).
TEST(UnitDirectConn, AWriterWaitsForAnotherOnlyUntilItsOwnDeadline) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
  rpc::direct::Conn conn(fds[0]);  // nobody reads fds[1] until the end
  grpc::Slice big(std::string(32 << 20, 'x'));
  std::atomic<bool> stuck_done{false};
  absl::Status stuck;
  std::thread writer([&] {
    stuck = conn.write(rpc::direct::Kind::kRequest, 1, grpc::ByteBuffer(&big, 1), absl::Now() + absl::Seconds(8));
    stuck_done = true;
  });
  std::this_thread::sleep_for(milliseconds(300));  // the big message fills the socket and waits for room
  EXPECT_FALSE(stuck_done.load());
  grpc::Slice small(std::string("small"));
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s =
      conn.write(rpc::direct::Kind::kRequest, 2, grpc::ByteBuffer(&small, 1), absl::Now() + absl::Milliseconds(300));
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("still sending another message"));
  EXPECT_LT(waited, std::chrono::seconds(3)) << "the small message waited out the big one's deadline";
  // The reader comes back: the big message goes through, and the connection still carries messages.
  std::thread reader([&] {
    char buf[1 << 16];
    size_t total = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    const size_t want = (32u << 20) + 2 * 24 + 5;  // two headers and both bodies
    while (total < want && std::chrono::steady_clock::now() < until) {
      const ssize_t n = ::read(fds[1], buf, sizeof buf);
      if (n > 0) {
        total += static_cast<size_t>(n);
      } else {
        std::this_thread::sleep_for(milliseconds(1));
      }
    }
    EXPECT_EQ(total, want);
  });
  writer.join();
  EXPECT_TRUE(stuck.ok()) << stuck;
  EXPECT_FALSE(conn.broken.load());
  EXPECT_TRUE(
      conn.write(rpc::direct::Kind::kRequest, 3, grpc::ByteBuffer(&small, 1), absl::Now() + absl::Seconds(5)).ok());
  reader.join();
  ::close(fds[1]);
}

// The loop threads' places (direct.h, Threads), in one process over a Unix socket: a client per thread, each on its own
// connection, calling a server whose handler is the test's.
class UnitDirectPlaces : public ::testing::Test {
 protected:
  // Starts the server: `threads` loop threads, `running` places.
  void start(int threads, int running, std::function<void(uint64_t)> handler,
             absl::Duration stuck_after = absl::Milliseconds(5)) {
    rpc::direct::Channel::Callbacks callbacks;
    callbacks.on_request = [handler](const std::shared_ptr<rpc::direct::Conn>& conn, rpc::direct::Message m) {
      handler(m.call_id);
      (void)conn->write(rpc::direct::Kind::kResponse, m.call_id, m.body, absl::Now() + absl::Seconds(30));
    };
    auto server =
        rpc::direct::Channel::start(token_, threads, 1 << 20, absl::Seconds(30), callbacks, "", running, stuck_after);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    rpc::direct::Channel::Callbacks client_callbacks;
    client_callbacks.on_response = [this](const std::shared_ptr<rpc::direct::Conn>&, rpc::direct::Message m) {
      std::lock_guard<std::mutex> lock(replies_mu_);
      replies_.insert(m.call_id);
      replies_cv_.notify_all();
    };
    auto client = rpc::direct::Channel::start(token_, 1, 1 << 20, absl::Seconds(30), client_callbacks);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  // Waits up to 30 s for the response to call `id` on a connection for responses; false if none came.
  bool await_reply(uint64_t id) {
    std::unique_lock<std::mutex> lock(replies_mu_);
    return replies_cv_.wait_for(lock, std::chrono::seconds(30), [&] { return replies_.count(id) > 0; });
  }
  // One call on a connection of its own; the reply's status.
  absl::Status call(uint64_t id) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    auto conn = client_->connect(server_->address(), 1, /*for_responses=*/false, deadline);
    if (!conn.ok()) return conn.status();
    grpc::Slice slice(std::string("x"));
    if (auto s = (*conn)->write(rpc::direct::Kind::kRequest, id, grpc::ByteBuffer(&slice, 1), deadline); !s.ok()) {
      return s;
    }
    return (*conn)->read(1 << 20, deadline).status();
  }
  // The watcher's looks once it rests (none for 200 ms); -1 if it did not within 30 s.
  int64_t looks_once_resting() {
    for (const absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
      const int64_t before = server_->place_counts().looks;
      std::this_thread::sleep_for(milliseconds(200));
      if (server_->place_counts().looks == before) return before;
    }
    return -1;
  }
  void TearDown() override {
    if (client_) client_->stop(milliseconds(1000));
    if (server_) EXPECT_TRUE(server_->stop(milliseconds(5000)));
  }

  // set_serve_spin's test on one connection: `call(id)` makes a call and waits for its reply.
  // `one_call`: the connection is rpc_sync's kind, so the poll is poll_answered's.
  void check_serve_spin(const std::function<void(uint64_t)>& call, bool one_call);

  const std::string token_ = rpc::auth::derive_token("unit-secret");
  std::unique_ptr<rpc::direct::Channel> server_, client_;
  std::mutex replies_mu_;
  std::condition_variable replies_cv_;
  std::set<uint64_t> replies_;  // call ids whose responses came on a connection for responses
};

// set_serve_spin: the thread that served a message polls for the next one; calls that follow their replies at once are
// found by the poll, and when calls come further apart than the poll, polls become rare (one in kSpinProbeEvery after
// kSpinMissesBeforeBackoff misses in a row, and each hit may give back that many full polls). On rpc_sync's
// connections (one call at a time) the thread polls that connection alone (poll_answered); on a connection that
// carries calls in flight, the epoll set (wait_event).
TEST_F(UnitDirectPlaces, AServingThreadPollsForTheNextCallAndBacksOffWhenNoneComes) {
  start(1, 1, [](uint64_t) {});
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto conn = client_->connect(server_->address(), 1, /*for_responses=*/false, deadline);
  ASSERT_TRUE(conn.ok()) << conn.status();
  check_serve_spin(
      [&](uint64_t id) {
        grpc::Slice slice(std::string("x"));
        ASSERT_TRUE((*conn)->write(rpc::direct::Kind::kRequest, id, grpc::ByteBuffer(&slice, 1), deadline).ok());
        ASSERT_TRUE((*conn)->read(1 << 20, deadline).ok());
      },
      /*one_call=*/true);
}

TEST_F(UnitDirectPlaces, AServingThreadPollsTheEpollSetForTheNextOfCallsInFlight) {
  start(1, 1, [](uint64_t) {});
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto conn = client_->connect(server_->address(), 1, /*for_responses=*/true, deadline);
  ASSERT_TRUE(conn.ok()) << conn.status();
  check_serve_spin(
      [&](uint64_t id) {
        grpc::Slice slice(std::string("x"));
        ASSERT_TRUE((*conn)->write(rpc::direct::Kind::kRequest, id, grpc::ByteBuffer(&slice, 1), deadline).ok());
        ASSERT_TRUE(await_reply(id)) << "no reply to call " << id;
      },
      /*one_call=*/false);
}

void UnitDirectPlaces::check_serve_spin(const std::function<void(uint64_t)>& call, bool one_call) {
  // Off (the channel's default): no poll.
  for (uint64_t i = 1; i <= 10; ++i) call(i);
  EXPECT_EQ(server_->place_counts().serve_spins, 0);
  // Back to back, with a poll far longer than a call's turn-around (20 ms, so a busy machine cannot make it miss):
  // every poll but those after the last call of a burst finds the next call.
  server_->set_serve_spin(std::chrono::microseconds(20000));
  auto before = server_->place_counts();
  constexpr int kQuick = 40;
  for (uint64_t i = 0; i < kQuick; ++i) call(100 + i);
  auto after = server_->place_counts();
  EXPECT_GE(after.serve_spins - before.serve_spins, kQuick - 1);
  // The polls after calls 1 to 39 (the one after the last may not have begun when the counts are read) find the next
  // call; one may miss where the machine keeps this thread from its core for 20 ms.
  EXPECT_GE(after.serve_spin_hits - before.serve_spin_hits, kQuick - 2);
  if (one_call) {
    EXPECT_EQ(after.answered_polls - before.answered_polls, after.serve_spins - before.serve_spins);
  } else {
    EXPECT_EQ(after.answered_polls, 0);
  }
  // Calls 20 ms apart against a 100 us poll: misses, and after the first few, polls only now and then.
  server_->set_serve_spin(std::chrono::microseconds(100));
  std::this_thread::sleep_for(milliseconds(50));  // the last 20 ms poll is over
  before = server_->place_counts();
  constexpr int kSparse = 64;
  for (uint64_t i = 0; i < kSparse; ++i) {
    call(200 + i);
    std::this_thread::sleep_for(milliseconds(20));
  }
  after = server_->place_counts();
  const int64_t spins = after.serve_spins - before.serve_spins, hits = after.serve_spin_hits - before.serve_spin_hits;
  EXPECT_GE(spins, 1);
  EXPECT_LE(spins, 8 * (hits + 1) + kSparse / 16 + 1) << "hits " << hits;  // 13 when no poll found a call
}

// rpc_sync's connections read a message's header and the start of its body in one read (Conn::set_one_call_at_a_time):
// bodies shorter than, as long as, and longer than that first read, and none, arrive whole both ways.
TEST_F(UnitDirectPlaces, OneCallAtATimeBodiesOfEverySizeArriveWhole) {
  start(1, 1, [](uint64_t) {});
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto conn = client_->connect(server_->address(), 1, /*for_responses=*/false, deadline);
  ASSERT_TRUE(conn.ok()) << conn.status();
  uint64_t id = 0;
  for (size_t size : {0, 1, 23, 24, 25, 4071, 4095, 4096, 4097, 4120, 100000, 1000000}) {
    std::string bytes(size, '\0');
    for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 131 + size) & 0xff);
    grpc::Slice slice(bytes);
    ASSERT_TRUE((*conn)->write(rpc::direct::Kind::kRequest, ++id, grpc::ByteBuffer(&slice, 1), deadline).ok());
    auto reply = (*conn)->read(1 << 20, deadline);
    ASSERT_TRUE(reply.ok()) << size << ": " << reply.status();
    EXPECT_EQ(reply->call_id, id);
    grpc::ByteBuffer body;
    body.Swap(&reply->body.buffer());
    std::string back;
    if (body.Valid()) {
      grpc::Slice flat;
      ASSERT_TRUE(body.DumpToSingleSlice(&flat).ok());
      back.assign(reinterpret_cast<const char*>(flat.begin()), flat.size());
    }
    EXPECT_TRUE(back == bytes) << "body of " << size << " bytes came back as " << back.size() << " other bytes";
  }
}

// A client that sends a second message with its first on an rpc_sync connection breaks the rule it announced: the
// server closes that connection (the client's read fails) and goes on serving others.
TEST_F(UnitDirectPlaces, ASecondMessageWithTheFirstOnAOneCallAtATimeConnectionClosesIt) {
  start(1, 1, [](uint64_t) {});
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  auto conn = client_->connect(server_->address(), 1, /*for_responses=*/false, deadline);
  ASSERT_TRUE(conn.ok()) << conn.status();
  std::string two;
  for (uint64_t id : {1, 2}) {
    const uint32_t magic = 0x4d444e54, kind = static_cast<uint32_t>(rpc::direct::Kind::kRequest);
    const uint64_t length = 1;
    two.append(reinterpret_cast<const char*>(&magic), 4);
    two.append(reinterpret_cast<const char*>(&kind), 4);
    two.append(reinterpret_cast<const char*>(&id), 8);
    two.append(reinterpret_cast<const char*>(&length), 8);
    two.push_back('x');
  }
  ASSERT_EQ(::write((*conn)->fd(), two.data(), two.size()), static_cast<ssize_t>(two.size()));
  auto reply = (*conn)->read(1 << 20, deadline);
  EXPECT_FALSE(reply.ok()) << "the server answered call " << reply->call_id;
  EXPECT_TRUE(call(3).ok());
}

TEST_F(UnitDirectPlaces, AtMostRunningThreadsRunMessagesAtOnce) {
  std::atomic<int> now{0}, most{0};
  start(/*threads=*/4, /*running=*/1, [&](uint64_t) {
    const int n = ++now;
    for (int seen = most.load(); n > seen && !most.compare_exchange_weak(seen, n);) {
    }
    std::this_thread::sleep_for(milliseconds(1));
    --now;
  });
  std::vector<std::thread> clients;
  std::atomic<int> failed{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 10; ++i) failed += call(c * 100 + i).ok() ? 0 : 1;
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(failed.load(), 0);
  // Four threads would run four messages at once; one place runs one, and a second only when the watching thread
  // presumed it blocked because none finished for a while (a sleep is out of Tandem's sight).
  EXPECT_LE(most.load(), 1 + server_->place_counts().presumed_blocked);
  EXPECT_EQ(server_->place_counts().lent, 0);
}

TEST_F(UnitDirectPlaces, AMessageBlockedInATandemWaitLendsItsPlace) {
  Notification released;
  std::atomic<bool> saw_release{false};
  // No message is ever presumed blocked here: only the lent place can run the second.
  start(
      /*threads=*/2, /*running=*/1,
      [&](uint64_t id) {
        if (id == 1) saw_release = released.WaitForNotificationWithTimeout(absl::Seconds(30));
        if (id == 2) released.Notify();
      },
      /*stuck_after=*/absl::Hours(1));
  std::thread blocked([&] { EXPECT_TRUE(call(1).ok()); });
  // The first message has lent its place (its wait is a Tandem wait) before the second is sent: the other thread
  // runs it in that place, not in one beyond the limit.
  poll_until(std::chrono::seconds(30), [&] { return server_->place_counts().lent != 0; });
  ASSERT_EQ(server_->place_counts().lent, 1);
  EXPECT_TRUE(call(2).ok());
  blocked.join();
  EXPECT_TRUE(saw_release.load());
  EXPECT_EQ(server_->place_counts().presumed_blocked, 0);
}

// A handler for two messages: the first waits out of Tandem's sight (a std::condition_variable) until the second runs.
struct BlockedOutOfSight {
  void operator()(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu);
    if (id == 1) {
      started = true;
      saw_release = cv.wait_for(lock, std::chrono::seconds(30), [&] { return released; });
    } else {
      released = true;
      cv.notify_all();
    }
  }
  // Sends the first on a thread of its own, and the second once the first began; how long the second took.
  std::chrono::steady_clock::duration run(const std::function<absl::Status(uint64_t)>& call) {
    std::thread blocked([&] { EXPECT_TRUE(call(1).ok()); });
    poll_until(std::chrono::seconds(30), [&] { return started.load(); });
    const auto sent = std::chrono::steady_clock::now();
    EXPECT_TRUE(call(2).ok());
    const auto waited = std::chrono::steady_clock::now() - sent;
    blocked.join();
    EXPECT_TRUE(saw_release.load());
    return waited;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::atomic<bool> started{false}, saw_release{false};
};

TEST_F(UnitDirectPlaces, AMessageBlockedOutOfSightGetsAnotherThreadAPlace) {
  BlockedOutOfSight blocked;
  start(/*threads=*/2, /*running=*/1, [&](uint64_t id) { blocked(id); });
  const auto waited = blocked.run([this](uint64_t id) { return call(id); });
  EXPECT_EQ(server_->place_counts().lent, 0);
  EXPECT_GE(server_->place_counts().presumed_blocked, 1);
  std::cout << "the second message ran after " << std::chrono::duration<double, std::milli>(waited).count()
            << " ms (a message is presumed blocked when none finished for 5 ms twice)\n";
}

// The watcher does not wake an idle worker every 5 ms: after 4 looks at which a place waited in epoll it rests, and a
// message blocked out of sight after that rest is still found (the thread that took the last place out of epoll woke
// the watcher).
TEST_F(UnitDirectPlaces, TheWatcherRestsWhileIdleAndWakesForTheNextMessage) {
  BlockedOutOfSight blocked;
  start(/*threads=*/3, /*running=*/1, [&](uint64_t id) { blocked(id); });
  // 4 looks of 5 ms: it rests after about 20 ms (later on a busy machine); then it looks no more.
  const int64_t looks = looks_once_resting();
  ASSERT_GE(looks, 4) << "the watcher never rested";
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(server_->place_counts().looks, looks);

  blocked.run([this](uint64_t id) { return call(id); });
  EXPECT_GE(server_->place_counts().presumed_blocked, 1);
  EXPECT_GT(server_->place_counts().looks, looks);
}

// Nor a busy one whose places are not all taken (a trainer between its calls, a server with a message at a time): the
// watcher rested before kept resting while messages ran one at a time on one of two places (before, it looked every
// 5 ms as long as messages kept beginning: about 100 times in these 500 ms).
TEST_F(UnitDirectPlaces, TheWatcherRestsWhileMessagesLeaveAPlaceFree) {
  start(/*threads=*/3, /*running=*/2, [](uint64_t) {});
  // One connection (made before the watcher is watched: its hello may find both places busy), one call at a time, a
  // millisecond apart (the caller computes between its calls; calls back to back would find both places out of epoll
  // now and then: the next request taken while the last reply's thread finishes).
  auto conn = client_->connect(server_->address(), 1, /*for_responses=*/false, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(conn.ok()) << conn.status();
  const int64_t looks = looks_once_resting();
  ASSERT_GE(looks, 4) << "the watcher never rested";
  // Under a slower build (TANDEM_TEST_TIME_SCALE) the calls are as much further apart, so that a message's thread is
  // back in epoll before the next one comes, and the window as much longer.
  const auto apart = scaled(milliseconds(1));
  int calls = 0;
  const absl::Time begin = absl::Now(), end = begin + absl::FromChrono(scaled(milliseconds(500)));
  for (; absl::Now() < end; ++calls) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    grpc::Slice slice(std::string("x"));
    ASSERT_TRUE((*conn)->write(rpc::direct::Kind::kRequest, calls, grpc::ByteBuffer(&slice, 1), deadline).ok());
    ASSERT_TRUE((*conn)->read(1 << 20, deadline).ok());
    std::this_thread::sleep_for(apart);
  }
  const int64_t elapsed_ms = absl::ToInt64Milliseconds(absl::Now() - begin);
  const int64_t busy_looks = server_->place_counts().looks - looks;
  std::cout << calls << " calls in " << elapsed_ms << " ms, " << busy_looks << " looks\n";
  // Half the old watcher's count: a thread late back into epoll now and then (a busy machine) costs about 5 looks.
  EXPECT_LT(busy_looks, elapsed_ms / 10);
}

// A chain of messages each waiting out of sight for the next, on 3 threads and 1 place: each thread that takes the
// place of one presumed blocked leaves another parked thread watching, so the chain's end runs and releases it all.
TEST_F(UnitDirectPlaces, AChainOfMessagesBlockedOutOfSightUnwinds) {
  std::mutex mu;
  std::condition_variable cv;
  std::set<uint64_t> done;
  std::atomic<int> started{0}, released{0};
  start(/*threads=*/3, /*running=*/1, [&](uint64_t id) {
    ++started;
    std::unique_lock<std::mutex> lock(mu);
    // 1 waits for 2, 2 for 3; 3 waits for nothing.
    if (id < 3 && cv.wait_for(lock, std::chrono::seconds(30), [&] { return done.count(id + 1) > 0; })) ++released;
    done.insert(id);
    cv.notify_all();
  });
  std::vector<std::thread> callers;
  for (uint64_t id = 1; id <= 3; ++id) {
    callers.emplace_back([this, id] { EXPECT_TRUE(call(id).ok()); });
    poll_until(std::chrono::seconds(30), [&] { return started >= static_cast<int>(id); });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(released.load(), 2);
  EXPECT_GE(server_->place_counts().presumed_blocked, 2);
}

TEST_F(MultiprocDirect, HostileClientsAreTurnedAway) {
  constexpr int kLimit = 1 << 20;
  rpc::RpcOptions options = options_from_env();
  options.max_message_bytes = kLimit;
  start_direct({.world_size = 2, .extra_env = {{"TANDEM_TEST_MAX_MSG", std::to_string(kLimit)}}}, options);
  const std::string address = direct_address(1);
  ASSERT_FALSE(address.empty());
  const auto soon = [] { return absl::Now() + absl::Seconds(10); };

  // The wrong job token is rejected at the handshake; the right one is welcomed (with the bulk path: same host).
  auto intruder = rpc::direct::Channel::start(rpc::auth::derive_token("guess"), 1, 1 << 20, absl::Seconds(10), {});
  ASSERT_TRUE(intruder.ok());
  EXPECT_EQ((*intruder)->connect(address, 5, false, soon()).status().code(), absl::StatusCode::kUnauthenticated);
  auto member = rpc::direct::Channel::start(rpc::auth::derive_token(job_->secret()), 1, 1 << 20, absl::Seconds(10), {});
  ASSERT_TRUE(member.ok());
  auto conn = (*member)->connect(address, 5, false, soon());
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_TRUE((*conn)->cma_ok);

  // Bytes that are not a message, and a header claiming more than the message limit: the connection is closed.
  int fd = raw_connect(address);
  ASSERT_GE(fd, 0);
  const std::string http = "GET / HTTP/1.1\r\nHost: tandem\r\n\r\n";
  ASSERT_EQ(write(fd, http.data(), http.size()), static_cast<ssize_t>(http.size()));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  // Strangers that send half a header and stall hold no thread: more of them than the worker has threads (16), and
  // it still answers.
  std::vector<int> stalled;
  for (int i = 0; i < 20; ++i) {
    stalled.push_back(raw_connect(address));
    ASSERT_EQ(write(stalled.back(), "TNDM", 4), 4);
  }
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami", milliseconds(10000)), "worker1");
  for (int s : stalled) close(s);
  pb::Request whoami;
  whoami.set_function("whoami");
  auto oversized = (*member)->connect(address, 5, false, soon());
  ASSERT_TRUE(oversized.ok());
  (void)(*oversized)->write(rpc::direct::Kind::kRequest, 1, make_frame(whoami, std::string(2 * kLimit, 'x')), soon());
  EXPECT_FALSE((*oversized)->read(16 << 20, soon()).ok());  // closed: the header announced more than the limit

  // A request whose tensor lies about where it is in our memory, and one that lies about its size.
  pb::Request lying;
  lying.set_function("echo");
  lying.mutable_args()->add_values()->set_tensor(0);
  auto* meta = lying.mutable_args()->add_tensors();
  meta->set_dtype(static_cast<int>(at::kFloat));
  meta->add_sizes(1024);
  meta->set_nbytes(4096);
  meta->set_by_reference(true);
  meta->set_remote_addr(16);  // unmapped
  auto error_of = [&](const grpc::ByteBuffer& frame) {
    EXPECT_TRUE((*conn)->write(rpc::direct::Kind::kRequest, 7, frame, soon()).ok());
    auto r = (*conn)->read(16 << 20, soon());
    EXPECT_TRUE(r.ok()) << r.status();
    pb::Response response;
    auto f = r.ok() ? rpc::wire::Frame::parse(r->body, &response) : absl::StatusOr<rpc::wire::Frame>(r.status());
    EXPECT_TRUE(f.ok());
    return absl::Status(static_cast<absl::StatusCode>(response.error().code()), response.error().message());
  };
  auto s = error_of(make_frame(lying, ""));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("cross-memory read"), std::string::npos) << s;
  meta->set_by_reference(false);
  EXPECT_EQ(error_of(make_frame(lying, std::string(64, 'x'))).code(), absl::StatusCode::kInvalidArgument);

  (*intruder)->stop(milliseconds(1000));
  (*member)->stop(milliseconds(1000));
  EXPECT_EQ(rpc::rpc_sync<std::string>("worker1", "whoami"), "worker1");  // it kept serving throughout
}

}  // namespace
}  // namespace tandem::test

namespace tandem::test {
namespace {

// A network namespace of this test's own, joined to this one by a veth pair; removed when the object dies.
class TestNetns {
 public:
  TestNetns() {
    const std::string id = std::to_string(getpid() % 100000);
    name_ = "tdm" + id;
    host_if_ = "tdmA" + id;
    const std::string ns_if = "tdmB" + id;
    const std::string cmd = "ip netns add " + name_ + " && ip link add " + host_if_ + " type veth peer name " + ns_if +
                            " && ip link set " + ns_if + " netns " + name_ + " && ip addr add " + host_ip() +
                            "/30 dev " + host_if_ + " && ip link set " + host_if_ + " up && ip -n " + name_ +
                            " addr add " + ns_ip() + "/30 dev " + ns_if + " && ip -n " + name_ + " link set " + ns_if +
                            " up && ip -n " + name_ + " link set lo up";
    ok_ = std::system((cmd + " >/dev/null 2>&1").c_str()) == 0;
  }
  ~TestNetns() {
    std::system(("ip link del " + host_if_ + " >/dev/null 2>&1; ip netns del " + name_ + " >/dev/null 2>&1").c_str());
  }
  bool ok() const { return ok_; }
  const std::string& name() const { return name_; }
  static std::string ip(int host) {
    const int base = static_cast<int>(getpid() % 16384) * 4;
    return "10.213." + std::to_string(base / 256) + "." + std::to_string(base % 256 + host);
  }
  // A /30 of 10.213.0.0/16 of this process's own (ctest may run the namespace tests at once): host .1, namespace .2.
  static std::string host_ip() { return ip(1); }
  static std::string ns_ip() { return ip(2); }

 private:
  std::string name_, host_if_;
  bool ok_ = false;
};

// Rank 1 serving in `netns`, rank 0 (this process) outside, both with `transport`; returns rank 1's process.
std::unique_ptr<Process> join_with_peer_in(const TestNetns& netns, const std::string& transport,
                                           std::unique_ptr<Job>* job) {
  *job = std::make_unique<Job>(JobSpec{.world_size = 1});  // only for its port and secret
  auto env = (*job)->env_for(1);
  env["WORLD_SIZE"] = "2";
  env["MASTER_ADDR"] = TestNetns::host_ip();
  env["TANDEM_TRANSPORT"] = transport;
  auto child = std::make_unique<Process>(
      std::vector<std::string>{"/usr/sbin/ip", "netns", "exec", netns.name(), self_exe(), "--worker", "serve"}, env);
  rpc::RpcOptions options = options_from_env();
  options.transport = transport;
  options.master_addr = TestNetns::host_ip();
  options.master_port = (*job)->port();
  options.secret = (*job)->secret();
  rpc::init_rpc("worker0", 0, 2, options);
  return child;
}

TEST_F(MultiprocDirect, PeerInAnotherNetworkNamespaceIsReachedOverTcp) {
  // Same kernel (same boot id), but the peer's Unix socket lives in another network namespace: the connection attempt
  // at init_rpc fails, and that peer is served by the direct channel's TCP route over the veth link (no cross-memory
  // reads: tensors travel in the stream); with the TCP route off (TANDEM_TRANSPORT=grpc) the next test covers gRPC.
  TestNetns netns;
  if (!netns.ok()) GTEST_SKIP() << "cannot create a network namespace here";
  auto child = join_with_peer_in(netns, "auto", &job_);
  EXPECT_EQ(rpc::transport_to(1), "tcp");
  EXPECT_EQ(rpc::get_worker_info(1).address.rfind(TestNetns::ns_ip(), 0), 0u) << rpc::get_worker_info(1).address;
  const auto before = rpc::transport_stats();
  at::Tensor t = random_tensor(at::kFloat, {300000});
  EXPECT_TRUE(bit_equal(rpc::rpc_sync<at::Tensor>(1, "echo", t), t));
  at::Tensor big = random_tensor(at::kFloat, {3 << 20});  // 12 MiB: over the bulk threshold, yet in the stream
  EXPECT_TRUE(bit_equal(rpc::rpc_sync<at::Tensor>(1, "echo", big), big));
  auto futures = std::vector<rpc::Future>();
  for (int i = 0; i < 64; ++i) futures.push_back(rpc::rpc_async(1, "echo", t));
  for (auto& f : futures) EXPECT_TRUE(bit_equal(f.value().toTensor(), t));
  EXPECT_EQ(rpc::rpc_sync<std::string>(1, "caller"), "worker0");
  const auto after = rpc::transport_stats();
  EXPECT_EQ(after.tensors_by_reference, before.tensors_by_reference);  // never a cross-memory read over TCP
  EXPECT_GT(after.direct_calls, before.direct_calls);
  rpc::shutdown(true);
  EXPECT_EQ(exit_code(child->wait(milliseconds(30000))), 0) << child->output();
}

TEST_F(MultiprocDirect, PeerInAnotherNetworkNamespaceUsesGrpcWhenForced) {
  TestNetns netns;
  if (!netns.ok()) GTEST_SKIP() << "cannot create a network namespace here";
  auto child = join_with_peer_in(netns, "grpc", &job_);
  EXPECT_EQ(rpc::transport_to(1), "grpc");
  at::Tensor t = random_tensor(at::kFloat, {300000});
  EXPECT_TRUE(bit_equal(rpc::rpc_sync<at::Tensor>(1, "echo", t), t));
  rpc::shutdown(true);
  EXPECT_EQ(exit_code(child->wait(milliseconds(30000))), 0) << child->output();
}

TEST_F(MultiprocDirect, TcpRouteRefusesStrangers) {
  // The TCP listener of a worker on another "host": a client without the job's secret is refused at the handshake,
  // one with it is welcomed (without the bulk path), and bytes that are no handshake close the connection.
  TestNetns netns;
  if (!netns.ok()) GTEST_SKIP() << "cannot create a network namespace here";
  auto child = join_with_peer_in(netns, "auto", &job_);
  auto channel =
      rpc::net::make_channel(std::string(TestNetns::host_ip()) + ":" + std::to_string(job_->port()), nullptr, -1);
  auto store = rpc::connect_store(channel, rpc::auth::derive_token(job_->secret()), false);
  auto record = store->get("worker/1", milliseconds(5000));
  ASSERT_TRUE(record.ok()) << record.status();
  tandem::wire::RendezvousRecord parsed;
  ASSERT_TRUE(parsed.ParseFromString(*record));
  const std::string address = parsed.worker().tcp_address();
  ASSERT_EQ(address.rfind(std::string("tcp:") + TestNetns::ns_ip() + ":", 0), 0u) << address;
  const auto soon = [] { return absl::Now() + absl::Seconds(10); };
  auto intruder = rpc::direct::Channel::start(rpc::auth::derive_token("guess"), 1, 1 << 20, absl::Seconds(10), {});
  ASSERT_TRUE(intruder.ok());
  auto refused = (*intruder)->connect(address, 5, false, soon());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  auto member = rpc::direct::Channel::start(rpc::auth::derive_token(job_->secret()), 1, 1 << 20, absl::Seconds(10), {});
  ASSERT_TRUE(member.ok());
  auto conn = (*member)->connect(address, 5, false, soon());
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_FALSE((*conn)->cma_ok);
  // A Unix-socket hello (the token in clear) is no answer to a challenge.
  std::string host_port = address.substr(4);
  const std::string host = host_port.substr(0, host_port.rfind(':'));
  const int port = std::stoi(host_port.substr(host_port.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &sin.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sin), sizeof(sin)), 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  rpc::direct::Conn raw(fd);
  auto challenge = raw.read(1024, soon());
  ASSERT_TRUE(challenge.ok()) << challenge.status();
  EXPECT_EQ(challenge->kind, rpc::direct::Kind::kChallenge);
  tandem::wire::DirectHello in_clear;  // the token itself, as Unix-socket hellos carried it up to wire version 7
  in_clear.set_wire_version(rpc::kWireVersion);
  in_clear.set_token(rpc::auth::derive_token(job_->secret()));
  in_clear.set_rank(5);
  in_clear.set_pid(getpid());
  grpc::Slice in_clear_bytes(in_clear.SerializeAsString());
  ASSERT_TRUE(raw.write(rpc::direct::Kind::kHello, 0, grpc::ByteBuffer(&in_clear_bytes, 1), soon()).ok());
  auto answer = raw.read(1024, soon());
  ASSERT_TRUE(answer.ok()) << answer.status();
  // Refused although the token is right: a hello without a nonce and a proof is malformed.
  EXPECT_EQ(rpc::direct::parse_welcome(answer->body).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(raw.read(1024, soon()).ok());  // and closed
  (*intruder)->stop(milliseconds(1000));
  (*member)->stop(milliseconds(1000));
  EXPECT_EQ(rpc::rpc_sync<std::string>(1, "caller"), "worker0");  // it kept serving
  rpc::shutdown(true);
  EXPECT_EQ(exit_code(child->wait(milliseconds(30000))), 0) << child->output();
}

}  // namespace
}  // namespace tandem::test
