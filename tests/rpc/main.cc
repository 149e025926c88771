// rpc_tests: GoogleTest main, and the worker side of the multi-process tests (`rpc_tests --worker <scenario>`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sched.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <thread>

#include <torch/jit.h>

#include "tandem/rpc/batching.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/script.h"
#include "tandem/sync/sync.h"
#include "tests/common/spawner.h"
#include "tests/common/test_env.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

std::atomic<int64_t> g_late_static_calls{0};  // calls of "late_static" answered in this process
std::atomic<bool> g_late_static_gone{false};  // its static's destructor has begun (trivially destructible itself)
// The static of "late_static": its destructor says it has begun, then takes 300 ms, so that without RPC stopped first
// calls still arrive while it runs and see it.
struct LateStatic {
  std::atomic<int64_t> sum{0};
  ~LateStatic() {
    g_late_static_gone = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// Waits for `n` callers and answers them all with the sum of their tensors: an "async execution" function holding no
// server thread while it waits (the batching pattern of parameter servers).
rpc::Future gather_sum(int64_t n, at::Tensor x) {
  static std::mutex mu;
  static std::vector<rpc::Future> waiting;
  static at::Tensor sum;
  rpc::Future mine;
  std::vector<rpc::Future> ready;
  at::Tensor result;
  {
    std::lock_guard<std::mutex> lock(mu);
    sum = sum.defined() ? sum + x : x.clone();
    waiting.push_back(mine);
    if (static_cast<int64_t>(waiting.size()) == n) {
      ready.swap(waiting);
      result = sum;
      sum = at::Tensor();
    }
  }
  for (auto& f : ready) f.set_value(result);
  return mine;
}

// A value's TorchScript type as it arrived ("List[int]", "Dict[str, Tensor]"), tensors as "Tensor[<dtype>]".
std::string describe(const c10::IValue& v) {
  if (v.isTensor()) return "Tensor[" + std::string(c10::toString(v.toTensor().scalar_type())) + "]";
  return v.type()->annotation_str();
}

// FNV-1a of `n` bytes: the Python client's tests compute the same over what they sent.
int64_t fnv1a(const void* data, size_t n) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

int run_worker(const std::string& scenario) {
  // What the harness gave this worker (MultiprocHarness): how it was started, two variables, an exit code of 7.
  if (scenario == "harness_probe") {
    std::ifstream in("/proc/self/cmdline");
    const std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::cout << "forked=" << (cmdline.find("--worker") == std::string::npos ? 1 : 0) << "\n";
    for (const char* v : {"TANDEM_PROBE_FROM_TEST", "TANDEM_PROBE_EXTRA", "HOME"}) {
      std::cout << v << "=" << (std::getenv(v) ? std::getenv(v) : "") << "\n";
    }
    std::cerr << "probe-stderr\n";
    return 7;
  }
  if (scenario == "env_dump") {
    for (const char* v :
         {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"}) {
      std::cout << v << "=" << (std::getenv(v) ? std::getenv(v) : "") << "\n";
    }
    std::cout << "SECRET_SET=" << (std::getenv("TANDEM_SECRET") && *std::getenv("TANDEM_SECRET") ? 1 : 0) << "\n";
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    std::string list;
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &cpus)) list += (list.empty() ? "" : ",") + std::to_string(c);
      }
    }
    std::cout << "CPUS=" << list << "\n";
    return 0;
  }
  // A line of 150,000 bytes with a NUL in it, another line, and a last one without a newline (MultiprocLauncher).
  if (scenario == "long_line") {
    std::string line(150000, 'x');
    line[70000] = '\0';
    std::cout << line << "\nshort\nlast-without-newline" << std::flush;
    return 0;
  }
  if (scenario == "fail_if_rank1") {
    if (env_int("RANK", 0) == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::cerr << "rank 1 gives up\n";
      return 3;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (scenario == "held_by_tracer") {
    // Rank 0 is held by a tracer (a child of its own that never waits for it): killed, it stays a zombie its parent
    // cannot reap until the tracer exits, 30 s later (as a worker stuck in the kernel would not go). Rank 1 fails
    // once rank 0 is traced.
    const char* mark = std::getenv("TANDEM_TEST_MARK");
    if (!mark) return 5;
    if (env_int("RANK", 0) == 1) {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!std::ifstream(mark).good() && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      std::cerr << "rank 1 gives up\n";
      return 3;
    }
    int ready[2], allowed[2];
    if (pipe(ready) != 0 || pipe(allowed) != 0) return 6;
    const pid_t self = getpid();
    const pid_t tracer = fork();
    if (tracer == 0) {  // only async-signal-safe calls here
      setsid();         // outside rank 0's process group, as a debugger would be: the launcher's stop does not reach it
      close(ready[0]);
      close(allowed[1]);
      char go = 0;
      (void)!read(allowed[0], &go, 1);  // once the parent let it trace (Yama's ptrace_scope 1 needs that)
      const char ok = ptrace(PTRACE_SEIZE, self, nullptr, nullptr) == 0 ? 1 : 0;
      (void)!write(ready[1], &ok, 1);
      if (ok) sleep(30);
      _exit(0);
    }
    close(ready[1]);
    close(allowed[0]);
    if (tracer > 0) {
      (void)prctl(PR_SET_PTRACER, tracer, 0, 0, 0);  // EINVAL without Yama: nothing to allow then
      const char go = 1;
      (void)!write(allowed[1], &go, 1);
    }
    char ok = 0;
    if (tracer < 0 || read(ready[0], &ok, 1) != 1 || !ok) {
      std::cerr << "could not be traced\n";
      return 4;
    }
    std::ofstream(mark) << "traced\n";
    std::cout << "rank 0 is held by a tracer" << std::endl;
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (scenario == "exit_while_called") {
    // Rank 1 calls rank 0's "late_static" until it fails; rank 0 returns from main without shutdown once it has
    // answered some of those calls: the calls' static, built after init_rpc, is destroyed in exit, and the calls must
    // not run into it (RPC stops first).
    const int rank = env_int("RANK", 0);
    rpc::init_rpc("worker" + std::to_string(rank), rank, 2, options_from_env());
    if (rank == 1) {
      try {
        for (;;) rpc::rpc_sync<int64_t>(0, "late_static", std::vector<int64_t>{1, 2, 3});
      } catch (const std::exception& e) {
        std::cout << "the calls ended: " << e.what() << std::endl;
      }
      rpc::shutdown(false);
      return 0;
    }
    if (!poll_until(std::chrono::milliseconds(20000), [] { return g_late_static_calls.load() >= 200; })) {
      std::cerr << "rank 1's calls did not come\n";
      return 5;
    }
    std::cout << "leaving while called" << std::endl;
    return 0;
  }
  if (scenario == "exit_without_shutdown") {
    rpc::init_rpc("worker" + std::to_string(env_int("RANK", 0)), env_int("RANK", 0), env_int("WORLD_SIZE", 1),
                  options_from_env());
    std::cout << "leaving without shutdown" << std::endl;
    return 0;  // the at-exit handler must stop RPC without hanging
  }
  return run_worker_job([&] {
    if (scenario == "hello") {
      const int next = (env_int("RANK", 0) + 1) % env_int("WORLD_SIZE", 1);
      std::cout << rpc::rpc_sync<std::string>(next, "whoami") << " answered " << rpc::get_worker_info().name << "\n";
    }
  });
}

}  // namespace

// A codec for a kind the wire format does not know (c10::Device), whose decoding makes the call wait 100 ms for a
// future another thread completes: the "delayed" flag tells the function (or the caller) that the wait happened first.
std::atomic<int> g_device_waits_done{0};
std::atomic<int> g_stop_soon_calls{0};

void register_device_codec() {
  rpc::ValueCodec codec;
  codec.kind = "test.device";
  codec.matches = [](const c10::IValue& v) { return v.isDevice(); };
  codec.encode = [](const c10::IValue& v, int to) -> absl::StatusOr<std::string> {
    return v.toDevice().str() + "@" + std::to_string(to);
  };
  codec.decode = [](const std::string& data, int from, std::vector<rpc::Future>* wait) -> absl::StatusOr<c10::IValue> {
    rpc::Future later;
    std::thread([later] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ++g_device_waits_done;
      later.set_value(c10::IValue());
    }).detach();
    wait->push_back(later);
    const auto at = data.find('@');
    if (at == std::string::npos || from < 0) return absl::InvalidArgumentError("bad test.device");
    return c10::IValue(c10::Device(data.substr(0, at)));
  };
  rpc::register_value_codec(codec);
}

void register_test_functions() {
  register_device_codec();
  rpc::register_function("device_echo", [](c10::IValue device) {
    // Runs only after the codec's wait: the counter has moved.
    return std::make_tuple(device, static_cast<int64_t>(g_device_waits_done.load()));
  });
  rpc::register_function("echo", [](c10::IValue v) { return v; });
  // Calls `fn` on worker `to` without waiting for the reply (a test's way to make a call that worker answers).
  rpc::register_function("call_in_background", [](int64_t to, std::string fn) {
    rpc::rpc_async(static_cast<int>(to), fn).add_callback([](const rpc::Future&) {});
  });
  rpc::register_function("add", [](at::Tensor a, at::Tensor b) { return a + b; });
  rpc::register_function("whoami", [] { return rpc::get_worker_info().name; });
  // A static first built by a call (after init_rpc), destroyed in exit: a call that runs after its destructor began
  // ends the process with 7 (exit_while_called).
  rpc::register_function("late_static", [](std::vector<int64_t> v) {
    static LateStatic s;
    if (g_late_static_gone) {
      std::fputs("a call ran into a destroyed static\n", stderr);
      std::_Exit(7);
    }
    s.sum.fetch_add(static_cast<int64_t>(v.size()));
    g_late_static_calls.fetch_add(1);
    return s.sum.load();
  });
  rpc::register_function("caller", [] { return rpc::current_call()->caller_name; });
  auto sleep_ms = [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return rpc::get_worker_info().id;
  };
  rpc::register_function("sleep_ms", sleep_ms);
  // The same under a name only MultiprocRpc.SyncCallsDoNotSpinForRepliesKnownToBeSlow calls: a caller keeps each
  // function's last reply time (whether rpc_sync spins), and a test process runs its suite's other tests too.
  rpc::register_function("spin_probe", sleep_ms);
  // Counts its calls in this process: how many times a request ran (duplicated, reordered); "bumps" reads the count,
  // "bump_tensor"(tensor) counts one too.
  static std::atomic<int64_t> bumps{0};
  rpc::register_function("bump", [] { return ++bumps; });
  rpc::register_function("bump_tensor", [](at::Tensor t) { return t.numel() > 0 ? ++bumps : bumps.load(); });
  rpc::register_function("bumps", [] { return bumps.load(); });
  rpc::register_function("bump_any", [](c10::IValue) { return ++bumps; });  // counts a call whatever its argument
  rpc::register_function("oneway_failures", [] { return rpc::transport_stats().oneway_failures; });
  // A message (run inline when sent one-way on the direct channel): counts as a bump, and keeps who sent it.
  static Mutex message_mu;
  static std::string message_caller;
  rpc::register_message("bump_message", [](at::Tensor t) {
    const rpc::CallContext* call = rpc::current_call();
    MutexLock lock(&message_mu);
    message_caller = call ? call->caller_name + "/" + std::to_string(call->caller_rank) : "(none)";
    if (t.numel() > 0) ++bumps;
  });
  rpc::register_message("message_throw", [](std::string msg) { throw std::runtime_error(msg); });
  rpc::register_function("message_caller", [] {
    MutexLock lock(&message_mu);
    return message_caller;
  });
  rpc::register_function("inline_messages", [] { return rpc::transport_stats().inline_messages; });
  rpc::register_function("leases_lapsed", [] { return rpc::transport_stats().leases_lapsed; });
  rpc::register_function("place_counts", [] {
    const auto stats = rpc::transport_stats();
    return std::vector<int64_t>{stats.places_lent, stats.presumed_blocked};
  });
  // An agent's "stop": the test that calls it shuts this worker down once it has begun, while it still runs.
  rpc::register_function("stop_soon", [] {
    ++g_stop_soon_calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return int64_t{1};
  });
  rpc::register_function("serve_spin_counts", [] {
    const auto stats = rpc::transport_stats();
    return std::vector<int64_t>{stats.serve_spins, stats.serve_spin_hits};
  });
  rpc::register_function("throw_error", [](std::string msg) -> int64_t { throw std::runtime_error(msg); });
  rpc::register_function("nested_add",
                         [](std::string to, at::Tensor x) { return rpc::rpc_sync<at::Tensor>(to, "add", x, x); });
  rpc::register_function("gather_sum", gather_sum);
  // For the Python client's tests (tests/rpc/python/): how a value arrived here, a tensor's bytes as this side sees
  // them, a tensor made here, and who called.
  rpc::register_function("describe", [](c10::IValue v) { return describe(v); });
  rpc::register_function("digest", [](at::Tensor t) {
    const at::Tensor c = t.contiguous();
    return std::make_tuple(std::string(c10::toString(c.scalar_type())), c.sizes().vec(),
                           fnv1a(c.data_ptr(), c.nbytes()));
  });
  rpc::register_function("pattern", [](int64_t dtype, std::vector<int64_t> sizes) {
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(static_cast<c10::ScalarType>(dtype)));
    auto* bytes = static_cast<uint8_t*>(t.data_ptr());
    const bool is_bool = t.scalar_type() == at::kBool;
    for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = is_bool ? i % 3 == 0 : static_cast<uint8_t>(i * 31 + 7);
    return t;
  });
  rpc::register_function("make_device", [] { return c10::IValue(c10::Device("cpu")); });  // a value of a codec's kind
  rpc::register_function("caller_rank", [] { return static_cast<int64_t>(rpc::current_call()->caller_rank); });
  // Batched: each caller gets (the batch's sum, the batch's size); a negative request makes the function throw.
  rpc::register_batched_function<int64_t, std::tuple<int64_t, int64_t>>(
      "batched_sum", {.max_batch = 3, .max_delay = std::chrono::milliseconds(200)}, [](std::vector<int64_t> xs) {
        int64_t sum = 0;
        for (int64_t x : xs) {
          if (x < 0) throw std::invalid_argument("negative request");
          sum += x;
        }
        return std::vector<std::tuple<int64_t, int64_t>>(xs.size(), {sum, static_cast<int64_t>(xs.size())});
      });
  rpc::register_function("batch_stats", [](std::string name) {
    const rpc::BatchStats s = rpc::batch_stats(name);
    return std::vector<int64_t>{s.batches, s.requests, s.full_batches};
  });
  // Sends a request to `to`'s batched_sum and dies before its answer comes.
  rpc::register_function("batched_call_and_die", [](int64_t to) {
    (void)rpc::rpc_async(static_cast<int>(to), "batched_sum", int64_t{100});
    die_in(std::chrono::milliseconds(50));
  });
  rpc::register_function("later", [](int64_t ms, int64_t value) {
    rpc::Future f;
    std::thread([f, ms, value] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      f.set_value(value);
    }).detach();
    return f;
  });
  rpc::register_function("fail_later", [](std::string msg) {
    rpc::Future f;
    std::thread([f, msg] { f.set_error(absl::AbortedError(msg)); }).detach();
    return f;
  });
  auto cu = torch::jit::compile(
      "def scale(x: Tensor, k: float) -> Tensor:\n"
      "    return x * k\n"
      "def total(xs: List[int]) -> int:\n"
      "    return sum(xs)\n");
  rpc::register_script_function("script_scale", cu, "scale");
  rpc::register_script_function("script_total", cu, "total");
}

}  // namespace tandem::test

int main(int argc, char** argv) {
  tandem::test::spawner::start();  // first: the workers are forked from here (tests/common/spawner.h)
  tandem::test::register_test_functions();
  return tandem::test::test_main(argc, argv, tandem::test::run_worker);
}
