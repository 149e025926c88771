#!/usr/bin/env bash
# Tandem's suites across test hosts: 3 network namespaces on a bridge (scripts/hosts.sh), the test process in host 0
# and worker rank r in host r, each started by its own tandem-run (--nnodes --node-rank --master-addr), so every call
# crosses a TCP/IP link (tests/common/multiproc.h, TestHosts): by default over the direct channel's TCP route (the
# transport "auto"), with "-grpc" over gRPC forced, with TLS over gRPC with TLS.
#   bash tests/hosts/run.sh suites BUILD_DIR       a representative subset of each suite (listed below)
#   bash tests/hosts/run.sh suites-grpc BUILD_DIR  the same over gRPC
#   bash tests/hosts/run.sh suites-tls BUILD_DIR   the same with TLS between all workers
#   bash tests/hosts/run.sh faults BUILD_DIR       the HostFaults tests: links cut mid-call, mid-fetch, mid-backward
#                                                  and mid-allreduce, a black-holed host, a killed host, healed links,
#                                                  a delayed link
#   bash tests/hosts/run.sh faults-grpc BUILD_DIR  the same over gRPC
# Exits 77 (ctest's skip) with the reason when this machine cannot make network namespaces (not root).
set -euo pipefail
mode="$1"; build="$(cd "$2" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
hosts="$here/../../scripts/hosts.sh"
if ! why="$(bash "$hosts" check 2>&1)"; then echo "SKIPPED: $why"; exit 77; fi

# The subset: each suite's main scenarios, minus tests that inspect a child's exit code or kill it (a child here is
# its tandem-run) and the raw-frame tests (plain-text gRPC clients, which TLS would refuse).
declare -A suites=(
  [rpc_tests]="MultiprocRpc.SyncAsyncAndWorkerInfo:MultiprocRpc.EveryDtypeAndViewRoundTripsBitExact:MultiprocRpc.ContainersScalarsAndTorchScript:MultiprocRpc.ErrorsNameWorkerFunctionAndCause:MultiprocRpc.TimeoutFailsTheCallAtItsDeadline:MultiprocRpc.ThousandConcurrentAsyncCalls:MultiprocRpc.AsyncFunctionsDoNotHoldServerThreads:MultiprocRpc.GracefulShutdownWaitsForCallsInFlight:MultiprocRpc.ValueCodecsAndTheirWaits"
  [rref_tests]="MultiprocRRef.RemoteReturnsAtOnceAndToHereFetches:MultiprocRRef.EveryForkPath:MultiprocRRef.AnRRefOfAnRRefIsFreedWithItsValue:MultiprocRRef.ChainsOfWorkers:MultiprocRRef.RemoteObjects:MultiprocRRef.ErrorsNameTheOwner:MultiprocRRef.ConcurrentForksAndDeletionsLeaveNothing"
  [dist_autograd_tests]="MultiprocDistAutograd.MlpChainAcrossTwoWorkers:MultiprocDistAutograd.NestedCallsThreeHops:MultiprocDistAutograd.FanOutFanInAndAParameterUsedOnSeveralWorkers:MultiprocDistAutograd.ThroughRRefsRemoteAndToHere:MultiprocDistAutograd.ConcurrentContextsDoNotMix:MultiprocDistAutograd.AnErrorInARemoteBackwardReachesTheCaller:MultiprocDistAutograd.UnknownContextAndBadRootsAreErrors"
  [comm_tests]="MultiprocComm.EveryCollectiveAndDtypeOnThreeRanks:MultiprocComm.SubgroupOfTwoOutOfThree"
  [ddp_tests]="*MultiprocDdpEquivalence*:MultiprocDdp.BucketsFollowReverseOrderWithASmallFirstBucketAndAreRebuilt:MultiprocDdp.HybridWithDistributedAutogradOverlapsAndFollowsOneProcess:MultiprocDdp.BuffersAreRankZerosBeforeEachForward:MultiprocDdp.DifferentModelsAreRefusedNamingTheRank"
)
order=(rpc_tests rref_tests dist_autograd_tests comm_tests ddp_tests)
case "$mode" in
  suites | suites-grpc | suites-tls) ;;
  faults | faults-grpc) for b in rpc_tests rref_tests dist_autograd_tests comm_tests; do suites[$b]="HostFaults.*"; done
          order=(rpc_tests rref_tests dist_autograd_tests comm_tests) ;;
  *) echo "usage: run.sh suites|suites-grpc|suites-tls|faults|faults-grpc BUILD_DIR" >&2; exit 2 ;;
esac

name="th$$"
tmp="$(mktemp -d)"
trap 'bash "$hosts" down "$name"; rm -rf "$tmp"' EXIT
bash "$hosts" up "$name" 3
export TANDEM_TEST_HOSTS="$name:3" TANDEM_TEST_LAUNCHER="$build/tandem-run" TANDEM_TEST_HOSTS_SCRIPT="$hosts"
export TANDEM_TEST_DELAY_RELAY="$build/delay_relay"
export TANDEM_TEST_MASTER_ADDR="$(bash "$hosts" addr "$name" 0)" TANDEM_TRANSPORT=auto
case "$mode" in *-grpc) export TANDEM_TRANSPORT=grpc ;; esac
if [ "$mode" = suites-tls ]; then
  bash "$hosts" tls "$tmp"
  # Through the environment every Tandem program reads (rpc/rpc.h, RpcOptions::tls): the test process and every worker.
  export TANDEM_TLS_CERT="$tmp/node.crt" TANDEM_TLS_KEY="$tmp/node.key" TANDEM_TLS_CA="$tmp/ca.crt"
fi

# The tests that ran to completion (neither skipped nor filtered out), one full name a line as the filter sees it
# ("Suite.Test", a parameterized one's "Prefix/Suite.Test/0"), from gtest's XML report: each <testcase> opens on a
# line of its own with its name, status and result, and its suite as classname.
completed() {
  local line test_name
  while IFS= read -r line; do
    if [[ $line == *'<testcase '* && $line == *' status="run"'* && $line == *' result="completed"'* &&
          $line =~ \ name=\"([^\"]*)\" ]]; then
      test_name="${BASH_REMATCH[1]}"
      if [[ $line =~ \ classname=\"([^\"]*)\" ]]; then echo "${BASH_REMATCH[1]}.$test_name"; fi
    fi
  done <"$1"
}

# The patterns of a filter ("a:b*:c", no negative part) that no completed test matches, one a line. A pattern is
# matched as gtest matches it: a bash pattern's * and ? are gtest's, and the filters name no other wildcard.
unmatched() {
  local pattern test hit
  local -a patterns
  IFS=':' read -ra patterns <<<"$1"
  for pattern in "${patterns[@]}"; do
    hit=0
    while IFS= read -r test; do
      # shellcheck disable=SC2053  # the unquoted right side is the pattern
      if [[ $test == $pattern ]]; then hit=1; break; fi
    done <<<"$2"
    if ((!hit)); then echo "$pattern"; fi
  done
}

failed=()
for b in "${order[@]}"; do
  echo "== $b on 3 hosts ($mode): ${suites[$b]}"
  out="$tmp/$b.out" report="$tmp/$b.xml"
  # A run passes only when every pattern of its filter matched a test that ran there: a skipped test (not on 3
  # hosts?) or a pattern that matches nothing (a renamed test) fails it, as a failed test does. Counting the tests
  # that ran would not do: a pattern that matches several tests (*MultiprocDdpEquivalence*, HostFaults.*) makes up
  # for one that matches none.
  if ! timeout 600 bash "$hosts" exec "$name" 0 "$build/$b" --gtest_filter="${suites[$b]}" --gtest_brief=1 \
       --gtest_output="xml:$report" 2>&1 | tee "$out"; then
    failed+=("$b")
  elif grep -q '^\[  SKIPPED \]' "$out"; then
    echo "FAILED: tests of $b skipped on the test hosts"
    failed+=("$b")
  elif [ ! -s "$report" ]; then
    echo "FAILED: $b wrote no report of its tests ($report)"
    failed+=("$b")
  elif missing="$(unmatched "${suites[$b]}" "$(completed "$report")")" && [ -n "$missing" ]; then
    echo "FAILED: $b ran no test for the pattern(s) $(tr '\n' ' ' <<<"$missing")of its filter"
    failed+=("$b")
  fi
done
if ((${#failed[@]})); then echo "FAILED on test hosts ($mode): ${failed[*]}"; exit 1; fi
echo "all passed on test hosts ($mode)"
