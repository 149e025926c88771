// Pipeline schedules: which forward (F) and backward (B) of which micro-batch each worker runs, in which order.
//
// A schedule is computed once per step on the driver and sent to every worker as its plan; a worker then runs its
// actions in that order, waiting only for the activations and gradients its actions need (no round trip to the
// driver per action). The orders come from a simulation with unit costs (a forward 1, a backward 2) in which every
// idle worker picks its next action by the schedule's rule:
//   GPipe             every forward before any backward (a stage keeps all m micro-batches' activations);
//   1F1B              a backward whenever one is ready, a forward only while the stage has fewer than p - s
//                     micro-batches in flight (stage s of p; stage 0 keeps at most p, not m);
//   Interleaved1F1B   several stages per worker (stage k on worker k mod P, v per worker): Megatron's order, forwards
//                     in groups of P micro-batches chunk by chunk, 2 (P - r - 1) + (v - 1) P warm-up forwards on
//                     worker r, then one forward and one backward alternately (checked by simulation). With an
//                     uneven placement, the simulation's rule instead: backwards first when ready, forwards in
//                     Megatron's order while fewer than 2 (P - r - 1) + (v - 1) P + 1 are in flight on worker r.
//   LoopedBFS         several stages per worker (PyTorch's ScheduleLoopedBFS): every forward of the worker's first
//                     stage, then of its next, ...; then the backwards, deepest stage first, last micro-batch first.
//                     Keeps all m micro-batches' activations, as GPipe does, and switches stages least often.
//   Custom            the plans a user gives (PipelineOptions::plans, in code or from parse_plans_csv), checked by
//                     simulate() before the step runs.
// Because each worker's order is the order of one valid execution, no assignment of real costs can deadlock it. Any
// m >= 1 works, also fewer micro-batches than stages.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem::pipeline {

enum class Schedule { kGPipe, k1F1B, kInterleaved1F1B, kLoopedBFS, kCustom };

// "gpipe", "1f1b", "interleaved", "looped_bfs", "custom" (and back). Throws tandem::Error (INVALID_ARGUMENT) for
// another name.
Schedule schedule_from_name(const std::string& name);
std::string schedule_name(Schedule schedule);

struct Action {
  int stage = 0;
  int microbatch = 0;
  bool backward = false;
  bool operator==(const Action& o) const {
    return stage == o.stage && microbatch == o.microbatch && backward == o.backward;
  }
};

// An action as PyTorch's pipelining writes it: "<stage>F<micro-batch>" or "<stage>B<micro-batch>" ("1B3").
std::string action_name(const Action& a);

// The plan of every worker: plans[w] lists, in order, the actions of the stages placed on worker w
// (stage_worker[s] = w, workers numbered 0..n_workers-1). Throws tandem::Error (INVALID_ARGUMENT) for m < 1, no
// stages, a placement that names a worker outside 0..n_workers-1, or kCustom (its plans are the user's).
std::vector<std::vector<Action>> make_plans(Schedule schedule, const std::vector<int>& stage_worker, int n_workers,
                                            int n_microbatches);

// The makespan of `plans` when every forward takes t_f and every backward t_b and messages are free; also checks that
// the plans cover every action once and respect the dependencies, else throws tandem::Error (INVALID_ARGUMENT) naming
// the first bad action: one of a stage on another worker or of none, a micro-batch out of range, an action planned
// twice or in no plan, or the action where a worker would wait forever (the plans deadlock).
double simulate(const std::vector<std::vector<Action>>& plans, const std::vector<int>& stage_worker, int n_microbatches,
                double t_f, double t_b);
// The same with a cost per stage (t_f[s], t_b[s]).
double simulate(const std::vector<std::vector<Action>>& plans, const std::vector<int>& stage_worker, int n_microbatches,
                const std::vector<double>& t_f, const std::vector<double>& t_b);

// Plans from CSV text, the form PyTorch's _PipelineScheduleRuntime loads: line w is worker w's plan, its cells
// actions ("0F0,0F1,0B0,0B1"; blanks around cells and empty cells are ignored, as are lines starting with '#').
// Throws tandem::Error (INVALID_ARGUMENT) naming the line and cell of the first cell that is not an action; the
// zero-bubble actions I (input gradient) and W (weight gradient) are refused: Tandem runs full backwards (B). Check the
// result with simulate() (the pipeline does before it runs custom plans).
std::vector<std::vector<Action>> parse_plans_csv(const std::string& text);
// The reverse: one line per worker (a built-in schedule's plans, to start a custom one from).
std::string plans_csv(const std::vector<std::vector<Action>>& plans);

}  // namespace tandem::pipeline
