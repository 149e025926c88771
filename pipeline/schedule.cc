// Schedules by simulation: every idle worker picks its next action by the schedule's rule (see schedule.h).
#include "tandem/pipeline/schedule.h"

#include <algorithm>
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
  if (name == "custom") return Schedule::kCustom;
  throw_error(absl::InvalidArgumentError("unknown pipeline schedule '" + name +
                                         "' (known: gpipe, 1f1b, interleaved, looped_bfs, custom)"));
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
    case Schedule::kCustom:
      return "custom";
  }
  return "?";
}

std::string action_name(const Action& a) { return absl::StrCat(a.stage, a.backward ? "B" : "F", a.microbatch); }

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

// Completion times of every forward and backward; kNever until done.
struct Times {
  Times(int p, int m) : f(p, std::vector<double>(m, kNever)), b(p, std::vector<double>(m, kNever)) {}
  std::vector<std::vector<double>> f, b;
  // When the action's inputs are there (kNever if not yet known).
  double ready_at(const Action& a, int p) const {
    if (!a.backward) return a.stage == 0 ? 0 : f[a.stage - 1][a.microbatch];
    const double own = f[a.stage][a.microbatch];
    return a.stage == p - 1 ? own : std::max(own, b[a.stage + 1][a.microbatch]);
  }
  double& done(const Action& a) { return a.backward ? b[a.stage][a.microbatch] : f[a.stage][a.microbatch]; }
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
          fwd.push_back(Action{hosted[r][c], g * P + j, false});
          bwd.push_back(Action{hosted[r][v - 1 - c], g * P + j, true});
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
                                      const std::vector<double>& t_b) {
  const int p = static_cast<int>(stage_worker.size());
  if (t_f.size() != stage_worker.size() || t_b.size() != stage_worker.size()) {
    return absl::InvalidArgumentError("simulate: one forward and one backward cost per stage");
  }
  if (absl::Status s = check_placement(stage_worker, static_cast<int>(plans.size()), m); !s.ok()) return s;
  std::vector<std::vector<int>> seen(p, std::vector<int>(2 * m, 0));
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
      if (seen[a.stage][2 * a.microbatch + a.backward]++) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": planned twice"));
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    for (int c = 0; c < 2 * m; ++c) {
      if (seen[s][c] != 1) {
        return absl::InvalidArgumentError(absl::StrCat("action ", action_name(Action{s, c / 2, c % 2 == 1}),
                                                       " is in no plan (worker ", stage_worker[s], "'s)"));
      }
    }
  }
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
        const double end = std::max(ready, free_at[w]) + (a.backward ? t_b[a.stage] : t_f[a.stage]);
        times.done(a) = free_at[w] = end;
        makespan = std::max(makespan, end);
        ++next[w], progress = true;
      }
    }
  }
  for (size_t w = 0; w < plans.size(); ++w) {
    if (next[w] == plans[w].size()) continue;
    const Action& a = plans[w][next[w]];
    const Action needs = !a.backward                                ? Action{a.stage - 1, a.microbatch, false}
                         : times.f[a.stage][a.microbatch] == kNever ? Action{a.stage, a.microbatch, false}
                                                                    : Action{a.stage + 1, a.microbatch, true};
    return absl::InvalidArgumentError(absl::StrCat(
        "the plans deadlock: worker ", w, " waits forever at its action ", next[w], " (", action_name(a), ") for ",
        action_name(needs), ", which worker ", stage_worker[needs.stage], " plans after an action that cannot run"));
  }
  return makespan;
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
  if (schedule == Schedule::kLoopedBFS) {
    std::vector<std::vector<Action>> plans(n_workers);
    for (int w = 0; w < n_workers; ++w) {
      for (int s : hosted[w]) {
        for (int i = 0; i < m; ++i) plans[w].push_back(Action{s, i, false});
      }
      for (auto s = hosted[w].rbegin(); s != hosted[w].rend(); ++s) {
        for (int i = m - 1; i >= 0; --i) plans[w].push_back(Action{*s, i, true});
      }
    }
    return plans;
  }
  if (schedule == Schedule::kInterleaved1F1B) {
    auto plans = megatron_plans(hosted, m);
    // Checked by simulation: should this order ever deadlock (not seen; a safety net), the simulated order is used.
    if (!plans.empty() &&
        run_simulation(plans, stage_worker, m, std::vector<double>(p, t_f), std::vector<double>(p, t_b)).ok()) {
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
      case Schedule::kCustom:
        return false;  // made above
    }
    return false;
  };
  // Priority keys (smaller first).
  auto key = [&](const Action& a) {
    if (schedule == Schedule::kInterleaved1F1B) {
      const int c = a.backward ? v - 1 - chunk[a.stage] : chunk[a.stage];
      return std::make_tuple(a.microbatch / P, c, a.microbatch % P);
    }
    return std::make_tuple(a.microbatch, a.backward ? -a.stage : a.stage, 0);
  };
  auto choose = [&](int w, double t, bool relax, Action* out) {
    bool have_f = false, have_b = false;
    Action best_f, best_b;
    for (int s : hosted[w]) {
      for (int i = 0; i < m; ++i) {
        if (!started_f[s][i]) {
          Action a{s, i, false};
          if (times.ready_at(a, p) <= t && (relax || !capped(s)) && (!have_f || key(a) < key(best_f))) {
            best_f = a, have_f = true;
          }
        }
        if (!started_b[s][i]) {
          Action a{s, i, true};
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
        const double end = t + (a.backward ? t_b : t_f);
        free_at[w] = end;
        times.done(a) = end;
        (a.backward ? started_b : started_f)[a.stage][a.microbatch] = 1;
        const int d = a.backward ? -1 : 1;
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
                const std::vector<double>& t_f, const std::vector<double>& t_b) {
  absl::StatusOr<double> makespan = run_simulation(plans, stage_worker, m, t_f, t_b);
  throw_if_error(makespan.status());
  return *makespan;
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
      if (kind != absl::string_view::npos && kind > 0 && kind + 1 < cell.size() &&
          (cell[kind] == 'I' || cell[kind] == 'W')) {
        throw_error(absl::InvalidArgumentError(absl::StrCat(
            where,
            " is a zero-bubble action (I: input gradient, W: weight gradient); Tandem runs full backwards (B)")));
      }
      if (kind == absl::string_view::npos || kind == 0 || kind + 1 >= cell.size() ||
          (cell[kind] != 'F' && cell[kind] != 'B') || !absl::SimpleAtoi(cell.substr(0, kind), &stage) ||
          cell.substr(kind + 1).find_first_not_of("0123456789") != absl::string_view::npos ||
          !absl::SimpleAtoi(cell.substr(kind + 1), &microbatch)) {
        throw_error(absl::InvalidArgumentError(
            absl::StrCat(where, " is not an action (<stage>F<micro-batch> or <stage>B<micro-batch>, e.g. 1B3)")));
      }
      plan.push_back(Action{stage, microbatch, cell[kind] == 'B'});
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
