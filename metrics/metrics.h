// Metrics of a worker: RPC calls per peer and function (counts, bytes, errors, latency percentiles, both directions),
// collectives per group and operation, and gauges of the layers above (RRefs, distributed autograd contexts). One call
// returns them all; the Prometheus text format is one call more, and a writer thread can keep a file of it fresh for
// existing monitoring (node_exporter's textfile collector, or anything that reads the format).
//
//   metrics::Snapshot s = metrics::snapshot();
//   for (const auto& c : s.calls) std::cout << c.peer << " " << c.function << " p99 " << c.latency.p99_us << "\n";
//   std::string text = metrics::prometheus_text(s);
//
//   TANDEM_METRICS_FILE=/var/lib/node_exporter/{worker}.prom TANDEM_METRICS_INTERVAL_MS=5000   (or RpcOptions)
//
// Latencies are kept in a histogram of 128 logarithmic buckets (4 per power of two, 1 µs to about an hour): a
// percentile is its bucket's upper bound, so within 19% above the true value. Counts are since the process started
// (Prometheus counters); a worker that restarts starts them again, as Prometheus expects.
//
// Thread-safety: every function may be called from any thread. Recording into a series is lock-free (relaxed atomics);
// finding it (call_recorder, once per call on each side) looks in a per-thread cache first, and takes the registry's
// lock for one map lookup only the first time a thread meets a series (or when another series took its cache slot).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace tandem::metrics {

struct Latency {
  int64_t count = 0;
  double sum_us = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;  // 0 when count is 0
};

// Calls between this worker and `peer`: direction "out" (this worker called) or "in" (it served the peer's call).
struct CallSeries {
  std::string peer, function, direction;
  int64_t calls = 0;   // completed, with or without error
  int64_t errors = 0;  // completed with an error (out: any; in: the function failed or could not run)
  // Bytes of the messages, tensors included; tensors that went by reference (the same-host bulk path: the callee reads
  // them from the caller's memory) count on the caller's side only.
  int64_t bytes_sent = 0, bytes_received = 0;
  Latency latency;  // out: call to reply; in: request read to reply written
};

struct CollectiveSeries {
  std::string group, op, transport;
  int64_t ops = 0, errors = 0, bytes = 0;  // bytes: of the tensor each operation is about, on this rank
  Latency latency;                         // from the operation's start on the group's thread to its end
};

struct Snapshot {
  std::string worker;
  std::vector<CallSeries> calls;
  std::vector<CollectiveSeries> collectives;
  std::map<std::string, double> gauges;  // name -> value (e.g. tandem_rrefs_owned)
};

// Everything recorded so far in this process.
Snapshot snapshot();
// The Prometheus text exposition format (version 0.0.4) of `s`: counters *_total, latencies as summaries in seconds
// (quantile 0.5, 0.9, 0.99 with _sum and _count), every series labelled with worker="...".
std::string prometheus_text(const Snapshot& s);

// Writes prometheus_text(snapshot()) to `path` every `interval` (atomically: a temporary file, then rename), and once
// more at stop_writer(). "{worker}" and "{rank}" in the path are replaced by the worker's name and rank. Replaces a
// writer started before. rpc::init_rpc starts one from RpcOptions::metrics_file or TANDEM_METRICS_FILE and stops it at
// shutdown, or at exit when the program ends without shutdown. Errors writing the file are logged (warn), never thrown.
void start_writer(const std::string& path, std::chrono::milliseconds interval, const std::string& worker, int rank);
void stop_writer();

// ---- for Tandem's layers

// A histogram and counters of one series; record() is lock-free.
class Recorder {
 public:
  static constexpr int kBuckets = 128;
  void record(std::chrono::nanoseconds took, bool ok, int64_t sent, int64_t received);
  // How long the last call recorded took (0 before the first); of several at once, one of them.
  std::chrono::nanoseconds last() const { return std::chrono::nanoseconds(last_ns_.load(std::memory_order_relaxed)); }

 private:
  friend Snapshot snapshot();
  friend struct Registry;
  std::atomic<int64_t> count_{0}, errors_{0}, sent_{0}, received_{0}, sum_ns_{0}, max_ns_{0}, last_ns_{0};
  std::array<std::atomic<int64_t>, kBuckets> buckets_{};
};

// The series of calls to or from `peer` for `function` ("out" or "in"); created at first use, never freed (a job has
// a bounded set of peers and functions).
Recorder& call_recorder(const std::string& peer, const std::string& function, const char* direction);
Recorder& collective_recorder(const std::string& group, const std::string& op, const std::string& transport);
// A gauge read at each snapshot; a second registration of `name` replaces the first.
void set_gauge(const std::string& name, std::function<double()> read);
// The worker named in snapshots (rpc sets it at init_rpc).
void set_worker(const std::string& name);

}  // namespace tandem::metrics
