#include "examples/rl/cartpole.h"

#include <cmath>

namespace tandem::examples::rl {

CartPole::State CartPole::reset() {
  std::uniform_real_distribution<double> u(-0.05, 0.05);
  for (double& v : state_) v = u(rng_);
  steps_ = 0;
  return state_;
}

CartPole::Step CartPole::step(int action) {
  auto& [x, x_dot, theta, theta_dot] = state_;
  const double force = action == 1 ? kForceMag : -kForceMag;
  const double cos_t = std::cos(theta), sin_t = std::sin(theta);
  const double temp = (force + kPoleMassLength * theta_dot * theta_dot * sin_t) / kTotalMass;
  const double theta_acc =
      (kGravity * sin_t - cos_t * temp) / (kLength * (4.0 / 3.0 - kMassPole * cos_t * cos_t / kTotalMass));
  const double x_acc = temp - kPoleMassLength * theta_acc * cos_t / kTotalMass;
  x += kTau * x_dot;
  x_dot += kTau * x_acc;
  theta += kTau * theta_dot;
  theta_dot += kTau * theta_acc;
  ++steps_;
  const bool fell = x < -kXThreshold || x > kXThreshold || theta < -kThetaThreshold || theta > kThetaThreshold;
  return Step{state_, 1.0, fell || steps_ >= kMaxSteps};
}

}  // namespace tandem::examples::rl
