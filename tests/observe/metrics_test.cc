// The metrics (metrics/metrics.h): percentiles, the Prometheus text, the file writer, and the figures of a real job.
#include "tandem/metrics/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/common/multiproc.h"

namespace tandem::test {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;
using testing::HasSubstr;

const metrics::CallSeries* find_call(const metrics::Snapshot& s, const std::string& peer, const std::string& function,
                                     const std::string& direction) {
  for (const auto& c : s.calls) {
    if (c.peer == peer && c.function == function && c.direction == direction) return &c;
  }
  return nullptr;
}

TEST(UnitMetrics, CountsBytesErrorsAndPercentilesWithinABucket) {
  static int run = 0;  // a series of its own on each run (--gtest_repeat): the registry lives as long as the process
  const std::string peer = "unit-peer-" + std::to_string(run++);
  auto& r = metrics::call_recorder(peer, "unit.f", "out");
  for (int us = 1; us <= 1000; ++us) r.record(microseconds(us), us % 100 != 0, 10, 20);
  auto& other = metrics::call_recorder(peer, "unit.last", "out");
  EXPECT_EQ(other.last().count(), 0);
  other.record(microseconds(300), true, 0, 0);
  other.record(microseconds(100), true, 0, 0);
  EXPECT_EQ(other.last(), microseconds(100));  // the last call's, not the largest or the mean
  const metrics::Snapshot s = metrics::snapshot();
  const metrics::CallSeries* c = find_call(s, peer, "unit.f", "out");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->calls, 1000);
  EXPECT_EQ(c->errors, 10);
  EXPECT_EQ(c->bytes_sent, 10000);
  EXPECT_EQ(c->bytes_received, 20000);
  EXPECT_EQ(c->latency.count, 1000);
  EXPECT_DOUBLE_EQ(c->latency.max_us, 1000);
  EXPECT_DOUBLE_EQ(c->latency.sum_us, 500500);
  // A percentile is its bucket's upper bound: at or above the true value, by less than a bucket (2^(1/4)).
  for (auto [got, want] :
       {std::pair{c->latency.p50_us, 500.0}, {c->latency.p90_us, 900.0}, {c->latency.p99_us, 990.0}}) {
    EXPECT_GE(got, want);
    EXPECT_LT(got, want * 1.19);
  }
}

// Every line is a comment or `name{labels} value`; label values are escaped; the latency is a summary in seconds.
TEST(UnitMetrics, PrometheusTextIsWellFormedAndEscapesLabels) {
  metrics::Snapshot s;
  s.worker = "w\"0";
  metrics::CallSeries c;
  c.peer = "p\\1";
  c.function = "f\nx";
  c.direction = "out";
  c.calls = 3;
  c.latency.count = 3;
  c.latency.p50_us = 250;
  c.latency.sum_us = 1000;
  s.calls.push_back(c);
  s.gauges["tandem_rrefs_owned"] = 2;
  const std::string text = metrics::prometheus_text(s);
  std::istringstream in(text);
  const std::regex sample(R"([a-z_]+\{([a-z_]+="([^"\\]|\\.)*",?)+\} -?[0-9.e+-]+)");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
  }
  const std::string labels = R"(worker="w\"0",peer="p\\1",function="f\nx",direction="out")";
  EXPECT_THAT(text, HasSubstr("tandem_rpc_calls_total{" + labels + "} 3\n"));
  EXPECT_THAT(text, HasSubstr("tandem_rpc_latency_seconds{" + labels + ",quantile=\"0.5\"} 0.00025\n"));
  EXPECT_THAT(text, HasSubstr("tandem_rpc_latency_seconds_sum{" + labels + "} 0.001\n"));
  EXPECT_THAT(text, HasSubstr("tandem_rpc_latency_seconds_count{" + labels + "} 3\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE tandem_rpc_latency_seconds summary\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE tandem_rrefs_owned gauge\ntandem_rrefs_owned{worker=\"w\\\"0\"} 2\n"));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(UnitMetrics, TheWriterKeepsTheFileFreshAndWritesOnceMoreAtStop) {
  const TempDir temp;
  const std::string& dir = temp.path();
  metrics::set_gauge("tandem_unit_probe", [] { return 1.0; });
  metrics::start_writer(dir + "/{worker}-{rank}.prom", milliseconds(20), "unitw", 5);
  const std::string path = dir + "/unitw-5.prom";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (read_file(path).find("tandem_unit_probe") == std::string::npos && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_THAT(read_file(path), HasSubstr("tandem_unit_probe{worker="));
  metrics::set_gauge("tandem_unit_probe", [] { return 7.0; });
  metrics::start_writer(dir + "/{worker}-{rank}.prom", std::chrono::hours(1), "unitw", 5);  // replaces the first
  EXPECT_THAT(read_file(path), HasSubstr("} 7\n"));  // the first's last write, at its stop
  // Set after the second writer started (it writes next in an hour): only stop_writer()'s own write can show it.
  metrics::set_gauge("tandem_unit_probe", [] { return 9.0; });
  metrics::stop_writer();  // writes once more
  EXPECT_THAT(read_file(path), HasSubstr("} 9\n"));
}

// Figures of the two-worker job of main.cc (tests/observe), written by each worker at shutdown.
std::map<std::string, double> samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

TEST(MultiprocMetrics, KnownTrafficGivesKnownCountsBytesErrorsCollectivesAndGauges) {
  const TempDir temp;
  const std::string& dir = temp.path();
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "log_traffic"},
            {{"TANDEM_METRICS_FILE", dir + "/{worker}.prom"}, {"TANDEM_METRICS_INTERVAL_MS", "50"}});
  ASSERT_EQ(exit_code(p.wait(milliseconds(60000))), 0) << p.output();
  for (int me = 0; me < 2; ++me) {
    const std::string w = "worker" + std::to_string(me), peer = "worker" + std::to_string(1 - me);
    const std::string text = read_file(dir + "/" + w + ".prom");
    const auto m = samples(text);
    auto at = [&](const std::string& key) {
      auto it = m.find(key);
      EXPECT_NE(it, m.end()) << key << " missing in:\n" << text;
      return it == m.end() ? -1.0 : it->second;
    };
    const std::string out = "worker=\"" + w + "\",peer=\"" + peer + "\",function=\"log_test.scale\",direction=\"out\"";
    const std::string in = "worker=\"" + w + "\",peer=\"" + peer + "\",function=\"log_test.scale\",direction=\"in\"";
    // Each worker calls log_test.scale twice on the other (once plain, once in an autograd context) and serves two.
    EXPECT_EQ(at("tandem_rpc_calls_total{" + out + "}"), 2);
    EXPECT_EQ(at("tandem_rpc_calls_total{" + in + "}"), 2);
    EXPECT_EQ(at("tandem_rpc_errors_total{" + out + "}"), 0);
    EXPECT_GE(at("tandem_rpc_sent_bytes_total{" + out + "}"), 2 * 16);  // two tensors of 4 floats, and framing
    EXPECT_GE(at("tandem_rpc_received_bytes_total{" + out + "}"), 2 * 16);
    EXPECT_EQ(at("tandem_rpc_latency_seconds_count{" + out + "}"), 2);
    EXPECT_GT(at("tandem_rpc_latency_seconds{" + out + ",quantile=\"0.5\"}"), 0);
    EXPECT_EQ(at("tandem_rpc_calls_total{worker=\"" + w + "\",peer=\"" + peer +
                 "\",function=\"__tandem.rref.create\",direction=\"out\"}"),
              1);
    const std::string allreduce =
        "worker=\"" + w + "\",group=\"log_test\",op=\"allreduce\",transport=\"shared_memory\"";
    EXPECT_EQ(at("tandem_collective_ops_total{" + allreduce + "}"), 1);
    EXPECT_EQ(at("tandem_collective_bytes_total{" + allreduce + "}"), 64);  // 16 floats
    EXPECT_EQ(at("tandem_collective_errors_total{" + allreduce + "}"), 0);
    // Written after shutdown: every context and RRef is gone.
    EXPECT_EQ(at("tandem_dist_autograd_contexts{worker=\"" + w + "\"}"), 0);
    EXPECT_EQ(at("tandem_rrefs_owned{worker=\"" + w + "\"}"), 0);
  }
  // Rank 0's one-way call to log_test.fail failed on rank 1: an error of the served call there.
  const auto m1 = samples(read_file(dir + "/worker1.prom"));
  const std::string fail = "worker=\"worker1\",peer=\"worker0\",function=\"log_test.fail\",direction=\"in\"";
  EXPECT_EQ(m1.at("tandem_rpc_calls_total{" + fail + "}"), 1);
  EXPECT_EQ(m1.at("tandem_rpc_errors_total{" + fail + "}"), 1);
}

}  // namespace
}  // namespace tandem::test
