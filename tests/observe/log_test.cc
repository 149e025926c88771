// The log (log/log.h): levels, the line's form, and what a real job writes at each level.
#include "tandem/log/log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <sstream>

#include "tests/common/multiproc.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;
using testing::HasSubstr;
using testing::Not;

TEST(UnitLog, ParsesTheFourLevelsInAnyCaseAndNothingElse) {
  EXPECT_EQ(log::parse_level("error"), log::Level::kError);
  EXPECT_EQ(log::parse_level("WARN"), log::Level::kWarn);
  EXPECT_EQ(log::parse_level("warning"), log::Level::kWarn);
  EXPECT_EQ(log::parse_level("Info"), log::Level::kInfo);
  EXPECT_EQ(log::parse_level("debug"), log::Level::kDebug);
  EXPECT_EQ(log::parse_level(""), std::nullopt);
  EXPECT_EQ(log::parse_level("verbose"), std::nullopt);
  EXPECT_EQ(log::parse_level("2"), std::nullopt);
}

TEST(UnitLog, TheEnvironmentSetsTheLevelAndABadValueKeepsTheDefaultSayingSo) {
  setenv("TANDEM_LOG_LEVEL", "debug", 1);
  log::reload_from_env();
  EXPECT_EQ(log::level(), log::Level::kDebug);
  unsetenv("TANDEM_LOG_LEVEL");
  log::reload_from_env();
  EXPECT_EQ(log::level(), log::Level::kWarn);  // the default: quiet
  setenv("TANDEM_LOG_LEVEL", "loud", 1);
  testing::internal::CaptureStderr();
  log::reload_from_env();
  const std::string err = testing::internal::GetCapturedStderr();
  unsetenv("TANDEM_LOG_LEVEL");
  EXPECT_EQ(log::level(), log::Level::kWarn);
  EXPECT_THAT(err, HasSubstr("TANDEM_LOG_LEVEL='loud' is not one of error, warn, info, debug; using warn"));
}

// One line per message, with glog's severity letter, the source file, and "[tandem <worker> <subsystem>]"; lines
// below the level are not written and their stream is not evaluated.
TEST(UnitLog, LinesNameTheWorkerAndSubsystemAndFollowTheLevel) {
  log::set_worker("w7");
  log::set_level(log::Level::kInfo);
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  testing::internal::CaptureStderr();
  TANDEM_LOG(kDebug, "probe") << "hidden " << count();
  TANDEM_LOG(kInfo, "probe") << "shown " << count();
  TANDEM_LOG(kWarn, "probe") << "warned";
  TANDEM_LOG(kError, "probe") << "failed";
  const std::string err = testing::internal::GetCapturedStderr();
  log::set_level(log::Level::kWarn);
  log::set_worker("");
  EXPECT_EQ(evaluated, 1);
  EXPECT_THAT(err, Not(HasSubstr("hidden")));
  EXPECT_TRUE(std::regex_search(
      err, std::regex(R"((^|\n)I\d{8} [0-9:.]+ +\d+ log_test\.cc:\d+\] \[tandem w7 probe\] shown 1\n)")))
      << err;
  EXPECT_TRUE(std::regex_search(err, std::regex(R"((^|\n)W\d{8} .*\] \[tandem w7 probe\] warned\n)"))) << err;
  EXPECT_TRUE(std::regex_search(err, std::regex(R"((^|\n)E\d{8} .*\] \[tandem w7 probe\] failed\n)"))) << err;
}

// A two-worker job under tandem-run, at a level from its environment. Returns what it printed.
std::string run_job(const std::string& level) {
  std::map<std::string, std::string> env;
  env["TANDEM_LOG_LEVEL"] = level;
  Process p({TANDEM_RUN_PATH, "--nproc-per-node", "2", self_exe(), "--worker", "log_traffic"}, env);
  const int code = exit_code(p.wait(milliseconds(60000)));
  EXPECT_EQ(code, 0) << p.output();
  return p.output();
}

int lines_with(const std::string& out, const std::string& text) {
  std::istringstream in(out);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(text) != std::string::npos;
  return n;
}

TEST(MultiprocLog, DebugShowsConnectionsRendezvousRRefStepsContextsAndCollectivesOnEachWorker) {
  const std::string out = run_job("debug");
  for (const std::string worker : {"worker0", "worker1"}) {
    for (const std::string what :
         {" rendezvous debug] contacting the master's store", " rendezvous debug] published worker/",
          " rpc debug] route to ", " rpc debug] direct channel to ", " rpc] joined the job as rank ",
          " rref debug] rref ", " dist_autograd debug] context ", " comm debug] process group 'log_test' ready",
          " comm debug] process group 'log_test' (rank ", " rpc] left the job (graceful shutdown)"}) {
      EXPECT_GE(lines_with(out, "[tandem " + worker + what), 1) << worker << what << " missing in:\n" << out;
    }
  }
  EXPECT_GE(lines_with(out, "rref debug] rref "), 4) << out;  // creation, confirmation, owner's entry, deletion
  EXPECT_GE(lines_with(out, "dist_autograd debug] backward of context "), 2) << out;
  EXPECT_GE(lines_with(out, " of 64 bytes over shared_memory"), 2) << out;  // the allreduce of 16 floats, each rank
}

TEST(MultiprocLog, TheDefaultIsQuietButForTheErrorNobodyElseCouldReport) {
  const std::string out = run_job("");
  EXPECT_EQ(lines_with(out, "[tandem "), 1) << out;
  EXPECT_EQ(lines_with(out, "[rank1]: E"), 1) << out;
  EXPECT_EQ(lines_with(out, "[tandem worker1 rpc] one-way call 'log_test.fail' from worker 'worker0' failed: "), 1)
      << out;
}

TEST(MultiprocLog, InfoAddsEachWorkersJoiningAndLeavingOnly) {
  const std::string out = run_job("info");
  EXPECT_EQ(lines_with(out, " debug] "), 0) << out;
  EXPECT_EQ(lines_with(out, "rpc] joined the job as rank "), 2) << out;
  EXPECT_EQ(lines_with(out, "rpc] left the job (graceful shutdown)"), 2) << out;
  EXPECT_EQ(lines_with(out, "[tandem "), 5) << out;  // and the one-way call's error
}

TEST(MultiprocLog, ErrorLevelKeepsOnlyErrors) {
  const std::string out = run_job("error");
  EXPECT_EQ(lines_with(out, "[tandem "), 1) << out;
  EXPECT_EQ(lines_with(out, "one-way call 'log_test.fail'"), 1) << out;
}

}  // namespace
}  // namespace tandem::test
