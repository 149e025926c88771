// The C++ CartPole against the published equations of motion, and the agent's batched and single answers.
#include <gmock/gmock.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "examples/rl/agent.h"
#include "examples/rl/cartpole.h"
#include "tandem/rpc/batching.h"
#include "tandem/rpc/registry.h"

namespace tandem::examples::rl {
namespace {

// The cart-pole's equations of motion as the linear system they are (Barto, Sutton & Anderson 1983; a uniform pole of
// half-length l on a frictionless cart), solved by Cramer's rule — not gym's closed form, which CartPole uses:
//   (M + m) x'' + m l cos(t) t'' = F + m l t'^2 sin(t)
//   cos(t) x'' + (4/3) l t''      = g sin(t)
std::array<double, 4> reference_step(const std::array<double, 4>& s, int action) {
  const double M = 1.0, m = 0.1, l = 0.5, g = 9.8, tau = 0.02;
  const double F = action == 1 ? 10.0 : -10.0;
  const double x = s[0], xd = s[1], t = s[2], td = s[3];
  const double a11 = M + m, a12 = m * l * std::cos(t), b1 = F + m * l * td * td * std::sin(t);
  const double a21 = std::cos(t), a22 = 4.0 / 3.0 * l, b2 = g * std::sin(t);
  const double det = a11 * a22 - a12 * a21;
  const double xdd = (b1 * a22 - a12 * b2) / det, tdd = (a11 * b2 - a21 * b1) / det;
  return {x + tau * xd, xd + tau * xdd, t + tau * td, td + tau * tdd};  // Euler, positions from old velocities
}

TEST(UnitCartPole, FollowsTheEquationsOfMotionStepByStep) {
  CartPole env(1);
  const std::array<double, 4> start{0.01, -0.02, 0.03, 0.04};
  env.set_state(start);
  auto expected = start;
  const int actions[] = {1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1};
  for (int k = 0; k < 20; ++k) {
    const auto r = env.step(actions[k]);
    expected = reference_step(expected, actions[k]);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(r.state[i], expected[i], 1e-12) << "step " << k << " value " << i;
    EXPECT_EQ(r.reward, 1.0);
    EXPECT_FALSE(r.done) << "step " << k;
  }
}

TEST(UnitCartPole, EndsWhenThePoleFallsPast12DegreesOrAt500Steps) {
  CartPole env(1);
  env.set_state({0, 0, 0.2, 0});  // 11.5 degrees, falling right
  int steps = 0;
  CartPole::Step r{};
  do {
    r = env.step(0);  // pushing left makes it fall faster
    ++steps;
  } while (!r.done && steps < 100);
  EXPECT_TRUE(r.done);
  EXPECT_GT(r.state[2], CartPole::kThetaThreshold);
  EXPECT_LE(steps, 5);
  // Pushing the way the pole leans (angle plus angular velocity) keeps it up; the episode is cut at 500 steps.
  env.set_state({0, 0, 0, 0});
  for (int k = 1; k <= 500; ++k) {
    const auto& s = env.state();
    r = env.step(s[2] + s[3] > 0 ? 1 : 0);
    if (r.done) {
      EXPECT_EQ(k, 500) << "fell at step " << k;
      break;
    }
  }
  EXPECT_TRUE(r.done);
}

TEST(UnitCartPole, ResetIsSeededAndSmall) {
  CartPole a(7), b(7), c(8);
  const auto sa = a.reset(), sb = b.reset(), sc = c.reset();
  EXPECT_EQ(sa, sb);
  EXPECT_NE(sa, sc);
  for (double v : sa) EXPECT_TRUE(v >= -0.05 && v < 0.05);
}

TEST(UnitRlAgent, OneBatchedForwardAnswersAsSingleOnesDo) {
  Agent batched(5, 3), single(5, 3);
  std::vector<Request> requests;
  for (int o = 0; o < 5; ++o) requests.push_back({double(o), 0.01 * o, -0.02, 0.03 * o, 0.1, 0.1 + 0.2 * o, 0});
  const auto together = batched.select(requests);
  for (int o = 0; o < 5; ++o) {
    ASSERT_TRUE(together[o].ok()) << together[o].status();
    EXPECT_EQ(*single.select({requests[o]}).front(), *together[o]) << "observer " << o;
  }
}

// A malformed request in a batch fails alone, and nothing of it is recorded: the round of the others still finishes
// (issue 27: steps were recorded before the bad request was found, and the whole batch failed).
TEST(UnitRlAgent, ABadRequestFailsAloneAndTheRoundOfTheOthersFinishes) {
  Agent agent(2, 3);
  const Request good0{0, 0.01, -0.02, 0.03, 0.1, 0.3, 0}, good1{1, 0.02, 0.01, -0.03, 0.0, 0.6, 0};
  const Request unknown_observer{7, 0, 0, 0, 0, 0.5, 0}, too_short{1, 0, 0, 0, 0.5, 0};
  const auto actions = agent.select({good0, unknown_observer, good1, too_short});
  ASSERT_EQ(actions.size(), 4u);
  EXPECT_TRUE(actions[0].ok());
  EXPECT_EQ(actions[1].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(actions[1].status().message()), ::testing::HasSubstr("no observer 7"));
  EXPECT_TRUE(actions[2].ok());
  EXPECT_EQ(actions[3].status().code(), absl::StatusCode::kInvalidArgument);
  Trajectory one_step;
  one_step.rewards = {1.0};
  one_step.ends = {1};
  EXPECT_NO_THROW(agent.finish_round({0, 1}, {one_step, one_step}));
}

// A round whose trajectories do not match the steps taken (an observer that died mid-episode, a malformed one) fails
// alone: the next round starts from no steps and finishes; a trajectory whose episode ends are short is refused, not
// read past its end.
TEST(UnitRlAgent, AMismatchedRoundFailsAloneAndTheNextFinishes) {
  Agent agent(2, 3);
  const Request r0{0, 0.01, -0.02, 0.03, 0.1, 0.3, 0}, r1{1, 0.02, 0.01, -0.03, 0.0, 0.6, 0};
  ASSERT_TRUE(agent.select({r0, r1})[0].ok());
  ASSERT_TRUE(agent.select({r0})[0].ok());  // observer 0 took two steps
  Trajectory one_step;
  one_step.rewards = {1.0};
  one_step.ends = {1};
  EXPECT_THROW(agent.finish_round({0, 1}, {one_step, one_step}), std::logic_error);
  Trajectory no_ends = one_step;
  no_ends.ends.clear();
  ASSERT_TRUE(agent.select({r0, r1})[0].ok());
  EXPECT_THROW(agent.finish_round({0, 1}, {one_step, no_ends}), std::logic_error);
  EXPECT_THROW(agent.finish_round({0, 1}, {one_step}), std::logic_error);
  ASSERT_TRUE(agent.select({r0, r1})[0].ok());
  EXPECT_NO_THROW(agent.finish_round({0, 1}, {one_step, one_step}));
}

// Observers that finish at the same moment each make the batch one smaller: when all have finished, max_batch is 1
// (issue 27: the count and max_batch changed in two steps, and a stale larger max_batch could win).
TEST(UnitRlAgent, ObserversFinishingTogetherLeaveTheRightBatchSize) {
  const rpc::Handler done = rpc::find_function("rl.observer_done");
  ASSERT_TRUE(done);
  constexpr int kObservers = 16;
  for (int round = 0; round < 200; ++round) {
    set_active_observers(round + 1, kObservers);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kObservers; ++i) {
      threads.emplace_back([&, i] {
        ++ready;
        while (ready.load() < kObservers) std::this_thread::yield();
        done({c10::IValue(int64_t{round + 1}), c10::IValue(int64_t{i})}).value();
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(active_observers(), 0) << "round " << round;
    ASSERT_EQ(rpc::batch_stats("rl.select_action_batch").max_batch, 1) << "round " << round;
  }
}

// Rounds (agent.h): a request of another round than the agent's open one, earlier (an observer still playing a round
// that gave up) or later, is refused alone and leaves no step; the others are answered.
TEST(UnitRlAgent, ARequestOfAnotherRoundIsRefusedAloneAndLeavesNoStep) {
  Agent agent(2, 3);
  agent.begin_round(4);
  const Request now{0, 0.01, -0.02, 0.03, 0.1, 0.3, 4}, late{1, 0.02, 0.01, -0.03, 0.0, 0.6, 3};
  const Request ahead{1, 0.02, 0.01, -0.03, 0.0, 0.6, 5}, no_round{1, 0.02, 0.01, -0.03, 0.0, 0.6, 4.5};
  const auto actions = agent.select({now, late, ahead, no_round});
  ASSERT_EQ(actions.size(), 4u);
  EXPECT_TRUE(actions[0].ok()) << actions[0].status();
  EXPECT_EQ(actions[1].status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(actions[1].status().message()),
              ::testing::HasSubstr("observer 1: a request of round 3, but the agent is in round 4"));
  EXPECT_EQ(actions[2].status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(actions[3].status().code(), absl::StatusCode::kInvalidArgument);
  Trajectory one_step;
  one_step.rewards = {1.0};
  one_step.ends = {1};
  EXPECT_NO_THROW(agent.finish_round({0, 1}, {one_step, Trajectory{}}));  // observer 1 took no step
}

// A round that gave up (ended without finish_round) leaves nothing to the next: its late requests are refused, and
// the next round starts from no steps.
TEST(UnitRlAgent, ARoundThatGaveUpLeavesNothingToTheNext) {
  Agent agent(2, 3);
  agent.begin_round(1);
  const Request a1{0, 0.01, -0.02, 0.03, 0.1, 0.3, 1}, b1{1, 0.02, 0.01, -0.03, 0.0, 0.6, 1};
  ASSERT_TRUE(agent.select({a1, b1})[1].ok());
  agent.end_round(1);
  EXPECT_EQ(agent.select({a1})[0].status().code(), absl::StatusCode::kAborted);
  agent.begin_round(2);
  EXPECT_EQ(agent.round(), 2);
  Request a2 = a1;
  a2[6] = 2;
  ASSERT_TRUE(agent.select({a2})[0].ok());
  EXPECT_EQ(agent.select({b1})[0].status().code(), absl::StatusCode::kAborted);
  Trajectory one_step;
  one_step.rewards = {1.0};
  one_step.ends = {1};
  EXPECT_NO_THROW(agent.finish_round({0, 1}, {one_step, Trajectory{}}));  // round 1's two steps are gone
}

// An observer's report of another round (one that gave up), of no slot, or a second one of its slot (a failed observer
// the round counted out) leaves the batch size alone.
TEST(UnitRlAgent, AReportOfAnotherRoundOrASecondOneLeavesTheBatchSize) {
  const rpc::Handler done = rpc::find_function("rl.observer_done");
  ASSERT_TRUE(done);
  const auto report = [&](int64_t round, int64_t slot) { done({c10::IValue(round), c10::IValue(slot)}).value(); };
  set_active_observers(7, 3);
  report(6, 0);
  report(7, 3);
  EXPECT_EQ(active_observers(), 3);
  report(7, 1);
  report(7, 1);
  EXPECT_EQ(active_observers(), 2);
  EXPECT_EQ(rpc::batch_stats("rl.select_action_batch").max_batch, 2);
}

}  // namespace
}  // namespace tandem::examples::rl
