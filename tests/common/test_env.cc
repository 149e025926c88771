#include "tests/common/test_env.h"

#include "tests/common/spawner.h"
#include "tests/common/time_scale.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "tandem/sync/sync.h"

namespace tandem::test {
namespace {
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}
}  // namespace

int test_main(int argc, char** argv, const std::function<int(const std::string& scenario)>& worker) {
  if (const auto& scenario = spawner::worker_scenario()) return worker(*scenario);  // forked by the fork server
  if (argc >= 3 && std::string(argv[1]) == "--worker") return worker(argv[2]);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

int run_worker_job(const std::function<void()>& body) {
  try {
    const int rank = env_int("RANK", 0);
    const char* name = std::getenv("TANDEM_TEST_NAME");
    rpc::RpcOptions options = options_from_env();
    // The worker waits in its graceful shutdown's barrier while the test's body runs on rank 0: that wait is slack for
    // the body's work, so unless the test set the bound it grows with TANDEM_TEST_TIME_SCALE (under TSan a body of
    // 10,000 calls ran past an unscaled 60 s and the workers stopped serving under it). Rank 0's own bound stays: it
    // waits there for workers that may be dead.
    if (env_int("TANDEM_TEST_SHUTDOWN_MS", 0) <= 0) options.shutdown_timeout = scaled(options.shutdown_timeout);
    // Unless held: with TANDEM_TEST_HOLD_MS, the worker serves outside its shutdown until the test calls its
    // "test.release" (or that long has passed), and only then waits at the barrier. The test hosts' fault tests hold
    // their workers (tests/common/host_faults.h): a barrier waiting through the body waits through its cut links, and
    // its store wait failed when the cut link's connection did ("Network is unreachable"), or its bound passed in a
    // slow body; the worker then left while the test still called it.
    const int hold_ms = env_int("TANDEM_TEST_HOLD_MS", 0);
    struct Hold {
      Mutex mu;
      bool released ABSL_GUARDED_BY(mu) = false;
    };
    auto hold = std::make_shared<Hold>();
    if (hold_ms > 0) {
      rpc::register_function("test.release", [hold] {
        MutexLock lock(&hold->mu);
        hold->released = true;
      });
    }
    rpc::init_rpc(name ? name : "worker" + std::to_string(rank), rank, env_int("WORLD_SIZE", 1), std::move(options));
    if (hold_ms > 0) {
      MutexLock lock(&hold->mu);
      if (!hold->mu.AwaitWithTimeout(Condition(&hold->released), absl::Milliseconds(hold_ms))) {
        std::cerr << "held worker: not released within " << hold_ms << " ms (TANDEM_TEST_HOLD_MS); shutting down\n";
      }
    }
    body();
    rpc::shutdown(true);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "worker failed: " << e.what() << "\n";
    return 3;
  }
}

absl::StatusCode thrown_code(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return absl::StatusCode::kOk;
}

void expect_error(const std::function<void()>& f, absl::StatusCode code, const std::vector<std::string>& words) {
  try {
    f();
    ADD_FAILURE() << "no error, expected " << absl::StatusCodeToString(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

void die_in(std::chrono::milliseconds delay) {
  std::thread([delay] {
    std::this_thread::sleep_for(delay);
    _exit(9);
  }).detach();
}

void register_die_in() {
  rpc::register_function("test.die_in", [](int64_t ms) { die_in(std::chrono::milliseconds(ms)); });
}

rpc::RpcOptions options_from_env() {
  rpc::RpcOptions o;
  o.shutdown_timeout = std::chrono::milliseconds(env_int("TANDEM_TEST_SHUTDOWN_MS", 60000));
  o.init_timeout = std::chrono::milliseconds(env_int("TANDEM_TEST_INIT_MS", 30000));
  o.num_worker_threads = env_int("TANDEM_TEST_THREADS", 16);
  if (int m = env_int("TANDEM_TEST_MAX_MSG", 0); m > 0) o.max_message_bytes = m;
  if (int ms = env_int("TANDEM_TEST_RPC_MS", 0); ms > 0) o.rpc_timeout = std::chrono::milliseconds(ms);
  if (const char* dir = std::getenv("TANDEM_TEST_TLS_DIR"); dir && *dir) o.tls = tls_options(dir);
  if (const char* faults = std::getenv("TANDEM_TEST_FAULTS"); faults && *faults) {
    o.faults = rpc::parse_faults(faults).value();  // a test's own rules: a typo should fail loudly
  }
  return o;
}

rpc::TlsOptions tls_options(const std::string& dir) {
  rpc::TlsOptions t;
  t.cert_chain_path = dir + "/node.crt";
  t.private_key_path = dir + "/node.key";
  t.root_certs_path = dir + "/ca.crt";
  return t;
}

bool make_test_certificates(const std::string& dir) {
  const std::string cmd =
      "cd '" + dir +
      "' && "
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=tandem-test-ca -keyout ca.key -out ca.crt && "
      "openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout node.key -out node.csr && "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > ext.cnf && "
      "openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile ext.cnf -out node.crt";
  return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0;
}

}  // namespace tandem::test

#include <ATen/ATen.h>

#include <cstring>

namespace tandem::test {

grpc::ByteBuffer make_frame(const google::protobuf::MessageLite& header, const std::string& payload) {
  const std::string h = header.SerializeAsString();
  std::string bytes(4, '\0');
  const uint32_t n = static_cast<uint32_t>(h.size());
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  bytes += h;
  bytes.resize((bytes.size() + 63) / 64 * 64, '\0');  // the payload area starts 64-byte aligned (rpc/detail/wire.h)
  return raw_buffer(bytes + payload);
}

grpc::ByteBuffer raw_buffer(const std::string& bytes) {
  grpc::Slice s(bytes);
  return grpc::ByteBuffer(&s, 1);
}

grpc::ByteBuffer refragment(const grpc::ByteBuffer& buffer, size_t piece) {
  grpc::Slice all;
  if (!buffer.DumpToSingleSlice(&all).ok()) return {};
  std::vector<grpc::Slice> slices;
  for (size_t off = 0; off < all.size(); off += piece) {
    slices.emplace_back(all.begin() + off, std::min(piece, all.size() - off));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

at::Tensor random_tensor(c10::ScalarType dtype, at::IntArrayRef sizes) {
  if (dtype == at::kBool) return at::randint(0, 2, sizes).to(at::kBool);
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
  at::Tensor bytes = at::randint(0, 256, {static_cast<int64_t>(t.nbytes())}, at::kByte);
  if (t.nbytes() > 0) std::memcpy(t.data_ptr(), bytes.data_ptr(), t.nbytes());  // an empty tensor has no data pointer
  return t;
}

bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

std::vector<c10::ScalarType> all_dtypes() {
  using S = c10::ScalarType;
  return {S::Byte,   S::Char,        S::Short,        S::Int,           S::Long, S::Half,    S::Float,
          S::Double, S::ComplexHalf, S::ComplexFloat, S::ComplexDouble, S::Bool, S::BFloat16};
}

}  // namespace tandem::test
