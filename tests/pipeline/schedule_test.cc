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

// Looped BFS (PyTorch's ScheduleLoopedBFS): on each worker every forward of its first stage, then of the next, then
// the backwards deepest stage first and last micro-batch first; it keeps all m micro-batches alive, as GPipe does.
TEST(UnitPipelineSchedule, LoopedBfsRunsStageByStageAndCoversEveryAction) {
  for (int p = 1; p <= 6; ++p) {
    for (int workers = 1; workers <= p; ++workers) {
      for (int m : {1, 2, 5, 8}) {
        auto placement = round_robin(p, workers);
        auto plans = make_plans(Schedule::kLoopedBFS, placement, workers, m);
        EXPECT_NO_THROW(simulate(plans, placement, m, 1, 2)) << p << " stages on " << workers << ", m " << m;
        for (int s = 0; s < p; ++s) EXPECT_EQ(peak_in_flight(plans[placement[s]], s), m);
      }
    }
  }
  auto plans = make_plans(Schedule::kLoopedBFS, round_robin(4, 2), 2, 2);
  EXPECT_EQ(plans_csv(plans), "0F0,0F1,2F0,2F1,2B1,2B0,0B1,0B0\n1F0,1F1,3F0,3F1,3B1,3B0,1B1,1B0\n");
}

// Custom plans: CSV in PyTorch's action notation, read back exactly; every mistake named by its line and cell (parse)
// or by the first bad action (simulate).
TEST(UnitPipelineSchedule, CustomPlansFromCsvAndTheirMistakesNamed) {
  const auto two = one_stage_per_worker(2);
  auto f1b = make_plans(Schedule::k1F1B, two, 2, 3);
  EXPECT_EQ(parse_plans_csv(plans_csv(f1b)), f1b);
  EXPECT_EQ(parse_plans_csv("# worker 0, then 1\n 0F0 , 0B0,,\n1F0,1B0\n\n"),
            (std::vector<std::vector<Action>>{{{0, 0, false}, {0, 0, true}}, {{1, 0, false}, {1, 0, true}}}));
  auto parse_error = [](const std::string& csv) {
    try {
      parse_plans_csv(csv);
    } catch (const Error& e) {
      return std::string(e.status().message());
    }
    return std::string("no error");
  };
  EXPECT_EQ(parse_error("0F0,0X1"),
            "plan line 1, cell 2: '0X1' is not an action (<stage>F<micro-batch> or "
            "<stage>B<micro-batch>, e.g. 1B3)");
  EXPECT_NE(parse_error("0F0\n1F0,1W0").find("plan line 2, cell 2: '1W0' is a zero-bubble action"), std::string::npos);
  for (const char* bad : {"F0", "0F", "0F-1", "a0F1", "0FF1"}) EXPECT_NE(parse_error(bad), "no error") << bad;
  auto sim_error = [&](const std::string& csv) {
    try {
      simulate(parse_plans_csv(csv), two, 2, 1, 2);
    } catch (const Error& e) {
      return std::string(e.status().message());
    }
    return std::string("no error");
  };
  EXPECT_EQ(sim_error("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1"), "no error");
  EXPECT_EQ(sim_error("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1,2F0"),
            "action 4 of worker 1 (2F0): there is no stage 2 (2 stages)");
  EXPECT_EQ(sim_error("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1,1F2"),
            "action 4 of worker 1 (1F2): there is no micro-batch 2 (2 micro-batches)");
  EXPECT_EQ(sim_error("0F0,0F1,0B0,0B1,1F0\n1B0,1F1,1B1"), "action 4 of worker 0 (1F0): stage 1 is placed on worker 1");
  EXPECT_EQ(sim_error("0F0,0F1,0B0,0B1,0F1\n1F0,1B0,1F1,1B1"), "action 4 of worker 0 (0F1): planned twice");
  EXPECT_EQ(sim_error("0F0,0F1,0B0\n1F0,1B0,1F1,1B1"), "action 0B1 is in no plan (worker 0's)");
  EXPECT_EQ(sim_error("0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0"), "no error");
  EXPECT_EQ(sim_error("0F0,0B0,0F1,0B1\n1F0,1F1,1B1,1B0"),  // worker 1 needs 0F1 before worker 0 can give it
            "the plans deadlock: worker 0 waits forever at its action 1 (0B0) for 1B0, which worker 1 plans after an "
            "action that cannot run");
  EXPECT_EQ(sim_error("0B0,0F0,0F1,0B1\n1F0,1B0,1F1,1B1"),
            "the plans deadlock: worker 0 waits forever at its action 0 (0B0) for 0F0, which worker 0 plans after an "
            "action that cannot run");
}

TEST(UnitPipelineSchedule, BadArgumentsAreRefused) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::k1F1B, {0, 1}, 2, 0); }), kInvalid);
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::k1F1B, {}, 1, 2); }), kInvalid);
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::k1F1B, {0, 2}, 2, 2); }), kInvalid);
  EXPECT_EQ(thrown_code([] { schedule_from_name("zigzag"); }), kInvalid);
  for (auto s :
       {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B, Schedule::kLoopedBFS, Schedule::kCustom}) {
    EXPECT_EQ(schedule_from_name(schedule_name(s)), s);
  }
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::kCustom, {0, 1}, 2, 2); }), kInvalid);
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
