// CartPole-v1: the classic cart-and-pole dynamics (Barto, Sutton & Anderson 1983, as gym's CartPoleEnv has them),
// Euler integration, seeded resets.
#pragma once

#include <array>
#include <cstdint>
#include <random>

namespace tandem::examples::rl {

class CartPole {
 public:
  static constexpr double kGravity = 9.8, kMassCart = 1.0, kMassPole = 0.1, kTotalMass = kMassCart + kMassPole;
  static constexpr double kLength = 0.5;  // half the pole's length
  static constexpr double kPoleMassLength = kMassPole * kLength, kForceMag = 10.0, kTau = 0.02;
  static constexpr double kThetaThreshold = 12 * 2 * 3.14159265358979323846 / 360, kXThreshold = 2.4;
  static constexpr int kMaxSteps = 500;  // CartPole-v1 cuts an episode here

  using State = std::array<double, 4>;  // x, x_dot, theta, theta_dot
  struct Step {
    State state;
    double reward;
    bool done;  // the pole fell, the cart left the track, or kMaxSteps were taken
  };

  explicit CartPole(uint64_t seed) : rng_(seed) {}
  // A new episode: every state value uniform in [-0.05, 0.05).
  State reset();
  // Action 1 pushes the cart right, 0 left. Reward 1 for every step, the last one included.
  Step step(int action);
  // For tests: the episode continues from `s`.
  void set_state(const State& s) { state_ = s, steps_ = 0; }
  const State& state() const { return state_; }

 private:
  std::mt19937_64 rng_;
  State state_{};
  int steps_ = 0;
};

}  // namespace tandem::examples::rl
