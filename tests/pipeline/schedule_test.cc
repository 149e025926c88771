// Schedules, cuts and timeline pictures, in one process.
#include <gtest/gtest.h>

#include <functional>

#include "tandem/pipeline/pipeline.h"
#include "tandem/pipeline/schedule.h"
#include "tandem/rpc/errors.h"
#include "tests/common/test_env.h"

namespace tandem::pipeline {
namespace {

using test::thrown_code;

std::vector<int> one_stage_per_worker(int p) {
  std::vector<int> w(p);
  for (int s = 0; s < p; ++s) w[s] = s;
  return w;
}
std::vector<int> round_robin(int p, int workers) {
  std::vector<int> w(p);
  for (int s = 0; s < p; ++s) w[s] = s % workers;
  return w;
}

// Most micro-batches of stage s in flight (forward done, backward not yet) along the worker's plan.
int peak_in_flight(const std::vector<Action>& plan, int stage) {
  int live = 0, peak = 0;
  for (const Action& a : plan) {
    if (a.stage != stage) continue;
    live += a.backward ? -1 : 1;
    peak = std::max(peak, live);
  }
  return peak;
}

TEST(UnitPipelineSchedule, EveryScheduleCoversEveryActionOnceWithoutDeadlock) {
  for (int p = 1; p <= 5; ++p) {
    for (int m : {1, 2, 3, 5, 8, 13}) {
      for (auto s : {Schedule::kGPipe, Schedule::k1F1B}) {
        auto placement = one_stage_per_worker(p);
        EXPECT_NO_THROW(simulate(make_plans(s, placement, p, m), placement, m, 1, 2)) << p << " " << m;
      }
      for (int workers = 1; workers <= p; ++workers) {
        auto placement = round_robin(p, workers);
        EXPECT_NO_THROW(simulate(make_plans(Schedule::kInterleaved1F1B, placement, workers, m), placement, m, 1, 2))
            << p << " stages on " << workers << " workers, m " << m;
      }
    }
  }
}

TEST(UnitPipelineSchedule, GPipeAnd1F1BTakeTheIdealTimeWithBalancedStages) {
  for (int p = 1; p <= 4; ++p) {
    for (int m : {1, 3, 8}) {
      auto placement = one_stage_per_worker(p);
      for (auto s : {Schedule::kGPipe, Schedule::k1F1B}) {
        EXPECT_DOUBLE_EQ(simulate(make_plans(s, placement, p, m), placement, m, 1, 2), (m + p - 1) * 3.0);
      }
    }
  }
}

TEST(UnitPipelineSchedule, OneFOneBKeepsAtMostPMinusSMicroBatchesInFlightAndGPipeKeepsM) {
  const int p = 4, m = 8;
  auto placement = one_stage_per_worker(p);
  auto f1b = make_plans(Schedule::k1F1B, placement, p, m);
  auto gpipe = make_plans(Schedule::kGPipe, placement, p, m);
  for (int s = 0; s < p; ++s) {
    EXPECT_EQ(peak_in_flight(f1b[s], s), p - s);
    EXPECT_EQ(peak_in_flight(gpipe[s], s), m);
  }
  // The last stage alternates F0 B0 F1 B1 ...
  for (int i = 0; i < m; ++i) {
    EXPECT_EQ(f1b[p - 1][2 * i], (Action{p - 1, i, false}));
    EXPECT_EQ(f1b[p - 1][2 * i + 1], (Action{p - 1, i, true}));
  }
}

TEST(UnitPipelineSchedule, InterleavedBeatsOneFOneBOnTheSameWorkers) {
  // 2 workers, 4 stages of half the cost each, against 2 stages on the same workers.
  const int m = 8;
  auto two = one_stage_per_worker(2);
  auto four = round_robin(4, 2);
  const double f1b = simulate(make_plans(Schedule::k1F1B, two, 2, m), two, m, 1, 2);
  const double inter = simulate(make_plans(Schedule::kInterleaved1F1B, four, 2, m), four, m, 0.5, 1);
  EXPECT_LT(inter, f1b);
}

TEST(UnitPipelineSchedule, BadArgumentsAreRefused) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::k1F1B, {0, 1}, 2, 0); }), kInvalid);
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::k1F1B, {}, 1, 2); }), kInvalid);
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::k1F1B, {0, 2}, 2, 2); }), kInvalid);
  EXPECT_EQ(thrown_code([] { schedule_from_name("zigzag"); }), kInvalid);
  EXPECT_EQ(schedule_from_name(schedule_name(Schedule::kInterleaved1F1B)), Schedule::kInterleaved1F1B);
}

TEST(UnitPipelineSchedule, BalancedCutMinimisesTheLargestStage) {
  auto cut = balanced_cut({1, 1, 1, 1, 4}, 2);
  EXPECT_EQ(cut, (std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 5}}));
  cut = balanced_cut({5, 1, 1, 1, 1, 1}, 3);
  EXPECT_EQ(cut.front(), (std::pair<int64_t, int64_t>{0, 1}));
  EXPECT_EQ(cut.back().second, 6);
  EXPECT_EQ(thrown_code([] { balanced_cut({1, 2}, 3); }), absl::StatusCode::kInvalidArgument);
}

TEST(UnitPipelineSchedule, TimelinePicturesHoldEveryAction) {
  std::vector<TimelineEvent> events;
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < 3; ++i) {
      events.push_back({s, s + 1, i, false, 1000 + 100 * (i + s), 1000 + 100 * (i + s) + 80});
      events.push_back({s, s + 1, i, true, 2000 + 100 * (i + s), 2000 + 100 * (i + s) + 80});
    }
  }
  const std::string json = chrome_trace_json(events);
  size_t n = 0;
  for (size_t at = json.find("\"ph\":\"X\""); at != std::string::npos; at = json.find("\"ph\":\"X\"", at + 1)) ++n;
  EXPECT_EQ(n, events.size());
  EXPECT_NE(json.find("\"name\":\"B2\""), std::string::npos);
  const std::string svg = schedule_svg(events, 2, "test");
  n = 0;
  for (size_t at = svg.find("<title>"); at != std::string::npos; at = svg.find("<title>", at + 1)) ++n;
  EXPECT_EQ(n, events.size());
  EXPECT_EQ(svg.rfind("</svg>"), svg.size() - 7);
}

}  // namespace
}  // namespace tandem::pipeline
