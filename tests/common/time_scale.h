// The one knob for slow builds: every time bound a test asserts on, and every wait it polls with, is multiplied by
// TANDEM_TEST_TIME_SCALE (a number >= 1; default 1). ThreadSanitizer runs the workers 5-15x slower, so .ci/tsan sets
// it; a test then fails there only for what it checks, not for being slow.
//
// What is scaled is the slack a test allows for work (start-up, a reply, a sweep), never the deadline under test:
// a bound "the call's 3 s deadline plus 2 s" becomes milliseconds(3000) + scaled(milliseconds(2000)), because the
// deadline fires on a timer whatever the build.
#pragma once

#include <chrono>
#include <cstdlib>
#include <thread>

namespace tandem::test {

// TANDEM_TEST_TIME_SCALE, read once; 1 when unset or not a number >= 1. Thread-safe.
inline double time_scale() {
  static const double scale = [] {
    const char* v = std::getenv("TANDEM_TEST_TIME_SCALE");
    const double s = v ? std::strtod(v, nullptr) : 1.0;
    return s >= 1.0 ? s : 1.0;
  }();
  return scale;
}

// `bound` times time_scale().
inline std::chrono::milliseconds scaled(std::chrono::milliseconds bound) {
  return std::chrono::milliseconds(static_cast<std::chrono::milliseconds::rep>(bound.count() * time_scale()));
}

// Calls `done` every millisecond until it returns true or `bound` has passed (unscaled: pass scaled(...) for slack);
// returns its last answer. The waits of tests for a state another thread or process reaches.
template <typename Pred>
bool poll_until(std::chrono::milliseconds bound, Pred&& done) {
  const auto until = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return done();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace tandem::test
