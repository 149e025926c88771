// Shared by Tandem's benchmark programs: timing and the JSON line format of bench/run.sh.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace tandem::bench {

inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

inline double median(std::vector<double> v) { return percentile(std::move(v), 0.5); }

// One result line: {"bench":..,"impl":"tandem","metric":..,"value":..,"unit":..,<extra>}; `extra` is ready JSON
// members without braces ("\"iters\":1000"), or empty.
inline void emit_as(const std::string& impl, const std::string& bench, const std::string& metric, double value,
                    const std::string& unit, const std::string& extra = "") {
  std::printf("{\"bench\":\"%s\",\"impl\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\"%s%s}\n",
              bench.c_str(), impl.c_str(), metric.c_str(), value, unit.c_str(), extra.empty() ? "" : ",", extra.c_str());
  std::fflush(stdout);
}
inline void emit(const std::string& bench, const std::string& metric, double value, const std::string& unit,
                 const std::string& extra = "") {
  emit_as("tandem", bench, metric, value, unit, extra);
}
// The same with "impl":"floor": the limit a figure is compared with, measured in the same run.
inline void emit_floor(const std::string& bench, const std::string& metric, double value, const std::string& unit,
                       const std::string& extra = "") {
  emit_as("floor", bench, metric, value, unit, extra);
}

}  // namespace tandem::bench
