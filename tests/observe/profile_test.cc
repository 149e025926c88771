// Profiles (profile/profile.h): one Chrome trace per worker with LibTorch's operators and Tandem's communication.
#include "tandem/profile/profile.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "tandem/rpc/errors.h"
#include "tests/common/multiproc.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;

std::string trace_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Event {
  std::string name, cat;
  int64_t tid = 0, ts = 0, dur = 0;
};

// The trace as written: one event per line between `{"traceEvents":[` and `]}`; every line must be a well-formed
// event (or the process-name record).
std::vector<Event> events_of(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "{\"traceEvents\":[");
  const std::regex meta(R"(\{"ph":"M","name":"process_name","pid":\d+,"tid":0,"args":\{"name":"worker\d*"\}\},?)");
  const std::regex event(
      R"re(\{"ph":"X","cat":"([^"]*)","name":"((?:[^"\\]|\\.)*)","pid":\d+,"tid":(\d+),"ts":(\d+),"dur":(\d+)\},?)re");
  std::vector<Event> out;
  bool ended = false;
  while (std::getline(in, line)) {
    std::smatch m;
    if (line == "]}") {
      ended = true;
    } else if (std::regex_match(line, m, event)) {
      out.push_back(Event{m[2], m[1], std::stoll(m[3]), std::stoll(m[4]), std::stoll(m[5])});
    } else {
      EXPECT_TRUE(std::regex_match(line, meta)) << "not an event: " << line;
    }
  }
  EXPECT_TRUE(ended) << "the trace does not end with ]}";
  return out;
}

const Event* named(const std::vector<Event>& events, const std::string& prefix) {
  for (const auto& e : events) {
    if (e.name.rfind(prefix, 0) == 0) return &e;
  }
  return nullptr;
}

TEST(UnitProfile, StopWithoutStartAndASecondStartAreErrors) {
  EXPECT_THROW(profile::stop("/nonexistent/x.json"), Error);
  profile::start();
  EXPECT_THROW(profile::start(), Error);
  EXPECT_FALSE(profile::active() == false);
  const TempDir temp;
  const std::string& dir = temp.path();
  profile::stop(dir + "/t.json");  // a profile of nothing: its event count may be 0
  EXPECT_FALSE(profile::active());
  std::ifstream written(dir + "/t.json");
  EXPECT_TRUE(written.good()) << "stop() wrote no trace file";
}

// A range is in the profile only when it began inside it, as the operators it covers are (a call served across the
// start would show as a range with nothing inside).
TEST(UnitProfile, ARangeThatBeganBeforeTheStartIsLeftOut) {
  const auto before = std::chrono::steady_clock::now();
  profile::start();
  const auto inside = std::chrono::steady_clock::now();
  profile::report_steady("began_before", before, std::chrono::steady_clock::now());
  profile::report_steady("began_inside", inside, std::chrono::steady_clock::now());
  const TempDir temp;
  const std::string& dir = temp.path();
  profile::stop(dir + "/t.json");
  const std::string text = trace_file(dir + "/t.json");
  const std::vector<Event> events = events_of(text);
  EXPECT_EQ(named(events, "began_before"), nullptr) << text;
  ASSERT_NE(named(events, "began_inside"), nullptr) << text;
  EXPECT_EQ(named(events, "began_inside")->cat, "tandem");
}

// Each worker of the job in main.cc profiles its traffic: the trace shows its own operators and the operators its
// registered functions ran for the peer, beside both ends of the calls, the collectives, the backward passes and the
// DDP bucket; times are since the epoch, so both workers' traces line up.
TEST(MultiprocProfile, OneTraceShowsComputationAndCommunicationOfBothEnds) {
  const TempDir temp;
  const std::string& dir = temp.path();
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "log_traffic"},
            {{"TANDEM_TEST_PROFILE", dir}});
  ASSERT_EQ(exit_code(p.wait(milliseconds(60000))), 0) << p.output();
  const int64_t now_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  for (int me = 0; me < 2; ++me) {
    const std::string w = "worker" + std::to_string(me), peer = "worker" + std::to_string(1 - me);
    const std::string text = trace_file(dir + "/" + w + ".json");
    const std::vector<Event> events = events_of(text);
    for (const std::string& name : std::vector<std::string>{
             "rpc_sync#log_test.scale(" + w + " -> " + peer + ")",
             "rpc_serve#log_test.scale(" + peer + " -> " + w + ")",
             "rpc_async#__tandem.rref.create(" + w + " -> " + peer + ")", "comm:allreduce(group log_test, 64 bytes",
             "comm:barrier(group log_test", "dist_autograd:backward#", "dist_autograd:remote_backward#",
             "ddp:bucket#0(", "aten::mul", "aten::addmm"}) {
      const Event* e = named(events, name);
      ASSERT_NE(e, nullptr) << name << " missing in " << w << "'s trace:\n" << text;
      EXPECT_GT(e->ts, now_us - 120'000'000) << name;  // since the epoch, in this test's minutes
      EXPECT_LE(e->ts + e->dur, now_us) << name;
    }
    EXPECT_EQ(named(events, "rpc_sync#log_test.scale")->cat, "tandem");
    // The peer's call ran log_test.scale here, on one of Tandem's threads: its multiplication is in this trace, on
    // another thread than the one that profiled.
    const Event* served = named(events, "rpc_serve#log_test.scale");
    const int64_t profiling_thread = named(events, "rpc_sync#log_test.scale")->tid;  // the caller's: the profiling one
    bool mul_while_serving = false;
    for (const auto& e : events) {
      mul_while_serving |= e.name == "aten::mul" && e.tid != profiling_thread && e.ts >= served->ts - 1000 &&
                           e.ts <= served->ts + served->dur + 1000;
    }
    EXPECT_TRUE(mul_while_serving) << text;
  }
}

}  // namespace
}  // namespace tandem::test
