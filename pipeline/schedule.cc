// Schedules by simulation: every idle worker picks its next action by the schedule's rule (see schedule.h).
#include "tandem/pipeline/schedule.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tandem/rpc/errors.h"

namespace tandem::pipeline {

Schedule schedule_from_name(const std::string& name) {
  if (name == "gpipe") return Schedule::kGPipe;
  if (name == "1f1b") return Schedule::k1F1B;
  if (name == "interleaved") return Schedule::kInterleaved1F1B;
  if (name == "looped_bfs") return Schedule::kLoopedBFS;
  if (name == "zbh1") return Schedule::kZeroBubbleH1;
  if (name == "zbv") return Schedule::kZeroBubbleV;
  if (name == "custom") return Schedule::kCustom;
  throw_error(absl::InvalidArgumentError("unknown pipeline schedule '" + name +
                                         "' (known: gpipe, 1f1b, interleaved, looped_bfs, zbh1, zbv, custom)"));
}

std::string schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::kGPipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
    case Schedule::kInterleaved1F1B:
      return "interleaved";
    case Schedule::kLoopedBFS:
      return "looped_bfs";
    case Schedule::kZeroBubbleH1:
      return "zbh1";
    case Schedule::kZeroBubbleV:
      return "zbv";
    case Schedule::kCustom:
      return "custom";
  }
  return "?";
}

namespace {
constexpr char kLetters[] = "FBIWR";     // by Kind
constexpr char kPlanLetters[] = "FBIW";  // the kinds a plan holds
bool sends_gradient(Kind k) { return k == Kind::kBackward || k == Kind::kInput; }
}  // namespace

std::string action_name(const Action& a) {
  return absl::StrCat(a.stage, std::string(1, kLetters[static_cast<int>(a.kind)]), a.microbatch);
}

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

absl::Status check_placement(const std::vector<int>& stage_worker, int n_workers, int m) {
  if (stage_worker.empty()) return absl::InvalidArgumentError("a pipeline needs at least one stage");
  if (m < 1) {
    return absl::InvalidArgumentError(absl::StrCat("a pipeline step needs at least one micro-batch (got ", m, ")"));
  }
  for (size_t s = 0; s < stage_worker.size(); ++s) {
    if (stage_worker[s] < 0 || stage_worker[s] >= n_workers) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s, " is placed on worker index ", stage_worker[s], " outside 0..", n_workers - 1));
    }
  }
  return absl::OkStatus();
}

// Completion times of every forward, input gradient (B or I) and W; kNever until done.
struct Times {
  Times(int p, int m)
      : f(p, std::vector<double>(m, kNever)),
        g(p, std::vector<double>(m, kNever)),
        w(p, std::vector<double>(m, kNever)) {}
  std::vector<std::vector<double>> f, g, w;
  // When the action's inputs are there (kNever if not yet known).
  double ready_at(const Action& a, int p) const {
    switch (a.kind) {
      case Kind::kForward:
        return a.stage == 0 ? 0 : f[a.stage - 1][a.microbatch];
      case Kind::kWeight:
        return g[a.stage][a.microbatch];
      default: {
        const double own = f[a.stage][a.microbatch];
        return a.stage == p - 1 ? own : std::max(own, g[a.stage + 1][a.microbatch]);
      }
    }
  }
  void set_done(const Action& a, double t) {
    if (a.kind == Kind::kForward) f[a.stage][a.microbatch] = t;
    if (sends_gradient(a.kind)) g[a.stage][a.microbatch] = t;
    if (a.kind == Kind::kBackward || a.kind == Kind::kWeight) w[a.stage][a.microbatch] = t;
  }
};

// Megatron's interleaved order (arXiv 2104.04473) when every worker holds the same number v of stages: forwards in
// groups of P micro-batches, chunk by chunk; backwards likewise, deepest chunk first; 2 (P - r - 1) + (v - 1) P
// warm-up forwards on worker r, then one forward and one backward alternately. Empty when the placement is uneven.
std::vector<std::vector<Action>> megatron_plans(const std::vector<std::vector<int>>& hosted, int m) {
  const int P = static_cast<int>(hosted.size()), v = static_cast<int>(hosted[0].size());
  for (const auto& h : hosted) {
    if (static_cast<int>(h.size()) != v) return {};
  }
  std::vector<std::vector<Action>> plans(P);
  for (int r = 0; r < P; ++r) {
    std::vector<Action> fwd, bwd;
    for (int g = 0; g * P < m; ++g) {
      for (int c = 0; c < v; ++c) {
        for (int j = 0; j < P && g * P + j < m; ++j) {
          fwd.push_back(Action{hosted[r][c], g * P + j, Kind::kForward});
          bwd.push_back(Action{hosted[r][v - 1 - c], g * P + j, Kind::kBackward});
        }
      }
    }
    const size_t warmup = std::min(fwd.size(), static_cast<size_t>(2 * (P - r - 1) + (v - 1) * P));
    size_t f = 0, b = 0;
    while (f < warmup) plans[r].push_back(fwd[f++]);
    while (f < fwd.size()) plans[r].push_back(fwd[f++]), plans[r].push_back(bwd[b++]);
    while (b < bwd.size()) plans[r].push_back(bwd[b++]);
  }
  return plans;
}

// simulate() without exceptions: INVALID_ARGUMENT when the costs, the placement or the plans are wrong (an action
// missing, planned twice or on the wrong worker, or an order that deadlocks).
absl::StatusOr<double> run_simulation(const std::vector<std::vector<Action>>& plans,
                                      const std::vector<int>& stage_worker, int m, const std::vector<double>& t_f,
                                      const std::vector<double>& t_b, const std::vector<double>& t_w) {
  const int p = static_cast<int>(stage_worker.size());
  if (t_f.size() != stage_worker.size() || t_b.size() != stage_worker.size() ||
      (!t_w.empty() && t_w.size() != stage_worker.size())) {
    return absl::InvalidArgumentError("simulate: one forward, one backward (and one W) cost per stage");
  }
  if (absl::Status s = check_placement(stage_worker, static_cast<int>(plans.size()), m); !s.ok()) return s;
  // seen[s][4 i + kind]: how often each action is planned.
  std::vector<std::vector<int>> seen(p, std::vector<int>(4 * m, 0));
  for (size_t w = 0; w < plans.size(); ++w) {
    for (size_t i = 0; i < plans[w].size(); ++i) {
      const Action& a = plans[w][i];
      const std::string what = absl::StrCat("action ", i, " of worker ", w, " (", action_name(a), ")");
      if (a.stage < 0 || a.stage >= p) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": there is no stage ", a.stage, " (", p, " stages)"));
      }
      if (a.microbatch < 0 || a.microbatch >= m) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": there is no micro-batch ", a.microbatch, " (", m, " micro-batches)"));
      }
      if (stage_worker[a.stage] != static_cast<int>(w)) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": stage ", a.stage, " is placed on worker ", stage_worker[a.stage]));
      }
      if (a.kind == Kind::kReduce) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": a sum across replicas is not an action of a plan"));
      }
      if (seen[a.stage][4 * a.microbatch + static_cast<int>(a.kind)]++) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": planned twice"));
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    for (int i = 0; i < m; ++i) {
      const int* k = &seen[s][4 * i];
      auto name = [&](Kind kind) { return action_name(Action{s, i, kind}); };
      auto missing = [&](const std::string& what, const char* why) {
        return absl::InvalidArgumentError(
            absl::StrCat("action ", what, " is in no plan (worker ", stage_worker[s], "'s)", why));
      };
      if (!k[0]) return missing(name(Kind::kForward), "");
      if (k[1] && (k[2] || k[3])) {
        return absl::InvalidArgumentError(absl::StrCat("micro-batch ", i, " of stage ", s, " has a full backward (",
                                                       name(Kind::kBackward), ") and a split one (I or W) in worker ",
                                                       stage_worker[s], "'s plan: one or the other"));
      }
      if (!k[1] && !k[2] && !k[3]) {
        return missing(absl::StrCat(name(Kind::kBackward), " (or its halves ", name(Kind::kInput), " and ",
                                    name(Kind::kWeight), ")"),
                       "");
      }
      if (k[2] && !k[3]) return missing(name(Kind::kWeight), ": a split backward needs its W after its I");
      if (k[3] && !k[2]) return missing(name(Kind::kInput), ": a split backward needs its I before its W");
    }
  }
  auto cost = [&](const Action& a) {
    const double w = t_w.empty() ? t_b[a.stage] / 2 : t_w[a.stage];
    switch (a.kind) {
      case Kind::kForward:
        return t_f[a.stage];
      case Kind::kBackward:
        return t_b[a.stage];
      case Kind::kInput:
        return t_b[a.stage] - w;
      case Kind::kWeight:
        return w;
      case Kind::kReduce:  // refused above
        break;
    }
    return 0.0;
  };
  Times times(p, m);
  std::vector<size_t> next(plans.size(), 0);
  std::vector<double> free_at(plans.size(), 0);
  double makespan = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t w = 0; w < plans.size(); ++w) {
      while (next[w] < plans[w].size()) {
        const Action& a = plans[w][next[w]];
        const double ready = times.ready_at(a, p);
        if (ready == kNever) break;
        const double end = std::max(ready, free_at[w]) + cost(a);
        times.set_done(a, end);
        free_at[w] = end;
        makespan = std::max(makespan, end);
        ++next[w], progress = true;
      }
    }
  }
  for (size_t w = 0; w < plans.size(); ++w) {
    if (next[w] == plans[w].size()) continue;
    const Action& a = plans[w][next[w]];
    Action needs;
    if (a.kind == Kind::kForward) {
      needs = Action{a.stage - 1, a.microbatch, Kind::kForward};
    } else if (a.kind == Kind::kWeight) {
      needs = Action{a.stage, a.microbatch, Kind::kInput};
    } else if (times.f[a.stage][a.microbatch] == kNever) {
      needs = Action{a.stage, a.microbatch, Kind::kForward};
    } else {
      const bool split = seen[a.stage + 1][4 * a.microbatch + static_cast<int>(Kind::kInput)] > 0;
      needs = Action{a.stage + 1, a.microbatch, split ? Kind::kInput : Kind::kBackward};
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "the plans deadlock: worker ", w, " waits forever at its action ", next[w], " (", action_name(a), ") for ",
        action_name(needs), ", which worker ", stage_worker[needs.stage], " plans after an action that cannot run"));
  }
  return makespan;
}

// ZB-H1 (schedule.h) on one stage per worker: worker r runs p - 1 - r warm-up forwards, then a forward and an I
// alternately, each I followed by the W of the micro-batch r behind it once there is one, then the remaining Is (each
// followed by its W as before) and the remaining Ws. PyTorch's ScheduleInterleavedZeroBubble makes the same order
// with one stage per worker.
std::vector<std::vector<Action>> zero_bubble_h1_plans(int p, int m) {
  std::vector<std::vector<Action>> plans(p);
  for (int r = 0; r < p; ++r) {
    std::vector<Action>& plan = plans[r];
    int f = 0, i = 0, w = 0;
    auto input_then_weight = [&] {
      plan.push_back(Action{r, i++, Kind::kInput});
      if (i > r) plan.push_back(Action{r, w++, Kind::kWeight});
    };
    while (f < std::min(p - 1 - r, m)) plan.push_back(Action{r, f++, Kind::kForward});
    while (f < m) {
      plan.push_back(Action{r, f++, Kind::kForward});
      input_then_weight();
    }
    while (i < m) input_then_weight();
    while (w < m) plan.push_back(Action{r, w++, Kind::kWeight});
  }
  return plans;
}

// ZBV (schedule.h) on P workers, stages r and 2P - 1 - r on worker r (chunks a and b), PyTorch's
// ScheduleZBVZeroBubble order: with n = max(m, 2P - 1) micro-batches, 2 (P - r) - 1 forwards of a; r times F of b
// and F of a; P - r times F, I, W of b; then, while a forward is left, F, I, W of a and F, I, W of b; r times I of
// a and I of b; P - r times I of a with the next W of a; the remaining Ws of b, then of a. The actions of
// micro-batches from m on are dropped. Under F = I = W = 1 per stage its makespan is 6m + P - 1 once m >= 2P - 1
// (checked by simulation in the tests; from about 1.5 P on), the work 6m on every worker; a worker holds at most 2P
// stage activations, which are P of a stage twice the size: 1F1B's stage 0 on the same model and workers.
std::vector<std::vector<Action>> zero_bubble_v_plans(int P, int m) {
  const int n = std::max(m, 2 * P - 1);
  std::vector<std::vector<Action>> plans(P);
  for (int r = 0; r < P; ++r) {
    const int a = r, b = 2 * P - 1 - r;
    int f0 = 0, f1 = 0, i0 = 0, i1 = 0;
    std::vector<Action> ops;
    auto add = [&](int stage, int& counter, Kind kind) { ops.push_back(Action{stage, counter++, kind}); };
    for (int k = 0; k < 2 * (P - r) - 1; ++k) add(a, f0, Kind::kForward);
    for (int k = 0; k < r; ++k) add(b, f1, Kind::kForward), add(a, f0, Kind::kForward);
    for (int k = 0; k < P - r; ++k) {
      add(b, f1, Kind::kForward);
      ops.push_back(Action{b, i1, Kind::kInput}), add(b, i1, Kind::kWeight);
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) add(a, f0, Kind::kForward);
      ops.push_back(Action{a, i0, Kind::kInput}), add(a, i0, Kind::kWeight);
      add(b, f1, Kind::kForward);
      ops.push_back(Action{b, i1, Kind::kInput}), add(b, i1, Kind::kWeight);
    }
    int w0 = i0, w1 = i1;
    for (int k = 0; k < r; ++k) add(a, i0, Kind::kInput), add(b, i1, Kind::kInput);
    for (int k = 0; k < P - r; ++k) add(a, i0, Kind::kInput), add(a, w0, Kind::kWeight);
    while (w1 < i1) add(b, w1, Kind::kWeight);
    while (w0 < i0) add(a, w0, Kind::kWeight);
    for (const Action& x : ops) {
      if (x.microbatch < m) plans[r].push_back(x);
    }
  }
  return plans;
}

}  // namespace

std::vector<std::vector<Action>> make_plans(Schedule schedule, const std::vector<int>& stage_worker, int n_workers,
                                            int m) {
  throw_if_error(check_placement(stage_worker, n_workers, m));
  const int p = static_cast<int>(stage_worker.size());
  const double t_f = 1, t_b = 2;
  std::vector<std::vector<int>> hosted(n_workers);
  std::vector<int> chunk(p);  // the stage's position among its worker's stages
  for (int s = 0; s < p; ++s) {
    chunk[s] = static_cast<int>(hosted[stage_worker[s]].size());
    hosted[stage_worker[s]].push_back(s);
  }
  int v = 1;
  for (const auto& h : hosted) v = std::max(v, static_cast<int>(h.size()));
  const int P = n_workers;
  if (schedule == Schedule::kCustom) {
    throw_error(absl::InvalidArgumentError("a custom schedule's plans are the user's (PipelineOptions::plans)"));
  }
  if (schedule == Schedule::kZeroBubbleH1) {
    for (int s = 0; s < p; ++s) {
      if (stage_worker[s] != s || n_workers != p) {
        throw_error(absl::InvalidArgumentError(absl::StrCat("zbh1 runs one stage per worker, stage s on worker s (", p,
                                                            " stages on ", n_workers, " workers)")));
      }
    }
    return zero_bubble_h1_plans(p, m);
  }
  if (schedule == Schedule::kZeroBubbleV) {
    for (int s = 0; s < p; ++s) {
      if (p != 2 * n_workers || stage_worker[s] != (s < n_workers ? s : p - 1 - s)) {
        throw_error(absl::InvalidArgumentError(
            absl::StrCat("zbv runs two stages per worker in a V: 2P stages on P workers, stage s on worker s and "
                         "stage 2P - 1 - s on worker s (",
                         p, " stages on ", n_workers, " workers, stage ", s, " on worker ", stage_worker[s], ")")));
      }
    }
    return zero_bubble_v_plans(n_workers, m);
  }
  if (schedule == Schedule::kLoopedBFS) {
    std::vector<std::vector<Action>> plans(n_workers);
    for (int w = 0; w < n_workers; ++w) {
      for (int s : hosted[w]) {
        for (int i = 0; i < m; ++i) plans[w].push_back(Action{s, i, Kind::kForward});
      }
      for (auto s = hosted[w].rbegin(); s != hosted[w].rend(); ++s) {
        for (int i = m - 1; i >= 0; --i) plans[w].push_back(Action{*s, i, Kind::kBackward});
      }
    }
    return plans;
  }
  if (schedule == Schedule::kInterleaved1F1B) {
    auto plans = megatron_plans(hosted, m);
    // Checked by simulation: should this order ever deadlock (not seen; a safety net), the simulated order is used.
    if (!plans.empty() &&
        run_simulation(plans, stage_worker, m, std::vector<double>(p, t_f), std::vector<double>(p, t_b), {}).ok()) {
      return plans;
    }
  }

  Times times(p, m);
  std::vector<std::vector<char>> started_f(p, std::vector<char>(m, 0)), started_b(p, std::vector<char>(m, 0));
  std::vector<int> live_stage(p, 0), live_worker(n_workers, 0);
  auto capped = [&](int s) {
    const int w = stage_worker[s];
    switch (schedule) {
      case Schedule::kGPipe:
        return false;
      case Schedule::k1F1B:
        return live_stage[s] >= p - s;
      case Schedule::kInterleaved1F1B:
        return live_worker[w] >= 2 * (P - w - 1) + (v - 1) * P + 1;
      case Schedule::kLoopedBFS:
      case Schedule::kZeroBubbleH1:
      case Schedule::kZeroBubbleV:
      case Schedule::kCustom:
        return false;  // made above
    }
    return false;
  };
  // Priority keys (smaller first).
  auto key = [&](const Action& a) {
    if (schedule == Schedule::kInterleaved1F1B) {
      const int c = a.kind == Kind::kBackward ? v - 1 - chunk[a.stage] : chunk[a.stage];
      return std::make_tuple(a.microbatch / P, c, a.microbatch % P);
    }
    return std::make_tuple(a.microbatch, a.kind == Kind::kBackward ? -a.stage : a.stage, 0);
  };
  auto choose = [&](int w, double t, bool relax, Action* out) {
    bool have_f = false, have_b = false;
    Action best_f, best_b;
    for (int s : hosted[w]) {
      for (int i = 0; i < m; ++i) {
        if (!started_f[s][i]) {
          Action a{s, i, Kind::kForward};
          if (times.ready_at(a, p) <= t && (relax || !capped(s)) && (!have_f || key(a) < key(best_f))) {
            best_f = a, have_f = true;
          }
        }
        if (!started_b[s][i]) {
          Action a{s, i, Kind::kBackward};
          if (times.ready_at(a, p) <= t && (!have_b || key(a) < key(best_b))) best_b = a, have_b = true;
        }
      }
    }
    const bool prefer_f = schedule == Schedule::kGPipe;
    if (have_f && (prefer_f || !have_b)) return *out = best_f, true;
    if (have_b) return *out = best_b, true;
    return false;
  };

  std::vector<std::vector<Action>> plans(n_workers);
  std::vector<double> free_at(n_workers, 0);
  int remaining = 2 * p * m;
  double t = 0;
  while (remaining > 0) {
    bool started = false;
    for (int relax = 0; relax < 2 && !started; ++relax) {
      for (int w = 0; w < n_workers; ++w) {
        Action a;
        if (free_at[w] > t || !choose(w, t, relax != 0, &a)) continue;
        plans[w].push_back(a);
        const bool backward = a.kind == Kind::kBackward;
        const double end = t + (backward ? t_b : t_f);
        free_at[w] = end;
        times.set_done(a, end);
        (backward ? started_b : started_f)[a.stage][a.microbatch] = 1;
        const int d = backward ? -1 : 1;
        live_stage[a.stage] += d;
        live_worker[stage_worker[a.stage]] += d;
        --remaining, started = true;
      }
      // Relaxing the caps is only for a state where nothing runs and nothing may start (never seen; a safety net).
      bool busy = false;
      for (double f : free_at) busy |= f > t;
      if (busy) break;
    }
    double next = kNever;
    for (double f : free_at) {
      if (f > t) next = std::min(next, f);
    }
    if (next == kNever) {
      if (remaining > 0 && !started) throw_error(absl::InternalError("pipeline schedule simulation made no progress"));
      continue;
    }
    t = next;
  }
  return plans;
}

double simulate(const std::vector<std::vector<Action>>& plans, const std::vector<int>& stage_worker, int m, double t_f,
                double t_b) {
  return simulate(plans, stage_worker, m, std::vector<double>(stage_worker.size(), t_f),
                  std::vector<double>(stage_worker.size(), t_b));
}

double simulate(const std::vector<std::vector<Action>>& plans, const std::vector<int>& stage_worker, int m,
                const std::vector<double>& t_f, const std::vector<double>& t_b, const std::vector<double>& t_w) {
  absl::StatusOr<double> makespan = run_simulation(plans, stage_worker, m, t_f, t_b, t_w);
  throw_if_error(makespan.status());
  return *makespan;
}

std::vector<int> peak_in_flight(const std::vector<std::vector<Action>>& plans, int n_stages) {
  std::vector<int> live(n_stages, 0), peak(n_stages, 0);
  for (const auto& plan : plans) {
    for (const Action& a : plan) {
      if (a.stage < 0 || a.stage >= n_stages) continue;
      if (a.kind == Kind::kForward) peak[a.stage] = std::max(peak[a.stage], ++live[a.stage]);
      if (a.kind == Kind::kBackward || a.kind == Kind::kWeight) --live[a.stage];
    }
  }
  return peak;
}

std::vector<std::vector<Action>> parse_plans_csv(const std::string& text) {
  std::vector<std::vector<Action>> plans;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty() && line.front() == '#') continue;
    std::vector<Action>& plan = plans.emplace_back();
    int cell_no = 0;
    for (absl::string_view cell : absl::StrSplit(line, ',')) {
      ++cell_no;
      cell = absl::StripAsciiWhitespace(cell);
      if (cell.empty()) continue;
      const std::string where = absl::StrCat("plan line ", line_no, ", cell ", cell_no, ": '", cell, "'");
      const size_t kind = cell.find_first_not_of("0123456789");
      int stage = -1, microbatch = -1;
      const char* letter = kind == absl::string_view::npos ? nullptr : std::strchr(kPlanLetters, cell[kind]);
      if (kind == absl::string_view::npos || kind == 0 || kind + 1 >= cell.size() || letter == nullptr ||
          cell[kind] == '\0' || !absl::SimpleAtoi(cell.substr(0, kind), &stage) ||
          cell.substr(kind + 1).find_first_not_of("0123456789") != absl::string_view::npos ||
          !absl::SimpleAtoi(cell.substr(kind + 1), &microbatch)) {
        throw_error(absl::InvalidArgumentError(absl::StrCat(
            where,
            " is not an action (<stage><F|B|I|W><micro-batch>, e.g. 1B3; B a full backward, I and W its halves)")));
      }
      plan.push_back(Action{stage, microbatch, static_cast<Kind>(letter - kPlanLetters)});
    }
  }
  while (!plans.empty() && plans.back().empty()) plans.pop_back();  // trailing newlines
  return plans;
}

std::string plans_csv(const std::vector<std::vector<Action>>& plans) {
  std::string out;
  for (const auto& plan : plans) {
    absl::StrAppend(&out, absl::StrJoin(plan, ",", [](std::string* o, const Action& a) { o->append(action_name(a)); }),
                    "\n");
  }
  return out;
}

}  // namespace tandem::pipeline
