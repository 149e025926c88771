// What the RPC tests share between the test process (rank 0) and its worker processes.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "tandem/rpc/rpc.h"

namespace tandem::test {

// Completed waits of the test codec for c10::Device values (tests/rpc/main.cc), in this process.
extern std::atomic<int> g_device_waits_done;
// Calls of "stop_soon" (tests/rpc/main.cc) that have begun, in this process: it returns 300 ms later.
extern std::atomic<int> g_stop_soon_calls;

// The code of the tandem::Error `f` throws (kOk when it throws none).
absl::StatusCode thrown_code(const std::function<void()>& f);

// Expects `f` to throw a tandem::Error with `code` whose message contains every one of `words` (a test failure
// otherwise, naming what was thrown).
void expect_error(const std::function<void()>& f, absl::StatusCode code, const std::vector<std::string>& words);

// Ends this process with exit code 9 `delay` from now, whatever it is doing then: a worker that dies mid-work.
void die_in(std::chrono::milliseconds delay);
// Registers "test.die_in" (int64 ms): the worker it is called on dies `ms` milliseconds later (die_in).
void register_die_in();

// Registers the functions every test worker serves (echo, add, sleep_ms, throw_error, ...).
void register_test_functions();
// A worker process of a test job: init_rpc from the environment (name "worker<RANK>" unless TANDEM_TEST_NAME), then
// `body`, then a graceful shutdown (its bound scaled by TANDEM_TEST_TIME_SCALE unless TANDEM_TEST_SHUTDOWN_MS sets
// it). Returns the exit code: 0, or 3 after printing the error.
int run_worker_job(const std::function<void()>& body);

// The main of a module's test binary: a worker forked by the fork server (spawner.h), or `--worker <scenario>`, runs
// `worker(scenario)` (a child of a multi-process test); anything else runs the GoogleTest suites.
int test_main(int argc, char** argv, const std::function<int(const std::string& scenario)>& worker);

// RpcOptions from the environment the test set for its workers: TANDEM_TEST_SHUTDOWN_MS, TANDEM_TEST_THREADS,
// TANDEM_TEST_MAX_MSG, TANDEM_TEST_INIT_MS, TANDEM_TEST_RPC_MS, TANDEM_TEST_TLS_DIR, TANDEM_TEST_FAULTS
// (rpc::parse_faults).
rpc::RpcOptions options_from_env();
// TLS options for the certificates make_test_certificates wrote into `dir`.
rpc::TlsOptions tls_options(const std::string& dir);
// Writes a CA and a certificate for 127.0.0.1 signed by it (with the openssl command). Returns false when it cannot.
bool make_test_certificates(const std::string& dir);

}  // namespace tandem::test

#include <ATen/core/Tensor.h>
#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>

namespace tandem::test {

// A frame as rpc/detail/wire.h lays it out, built by hand so tests can make it lie: [u32 len][header][payload].
grpc::ByteBuffer make_frame(const google::protobuf::MessageLite& header, const std::string& payload);
// Any bytes as a one-slice buffer.
grpc::ByteBuffer raw_buffer(const std::string& bytes);
// The same bytes cut into slices of `piece` bytes (forces the receiver's copy path and unaligned data).
grpc::ByteBuffer refragment(const grpc::ByteBuffer& buffer, size_t piece);
// A tensor of `dtype` filled with random bytes (0/1 for bool), so that a round trip is checked bit for bit.
at::Tensor random_tensor(c10::ScalarType dtype, at::IntArrayRef sizes);
// Same dtype, sizes and bytes (of the contiguous form).
bool bit_equal(const at::Tensor& a, const at::Tensor& b);
// Every CPU dtype Tandem sends.
std::vector<c10::ScalarType> all_dtypes();

}  // namespace tandem::test
