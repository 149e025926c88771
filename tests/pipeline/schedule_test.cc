// Schedules, cuts and timeline pictures, in one process.
#include <gtest/gtest.h>

#include <algorithm>
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

constexpr Kind F = Kind::kForward, B = Kind::kBackward, I = Kind::kInput, W = Kind::kWeight;

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
    EXPECT_EQ(peak_in_flight(f1b, p)[s], p - s);
    EXPECT_EQ(peak_in_flight(gpipe, p)[s], m);
  }
  // The last stage alternates F0 B0 F1 B1 ...
  for (int i = 0; i < m; ++i) {
    EXPECT_EQ(f1b[p - 1][2 * i], (Action{p - 1, i, F}));
    EXPECT_EQ(f1b[p - 1][2 * i + 1], (Action{p - 1, i, B}));
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

// ZB-H1 (Qi et al., ICLR 2024): under F = I = W = 1 (t_f 1, t_b 2, W half of it) its makespan is 3m + p - 1 for
// m >= p, against 1F1B's 3 (m + p - 1): the bubble (p - 1) / 3m of the work instead of (p - 1) / m; no stage holds
// more micro-batches (F to W) than 1F1B's stage 0 does (p); every m and p is a valid plan.
TEST(UnitPipelineSchedule, ZeroBubbleH1TakesThePapersMakespanWith1F1BsMemory) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 24; ++m) {
      const auto placement = one_stage_per_worker(p);
      const auto plans = make_plans(Schedule::kZeroBubbleH1, placement, p, m);
      const double makespan = simulate(plans, placement, m, 1, 2);
      if (m >= p) {
        EXPECT_DOUBLE_EQ(makespan, 3.0 * m + p - 1) << p << " stages, m " << m;
        EXPECT_DOUBLE_EQ(simulate(make_plans(Schedule::k1F1B, placement, p, m), placement, m, 1, 2), 3.0 * (m + p - 1));
      } else {
        EXPECT_LE(makespan, 3.0 * (m + p - 1)) << p << " stages, m " << m;  // never worse than 1F1B
      }
      const auto peak = peak_in_flight(plans, p), f1b = peak_in_flight(make_plans(Schedule::k1F1B, placement, p, m), p);
      EXPECT_EQ(*std::max_element(peak.begin(), peak.end()), *std::max_element(f1b.begin(), f1b.end()))
          << p << " stages, m " << m;
      for (const auto& plan : plans) {
        for (const Action& a : plan) EXPECT_NE(a.kind, B) << "ZB-H1 splits every backward";
      }
    }
  }
  // p = 4, m = 8, worker by worker: warm-up forwards, F and I alternately, the Ws r micro-batches behind.
  EXPECT_EQ(plans_csv(make_plans(Schedule::kZeroBubbleH1, one_stage_per_worker(4), 4, 8)),
            "0F0,0F1,0F2,0F3,0I0,0W0,0F4,0I1,0W1,0F5,0I2,0W2,0F6,0I3,0W3,0F7,0I4,0W4,0I5,0W5,0I6,0W6,0I7,0W7\n"
            "1F0,1F1,1F2,1I0,1F3,1I1,1W0,1F4,1I2,1W1,1F5,1I3,1W2,1F6,1I4,1W3,1F7,1I5,1W4,1I6,1W5,1I7,1W6,1W7\n"
            "2F0,2F1,2I0,2F2,2I1,2F3,2I2,2W0,2F4,2I3,2W1,2F5,2I4,2W2,2F6,2I5,2W3,2F7,2I6,2W4,2I7,2W5,2W6,2W7\n"
            "3F0,3I0,3F1,3I1,3F2,3I2,3F3,3I3,3W0,3F4,3I4,3W1,3F5,3I5,3W2,3F6,3I6,3W3,3F7,3I7,3W4,3W5,3W6,3W7\n");
}

std::vector<int> v_placement(int P) {
  std::vector<int> w(2 * P);
  for (int s = 0; s < 2 * P; ++s) w[s] = s < P ? s : 2 * P - 1 - s;
  return w;
}

// ZBV: 2P stages in a V on P workers. Under F = I = W = 1 per stage its makespan is 6m + P - 1 for m >= 2P - 1 (the
// work is 6m per worker: a bubble of (P - 1) / 6m), half of ZB-H1's bubble on the same model and workers (stages of
// twice the cost); a worker holds at most 2P stage activations (1F1B's stage 0: P of twice the size); any m is valid.
TEST(UnitPipelineSchedule, ZeroBubbleVTakesThePapersMakespanWith1F1BsMemory) {
  for (int P = 1; P <= 6; ++P) {
    for (int m = 1; m <= 24; ++m) {
      const auto placement = v_placement(P);
      const auto plans = make_plans(Schedule::kZeroBubbleV, placement, P, m);
      const double makespan = simulate(plans, placement, m, 1, 2);
      if (m >= 2 * P - 1) {
        EXPECT_DOUBLE_EQ(makespan, 6.0 * m + P - 1) << P << " workers, m " << m;
        const double h1 = simulate(make_plans(Schedule::kZeroBubbleH1, one_stage_per_worker(P), P, m),
                                   one_stage_per_worker(P), m, 2, 4);
        EXPECT_DOUBLE_EQ(h1 - 6.0 * m, 2 * (makespan - 6.0 * m)) << P << " workers, m " << m;
      }
      for (const auto& plan : plans) {
        int live = 0, peak = 0;
        for (const Action& a : plan) {
          EXPECT_NE(a.kind, B);
          live += a.kind == F ? 1 : a.kind == W ? -1 : 0;
          peak = std::max(peak, live);
        }
        EXPECT_LE(peak, 2 * P) << P << " workers, m " << m;
      }
    }
  }
  // The bench's case: P = 4, m = 8, stages of half a worker's share (F = I = W = 0.5).
  EXPECT_DOUBLE_EQ(simulate(make_plans(Schedule::kZeroBubbleV, v_placement(4), 4, 8), v_placement(4), 8,
                            std::vector<double>(8, 0.5), std::vector<double>(8, 1), std::vector<double>(8, 0.5)),
                   25.5);
  EXPECT_EQ(plans_csv(make_plans(Schedule::kZeroBubbleV, v_placement(2), 2, 4)),
            "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,0I2,0W2,0I3,0W3\n"
            "1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,1I3,1W2,2W3,1W3\n");
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
        for (int s = 0; s < p; ++s) EXPECT_EQ(peak_in_flight(plans, p)[s], m);
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
            (std::vector<std::vector<Action>>{{{0, 0, F}, {0, 0, B}}, {{1, 0, F}, {1, 0, B}}}));
  auto parse_error = [](const std::string& csv) {
    try {
      parse_plans_csv(csv);
    } catch (const Error& e) {
      return std::string(e.status().message());
    }
    return std::string("no error");
  };
  EXPECT_EQ(parse_error("0F0,0X1"),
            "plan line 1, cell 2: '0X1' is not an action (<stage><F|B|I|W><micro-batch>, e.g. 1B3; B a full "
            "backward, I and W its halves)");
  EXPECT_EQ(parse_plans_csv("0F0,0I0\n1F0,1I0,1W0,0W0"),
            (std::vector<std::vector<Action>>{{{0, 0, F}, {0, 0, I}}, {{1, 0, F}, {1, 0, I}, {1, 0, W}, {0, 0, W}}}));
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
  EXPECT_NE(parse_error("0F0,0R0"), "no error");  // a sum across replicas is a timeline's, never a plan's
  try {
    simulate({{{0, 0, F}, {0, 0, B}, {0, 0, Kind::kReduce}}}, {0}, 1, 1, 2);
    ADD_FAILURE() << "a plan holding a sum across replicas was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.status().message(), "action 2 of worker 0 (0R0): a sum across replicas is not an action of a plan");
  }
  EXPECT_EQ(sim_error("0F0,0F1,0B0\n1F0,1B0,1F1,1B1"),
            "action 0B1 (or its halves 0I1 and 0W1) is in no plan (worker 0's)");
  // Split backwards: I then W, each once, never beside a full B of the same micro-batch; W waits for its I only.
  EXPECT_EQ(sim_error("0F0,0F1,0I0,0W0,0B1\n1F0,1I0,1F1,1B1,1W0"), "no error");
  EXPECT_EQ(sim_error("0F0,0F1,0I0,0B1\n1F0,1I0,1W0,1F1,1B1"),
            "action 0W0 is in no plan (worker 0's): a split backward needs its W after its I");
  EXPECT_EQ(sim_error("0F0,0F1,0I0,0W0,0B1,0W1\n1F0,1I0,1W0,1F1,1B1"),
            "micro-batch 1 of stage 0 has a full backward (0B1) and a split one (I or W) in worker 0's plan: one or "
            "the other");
  EXPECT_EQ(sim_error("0F0,0F1,0W0,0I0,0B1\n1F0,1I0,1W0,1F1,1B1"),
            "the plans deadlock: worker 0 waits forever at its action 2 (0W0) for 0I0, which worker 0 plans after an "
            "action that cannot run");
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
  for (auto s : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B, Schedule::kLoopedBFS,
                 Schedule::kZeroBubbleH1, Schedule::kZeroBubbleV, Schedule::kCustom}) {
    EXPECT_EQ(schedule_from_name(schedule_name(s)), s);
  }
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::kCustom, {0, 1}, 2, 2); }), kInvalid);
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::kZeroBubbleH1, {0, 1, 0, 1}, 2, 2); }), kInvalid);  // one per worker
  EXPECT_EQ(thrown_code([] { make_plans(Schedule::kZeroBubbleV, {0, 1, 0, 1}, 2, 2); }), kInvalid);   // not a V
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
      events.push_back({s, s + 1, i, F, 1000 + 100 * (i + s), 1000 + 100 * (i + s) + 80});
      events.push_back({s, s + 1, i, s == 0 ? B : I, 2000 + 100 * (i + s), 2000 + 100 * (i + s) + 80});
      if (s == 1) events.push_back({s, s + 1, i, W, 3000 + 100 * i, 3000 + 100 * i + 80});
    }
  }
  const std::string json = chrome_trace_json(events);
  size_t n = 0;
  for (size_t at = json.find("\"ph\":\"X\""); at != std::string::npos; at = json.find("\"ph\":\"X\"", at + 1)) ++n;
  EXPECT_EQ(n, events.size());
  EXPECT_NE(json.find("\"name\":\"B2\""), std::string::npos);
  EXPECT_NE(json.find("\"name\":\"I2\",\"cat\":\"backward_input\""), std::string::npos);
  EXPECT_NE(json.find("\"name\":\"W1\",\"cat\":\"backward_weight\""), std::string::npos);
  const std::string svg = schedule_svg(events, 2, "test");
  n = 0;
  for (size_t at = svg.find("<title>"); at != std::string::npos; at = svg.find("<title>", at + 1)) ++n;
  EXPECT_EQ(n, events.size());
  EXPECT_EQ(svg.rfind("</svg>"), svg.size() - 7);
  for (const char* legend : {"F forward", "B backward", "I input gradient", "W weight gradient"}) {
    EXPECT_NE(svg.find(legend), std::string::npos) << legend;
  }
}

}  // namespace
}  // namespace tandem::pipeline
