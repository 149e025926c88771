#include "tandem/metrics/metrics.h"

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tandem/log/log.h"
#include "tandem/sync/sync.h"

namespace tandem::metrics {

// Every series lives as long as the process: recorders are handed out by reference and recorded into without a lock.
struct Registry {
  Mutex mu;
  std::map<std::tuple<std::string, std::string, std::string>, std::unique_ptr<Recorder>> calls ABSL_GUARDED_BY(mu);
  std::map<std::tuple<std::string, std::string, std::string>, std::unique_ptr<Recorder>> collectives
      ABSL_GUARDED_BY(mu);
  std::map<std::string, std::function<double()>> gauges ABSL_GUARDED_BY(mu);
  std::string worker ABSL_GUARDED_BY(mu);

  static Registry& get() {
    static auto* r = new Registry;  // never destroyed: threads may record until exit
    return *r;
  }
};

namespace {

int bucket_of(int64_t ns) {
  const double us = static_cast<double>(ns) / 1000.0;
  if (us <= 1.0) return 0;
  const int b = static_cast<int>(std::ceil(4.0 * std::log2(us)));
  return std::min(b, Recorder::kBuckets - 1);
}
double upper_us(int bucket) { return std::exp2(bucket / 4.0); }

using Key = std::tuple<std::string, std::string, std::string>;

// The series of `key`, made at first use; the entry's key and series stay where they are (a map node is never moved).
using Series = std::map<Key, std::unique_ptr<Recorder>>;
Series::value_type& find_or_make(Series& map, Key key) {
  auto& entry = *map.try_emplace(std::move(key)).first;
  if (!entry.second) entry.second = std::make_unique<Recorder>();
  return entry;
}

}  // namespace

void Recorder::record(std::chrono::nanoseconds took, bool ok, int64_t sent, int64_t received) {
  const int64_t ns = std::max<int64_t>(0, took.count());
  count_.fetch_add(1, std::memory_order_relaxed);
  if (!ok) errors_.fetch_add(1, std::memory_order_relaxed);
  sent_.fetch_add(sent, std::memory_order_relaxed);
  received_.fetch_add(received, std::memory_order_relaxed);
  sum_ns_.fetch_add(ns, std::memory_order_relaxed);
  last_ns_.store(ns, std::memory_order_relaxed);
  buckets_[bucket_of(ns)].fetch_add(1, std::memory_order_relaxed);
  int64_t seen = max_ns_.load(std::memory_order_relaxed);
  while (ns > seen && !max_ns_.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

namespace {

// Counters first, then the histogram: a snapshot taken while recording may see a call in one and not yet in the other
// (percentiles come from the histogram's own total).
Latency latency_of(const Recorder& r, const std::array<int64_t, Recorder::kBuckets>& b, int64_t sum_ns,
                   int64_t max_ns) {
  Latency l;
  int64_t total = 0;
  for (int64_t n : b) total += n;
  l.count = total;
  l.sum_us = static_cast<double>(sum_ns) / 1000.0;
  l.max_us = static_cast<double>(max_ns) / 1000.0;
  if (total == 0) return l;
  auto quantile = [&](double q) {
    const double want = q * static_cast<double>(total);
    int64_t seen = 0;
    for (int i = 0; i < Recorder::kBuckets; ++i) {
      seen += b[i];
      if (static_cast<double>(seen) >= want) return std::min(upper_us(i), l.max_us);
    }
    return l.max_us;
  };
  l.p50_us = quantile(0.5);
  l.p90_us = quantile(0.9);
  l.p99_us = quantile(0.99);
  (void)r;
  return l;
}

}  // namespace

Snapshot snapshot() {
  auto& reg = Registry::get();
  Snapshot s;
  std::map<std::string, std::function<double()>> gauges;
  auto read = [](const Recorder& r, int64_t* count, int64_t* errors, int64_t* sent, int64_t* received) {
    *count = r.count_.load(std::memory_order_relaxed);
    *errors = r.errors_.load(std::memory_order_relaxed);
    *sent = r.sent_.load(std::memory_order_relaxed);
    *received = r.received_.load(std::memory_order_relaxed);
    std::array<int64_t, Recorder::kBuckets> b{};
    for (int i = 0; i < Recorder::kBuckets; ++i) b[i] = r.buckets_[i].load(std::memory_order_relaxed);
    return latency_of(r, b, r.sum_ns_.load(std::memory_order_relaxed), r.max_ns_.load(std::memory_order_relaxed));
  };
  {
    MutexLock lock(&reg.mu);
    s.worker = reg.worker;
    for (const auto& [key, r] : reg.calls) {
      CallSeries c;
      std::tie(c.peer, c.function, c.direction) = key;
      c.latency = read(*r, &c.calls, &c.errors, &c.bytes_sent, &c.bytes_received);
      s.calls.push_back(std::move(c));
    }
    for (const auto& [key, r] : reg.collectives) {
      CollectiveSeries c;
      std::tie(c.group, c.op, c.transport) = key;
      int64_t unused = 0;
      c.latency = read(*r, &c.ops, &c.errors, &c.bytes, &unused);
      s.collectives.push_back(std::move(c));
    }
    gauges = reg.gauges;
  }
  for (const auto& [name, value] : gauges) s.gauges[name] = value();  // outside the lock: they take their own
  return s;
}

namespace {

std::string label(const std::string& v) {
  return absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void family(std::ostringstream& out, const std::string& name, const char* type, const std::string& help) {
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
}

void summary(std::ostringstream& out, const std::string& name, const std::string& labels, const Latency& l) {
  out << name << "{" << labels << ",quantile=\"0.5\"} " << number(l.p50_us / 1e6) << "\n";
  out << name << "{" << labels << ",quantile=\"0.9\"} " << number(l.p90_us / 1e6) << "\n";
  out << name << "{" << labels << ",quantile=\"0.99\"} " << number(l.p99_us / 1e6) << "\n";
  out << name << "_sum{" << labels << "} " << number(l.sum_us / 1e6) << "\n";
  out << name << "_count{" << labels << "} " << l.count << "\n";
}

}  // namespace

std::string prometheus_text(const Snapshot& s) {
  std::ostringstream out;
  const std::string w = "worker=\"" + label(s.worker) + "\"";
  auto call_labels = [&](const CallSeries& c) {
    return absl::StrCat(w, ",peer=\"", label(c.peer), "\",function=\"", label(c.function), "\",direction=\"",
                        c.direction, "\"");
  };
  auto coll_labels = [&](const CollectiveSeries& c) {
    return absl::StrCat(w, ",group=\"", label(c.group), "\",op=\"", label(c.op), "\",transport=\"", label(c.transport),
                        "\"");
  };
  family(out, "tandem_rpc_calls_total", "counter",
         "RPC calls completed, by peer and function (direction out: this worker called; in: it served)");
  for (const auto& c : s.calls) out << "tandem_rpc_calls_total{" << call_labels(c) << "} " << c.calls << "\n";
  family(out, "tandem_rpc_errors_total", "counter", "RPC calls that completed with an error");
  for (const auto& c : s.calls) out << "tandem_rpc_errors_total{" << call_labels(c) << "} " << c.errors << "\n";
  family(out, "tandem_rpc_sent_bytes_total", "counter", "bytes of RPC messages sent, tensors included");
  for (const auto& c : s.calls) out << "tandem_rpc_sent_bytes_total{" << call_labels(c) << "} " << c.bytes_sent << "\n";
  family(out, "tandem_rpc_received_bytes_total", "counter", "bytes of RPC messages received, tensors included");
  for (const auto& c : s.calls) {
    out << "tandem_rpc_received_bytes_total{" << call_labels(c) << "} " << c.bytes_received << "\n";
  }
  family(out, "tandem_rpc_latency_seconds", "summary",
         "RPC latency (out: call to reply; in: request read to reply written)");
  for (const auto& c : s.calls) summary(out, "tandem_rpc_latency_seconds", call_labels(c), c.latency);
  family(out, "tandem_collective_ops_total", "counter", "collective operations completed, by group and operation");
  for (const auto& c : s.collectives) out << "tandem_collective_ops_total{" << coll_labels(c) << "} " << c.ops << "\n";
  family(out, "tandem_collective_errors_total", "counter", "collective operations that failed");
  for (const auto& c : s.collectives) {
    out << "tandem_collective_errors_total{" << coll_labels(c) << "} " << c.errors << "\n";
  }
  family(out, "tandem_collective_bytes_total", "counter", "bytes of the tensors collective operations were about");
  for (const auto& c : s.collectives) {
    out << "tandem_collective_bytes_total{" << coll_labels(c) << "} " << c.bytes << "\n";
  }
  family(out, "tandem_collective_latency_seconds", "summary", "collective operation time on the group's thread");
  for (const auto& c : s.collectives) summary(out, "tandem_collective_latency_seconds", coll_labels(c), c.latency);
  for (const auto& [name, value] : s.gauges) {
    family(out, name, "gauge", "Tandem gauge " + name);
    out << name << "{" << w << "} " << number(value) << "\n";
  }
  return out.str();
}

Recorder& call_recorder(const std::string& peer, const std::string& function, const char* direction) {
  // Each thread remembers the series it found last, one per hash slot: a call finds its series without the registry's
  // lock and without copying its names. An entry points at the registry's own key and series, which are never freed,
  // and is trivially destructible: a thread's cache is gone before the process's exit handlers run, and calls finished
  // there (rpc's at-exit shutdown) must not meet a destroyed one.
  struct Entry {
    const Key* key;
    Recorder* recorder;
  };
  constexpr size_t kSlots = 64;
  static_assert(std::is_trivially_destructible_v<Entry>);
  thread_local Entry cache[kSlots] = {};
  const size_t h = (std::hash<std::string>()(peer) * 31 + std::hash<std::string>()(function)) * 2 +
                   static_cast<unsigned char>(direction[0]);
  Entry& e = cache[h % kSlots];
  if (e.key && std::get<0>(*e.key) == peer && std::get<1>(*e.key) == function && std::get<2>(*e.key) == direction) {
    return *e.recorder;
  }
  auto& reg = Registry::get();
  MutexLock lock(&reg.mu);
  auto& [key, series] = find_or_make(reg.calls, {peer, function, direction});
  e = Entry{&key, series.get()};
  return *series;
}

Recorder& collective_recorder(const std::string& group, const std::string& op, const std::string& transport) {
  auto& reg = Registry::get();
  MutexLock lock(&reg.mu);
  return *find_or_make(reg.collectives, {group, op, transport}).second;
}

void set_gauge(const std::string& name, std::function<double()> read) {
  auto& reg = Registry::get();
  MutexLock lock(&reg.mu);
  reg.gauges[name] = std::move(read);
}

void set_worker(const std::string& name) {
  auto& reg = Registry::get();
  MutexLock lock(&reg.mu);
  reg.worker = name;
}

// ---- the writer

namespace {

struct Writer {
  Mutex mu;
  CondVar cv;
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::thread thread;
};

// start_writer and stop_writer one at a time (g_start_stop_mu), and the writer they share. Never destroyed: a program
// that exits without rpc::shutdown must not destroy a running thread (rpc's exit handler stops it first).
Mutex g_start_stop_mu;
Writer* g_writer ABSL_GUARDED_BY(g_start_stop_mu) = nullptr;

void stop_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_start_stop_mu) {
  std::unique_ptr<Writer> w(g_writer);
  g_writer = nullptr;
  if (!w) return;
  {
    MutexLock lock(&w->mu);
    w->stop = true;
    w->cv.Signal();
  }
  w->thread.join();
}

void write_file(const std::string& path) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (out) out << prometheus_text(snapshot());
    if (!out || !out.flush()) {
      TANDEM_LOG(kWarn, "metrics") << "cannot write the metrics file " << tmp;
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    TANDEM_LOG(kWarn, "metrics") << "cannot rename " << tmp << " to " << path;
    std::remove(tmp.c_str());
  }
}

}  // namespace

void start_writer(const std::string& path_pattern, std::chrono::milliseconds interval, const std::string& worker,
                  int rank) {
  MutexLock serial(&g_start_stop_mu);
  stop_locked();
  const std::string path = absl::StrReplaceAll(path_pattern, {{"{worker}", worker}, {"{rank}", std::to_string(rank)}});
  const auto every = std::max(interval, std::chrono::milliseconds(10));
  auto w = std::make_unique<Writer>();
  Writer* raw = w.get();
  w->thread = std::thread([raw, path, every] {
    MutexLock lock(&raw->mu);
    for (;;) {
      if (!raw->stop) raw->cv.WaitWithTimeout(&raw->mu, absl::FromChrono(every));
      const bool last = raw->stop;
      raw->mu.Unlock();
      write_file(path);
      raw->mu.Lock();
      if (last) return;
    }
  });
  TANDEM_LOG(kInfo, "metrics") << "writing metrics to " << path << " every " << every.count() << " ms";
  g_writer = w.release();
}

void stop_writer() {
  MutexLock serial(&g_start_stop_mu);
  stop_locked();
}

}  // namespace tandem::metrics
