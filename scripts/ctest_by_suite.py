#!/usr/bin/env python3
"""Runs the tests ctest would run, one process per GoogleTest suite instead of one per test.

    python3 scripts/ctest_by_suite.py BUILD_DIR [-j N] [-- CTEST_SELECTION_ARGS...]

ctest starts a test binary for every test; each start loads LibTorch and runs its initialisers (about 0.9 s of CPU
on these machines, about 3 s under ThreadSanitizer), which was more than half of the ThreadSanitizer stage's time.
Here the tests ctest selects (`ctest --show-only=json-v1 ARGS`, so the same set, labels, environments and working
directories) are grouped by binary, suite, environment and directory, and each group runs as one process with a
--gtest_filter naming its tests. A test ctest runs otherwise (a script) runs alone, as ctest would.

Each test keeps its own ctest TIMEOUT: the runner reads GoogleTest's "[ RUN      ]" lines, and a test still running
past its timeout kills its process (and everything it started: it runs in a session of its own) and fails as
"Timeout"; the group's tests after it are reported as not run. A process that exits non-zero after its tests passed
(a sanitizer's report at exit) fails its group. A failed group's whole output is printed, as ctest's
--output-on-failure does. Exits 0 when every test passed (or was skipped), 1 otherwise.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

PASSED = ("Passed", "Skipped")  # the statuses that do not fail a run
RUN = re.compile(r"\[ RUN      \] ([^\s,]+)")
# "[  FAILED  ] Prefix/Suite.Test/0, where GetParam() = ... (12 ms)": the name ends before the comma.
END = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] ([^\s,]+)(?:.* \((\d+) ms\))?")


def select(build, ctest_args):
    out = subprocess.run(["ctest", "--show-only=json-v1", *ctest_args], cwd=build, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["tests"]


def props(test):
    return {p["name"]: p["value"] for p in test.get("properties", [])}


def group(tests):
    """The groups to run, in ctest's order: dicts of their tests ([(ctest name, gtest name or None, timeout)]), the
    command (the binary alone for a suite), environment, directory, whether GoogleTest's, RESOURCE_LOCKs,
    SKIP_RETURN_CODE and estimated cost. A suite's tests with the same environment, directory and locks form one
    group; every other test is a group of its own."""
    groups = {}
    order = []
    for t in tests:
        p = props(t)
        cmd = t["command"]
        env = tuple(p.get("ENVIRONMENT", []))
        cwd = p.get("WORKING_DIRECTORY", None)
        timeout = float(p.get("TIMEOUT", 1500))
        locks = tuple(p.get("RESOURCE_LOCK", []))
        skip_rc = p.get("SKIP_RETURN_CODE", None)
        gtest = len(cmd) >= 2 and cmd[1].startswith("--gtest_filter=") and all(
            a == "--gtest_also_run_disabled_tests" for a in cmd[2:])
        if gtest:
            name = cmd[1][len("--gtest_filter="):]
            key = (cmd[0], name.split(".")[0], env, cwd, locks)
        else:
            name = None
            key = ("script", t["name"])
        if key not in groups:
            groups[key] = {"tests": [], "command": cmd[:1] if gtest else cmd, "env": env, "cwd": cwd,
                           "gtest": gtest, "locks": locks, "skip_rc": skip_rc, "cost": 0.0}
            order.append(key)
        groups[key]["tests"].append((t["name"], name, timeout))
        # ctest's COST where the test states one (about its seconds here), else a guess: a script 10 s, a
        # multi-process test 2 s, a unit test 0.3 s.
        default = 10.0 if not gtest else 2.0 if "Multiproc" in t["name"] else 0.3
        groups[key]["cost"] += float(p.get("COST", default))
    return [groups[k] for k in order]


class Result:
    def __init__(self):
        self.status = {}  # ctest name -> Passed / Failed / Skipped / Timeout / Not run
        self.ms = {}
        self.output = []
        self.seconds = 0.0
        self.note = ""


def run_group(g, print_lock):
    r = Result()
    by_gtest = {gt: (name, timeout) for name, gt, timeout in g["tests"]}
    env = dict(os.environ)
    for kv in g["env"]:
        k, _, v = kv.partition("=")
        env[k] = v
    cmd = list(g["command"])
    if g["gtest"]:
        cmd += ["--gtest_filter=" + ":".join(gt for _, gt, _ in g["tests"]), "--gtest_also_run_disabled_tests"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=g["cwd"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    # A deadline is always armed: a test's own from its RUN line to its result; before the first, between tests and
    # after the last (start-up, a suite's set-up and tear-down, the exit), the group's longest test's.
    longest = max(t for _, _, t in g["tests"])
    running = {"name": None if g["gtest"] else g["tests"][0][0], "since": start, "timeout": longest}
    lock = threading.Lock()
    killed = []  # (the test running or None, its timeout) when the watchdog killed the process

    def watchdog():
        while proc.poll() is None:
            with lock:
                if time.monotonic() - running["since"] > running["timeout"]:
                    killed.append((running["name"], running["timeout"]))
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
            time.sleep(0.2)

    def read_output():
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            r.output.append(line)
            # Searched, not matched at the line's start: a test's output without a newline may come before it.
            m = RUN.search(line)
            if m and m.group(1) in by_gtest:
                with lock:
                    running.update(name=by_gtest[m.group(1)][0], since=time.monotonic(),
                                   timeout=by_gtest[m.group(1)][1])
                continue
            m = END.match(line)
            if m and m.group(2) in by_gtest:
                name = by_gtest[m.group(2)][0]
                r.status[name] = {"OK": "Passed", "FAILED": "Failed", "SKIPPED": "Skipped"}[m.group(1)]
                if m.group(3):
                    r.ms[name] = int(m.group(3))
                with lock:
                    running.update(name=None, since=time.monotonic(), timeout=longest)

    dog = threading.Thread(target=watchdog, daemon=True)
    reader = threading.Thread(target=read_output, daemon=True)
    dog.start()
    reader.start()
    rc = proc.wait()
    # What the tests started and left behind (a worker of a killed test) goes with the process's session.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    reader.join(10)
    r.seconds = time.monotonic() - start
    if reader.is_alive():
        # A process it started outside its session keeps the output open: the group cannot be said to have ended.
        for name, _, _ in g["tests"]:
            r.status[name] = "Failed"
        r.note = f"exit {rc}, but a process it started kept its output open 10 s later"
    elif killed:
        name, timeout = killed[0]
        if name is None:
            for n, _, _ in g["tests"]:  # as ctest would time out each of them
                r.status[n] = "Timeout"
            r.note = f"the process ran {timeout:.0f} s outside any test (start-up, set-up or exit): it was killed"
        else:
            r.status[name] = "Timeout"
            r.note = f"{name} ran past its timeout ({timeout:.0f} s): the process was killed"
    elif not g["gtest"]:
        skipped = g["skip_rc"] is not None and rc == int(g["skip_rc"])
        r.status[g["tests"][0][0]] = "Passed" if rc == 0 else "Skipped" if skipped else "Failed"
        r.note = "" if rc == 0 else f"exit {rc}" + (" (skipped)" if skipped else "")
    elif rc != 0:
        died_in = running["name"]
        if died_in is not None and died_in not in r.status:
            r.status[died_in] = "Failed"
            r.note = f"the process ended (exit {rc}) in {died_in}"
        elif all(s in PASSED for s in r.status.values()) and len(r.status) == len(g["tests"]):
            # Every test passed but the process failed (a sanitizer's report at exit): the group fails.
            for name, _, _ in g["tests"]:
                r.status[name] = "Failed"
            r.note = f"the process exited {rc} after its tests"
        else:
            r.note = f"exit {rc}"
    for name, _, _ in g["tests"]:
        r.status.setdefault(name, "Not run")
    failed = [n for n, s in r.status.items() if s not in PASSED]
    label = g["tests"][0][0] if not g["gtest"] else \
        f"{os.path.basename(g['command'][0])} {g['tests'][0][1].split('.')[0]}" + \
        (f" [{' '.join(g['env'])}]" if g["env"] else "")
    with print_lock:
        print(f"{'FAILED' if failed else 'ok':6} {label}: {len(g['tests'])} tests, {r.seconds:.1f} s"
              + (f" ({r.note})" if r.note else ""), flush=True)
        if failed:
            for n in failed:
                print(f"    {r.status[n]}: {n}", flush=True)
            print("".join(r.output), flush=True)
    return r


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    build, args = args[0], args[1:]
    jobs = os.cpu_count() or 2
    if args[:1] == ["-j"]:
        jobs, args = int(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    tests = select(build, args)
    if not tests:
        print(f"ctest_by_suite: ctest selects no test in {build} with {args}", file=sys.stderr)
        return 1
    groups = group(tests)
    # The costliest groups first, so that the last ones to finish are short.
    groups.sort(key=lambda g: -g["cost"])
    print(f"ctest_by_suite: {len(tests)} tests in {len(groups)} processes, {jobs} at a time", flush=True)
    print_lock = threading.Lock()
    results = []
    pending = list(groups)
    pending_lock = threading.Condition()
    held = set()  # the RESOURCE_LOCKs of the groups running
    start = time.monotonic()

    def worker():
        while True:
            with pending_lock:
                while True:
                    if not pending:
                        return
                    free = [g for g in pending if not held.intersection(g["locks"])]
                    if free:
                        break
                    pending_lock.wait()
                g = free[0]
                pending.remove(g)
                held.update(g["locks"])
            try:
                r = run_group(g, print_lock)
            except Exception as e:  # the group's tests fail, naming why; the others still run
                r = Result()
                r.status = {n: "Failed" for n, _, _ in g["tests"]}
                with print_lock:
                    print(f"FAILED {[n for n, _, _ in g['tests']]}: could not be run: {e!r}", flush=True)
            finally:
                with pending_lock:
                    held.difference_update(g["locks"])
                    pending_lock.notify_all()
            with pending_lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = {t["name"]: "Not run" for t in tests}
    statuses.update((n, s) for r in results for n, s in r.status.items())
    failed = sorted(n for n, s in statuses.items() if s not in PASSED)
    passed = sum(1 for s in statuses.values() if s == "Passed")
    skipped = sum(1 for s in statuses.values() if s == "Skipped")
    slowest = sorted(((ms, n) for r in results for n, ms in r.ms.items()), reverse=True)[:10]
    print("slowest tests: " + ", ".join(f"{n} {ms / 1000:.1f} s" for ms, n in slowest))
    print(f"{passed} tests passed, {skipped} skipped, {len(failed)} failed out of {len(statuses)}; "
          f"{time.monotonic() - start:.0f} s")
    for n in failed:
        print(f"    {statuses[n]}: {n}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
