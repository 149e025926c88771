// A pipeline step's timeline (every forward and backward, or its halves I and W, with its start and end) and its
// pictures: a Chrome trace (Perfetto, chrome://tracing) and a self-contained SVG of the schedule, one row per stage,
// gaps being the bubbles.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/pipeline/schedule.h"

namespace tandem::pipeline {

struct TimelineEvent {
  int stage = 0, worker = 0, microbatch = 0;
  Kind kind = Kind::kForward;        // F, B, or a split backward's I and W
  int64_t start_us = 0, end_us = 0;  // system clock, microseconds
};

// For any events (the pipeline's own, or a benchmark's).
std::string chrome_trace_json(const std::vector<TimelineEvent>& events);
std::string schedule_svg(const std::vector<TimelineEvent>& events, int n_stages, const std::string& title);

}  // namespace tandem::pipeline
