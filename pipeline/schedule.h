// Pipeline schedules: which forward (F) and backward (B, or its halves I and W) of which micro-batch each worker runs,
// in which order.
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
//   ZeroBubbleH1      the zero-bubble schedule of Qi et al. (ICLR 2024) with 1F1B's memory: each backward split into
//                     I (the input's gradient, which the previous stage waits for) and W (the weights' gradients,
//                     deferred into what would be bubbles). Worker r: p - 1 - r warm-up forwards, then F and I
//                     alternately, each I followed by the W of the micro-batch r behind it, then the remaining Is
//                     and Ws. Makespan 3m + p - 1 under F = I = W = 1 (m >= p), 1F1B's 3m + 3 (p - 1); a stage
//                     holds at most p micro-batches (1F1B's stage 0 does).
//   ZeroBubbleV       two stages per worker in a V (worker r holds stages r and 2P - 1 - r: the last stage is on
//                     worker 0, which computes the loss where the first forward began), split backwards, in
//                     PyTorch's ScheduleZBVZeroBubble order (schedule.cc). Makespan 6m + P - 1 under F = I = W = 1
//                     per stage once m >= 2P - 1: a bubble of (P - 1) / 6m of the work, half of ZB-H1's on the same
//                     model and workers; a worker holds what 1F1B's stage 0 holds (2P half-size stages' activations).
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

enum class Schedule { kGPipe, k1F1B, kInterleaved1F1B, kLoopedBFS, kZeroBubbleH1, kZeroBubbleV, kCustom };

// "gpipe", "1f1b", "interleaved", "looped_bfs", "zbh1", "zbv", "custom" (and back). Throws tandem::Error
// (INVALID_ARGUMENT) for another name.
Schedule schedule_from_name(const std::string& name);
std::string schedule_name(Schedule schedule);

// What an action computes: a forward (F), a full backward (B), or the two halves of a split backward: the input's
// gradient (I, what the previous stage waits for) and the weights' gradients (W, which waits only for its own I).
// kReduce is never in a plan: in a timeline, a replicated stage's sum of its gradients across the replicas (from its
// start to its end, while the rest of the plan runs).
enum class Kind : int8_t { kForward, kBackward, kInput, kWeight, kReduce };

struct Action {
  int stage = 0;
  int microbatch = 0;
  Kind kind = Kind::kForward;
  bool operator==(const Action& o) const { return stage == o.stage && microbatch == o.microbatch && kind == o.kind; }
};

// An action as PyTorch's pipelining writes it: "<stage><F|B|I|W><micro-batch>" ("1B3", "0I2").
std::string action_name(const Action& a);

// The plan of every worker: plans[w] lists, in order, the actions of the stages placed on worker w
// (stage_worker[s] = w, workers numbered 0..n_workers-1). Throws tandem::Error (INVALID_ARGUMENT) for m < 1, no
// stages, a placement that names a worker outside 0..n_workers-1, or kCustom (its plans are the user's).
std::vector<std::vector<Action>> make_plans(Schedule schedule, const std::vector<int>& stage_worker, int n_workers,
                                            int n_microbatches);

// The makespan of `plans` when every forward takes t_f, every full backward t_b, and of a split backward its W t_w
// and its I t_b - t_w (t_w = t_b / 2 when not given: the paper's F = B = W with t_f = 1, t_b = 2), messages free;
// also checks that the plans cover every action once and respect the dependencies, else throws tandem::Error
// (INVALID_ARGUMENT) naming the first bad action: one of a stage on another worker or of none, a micro-batch out of
// range, an action planned twice or in no plan (each micro-batch of each stage has F, and B or both I and W), or the
// action where a worker would wait forever (the plans deadlock).
double simulate(const std::vector<std::vector<Action>>& plans, const std::vector<int>& stage_worker, int n_microbatches,
                double t_f, double t_b);
// The same with costs per stage (t_f[s], t_b[s], t_w[s]; t_w empty: half of t_b).
double simulate(const std::vector<std::vector<Action>>& plans, const std::vector<int>& stage_worker, int n_microbatches,
                const std::vector<double>& t_f, const std::vector<double>& t_b, const std::vector<double>& t_w = {});

// The most micro-batches whose activations a stage holds at once when its worker runs `plans` in order: from a
// forward to its backward (B), or to its W (a split backward keeps the graph until then). Per stage.
std::vector<int> peak_in_flight(const std::vector<std::vector<Action>>& plans, int n_stages);

// Plans from CSV text, the form PyTorch's _PipelineScheduleRuntime loads: line w is worker w's plan, its cells
// actions ("0F0,0F1,0I0,0W0,0B1"; blanks around cells and empty cells are ignored, as are lines starting with '#').
// Throws tandem::Error (INVALID_ARGUMENT) naming the line and cell of the first cell that is not an action. Check the
// result with simulate() (the pipeline does before it runs custom plans).
std::vector<std::vector<Action>> parse_plans_csv(const std::string& text);
// The reverse: one line per worker (a built-in schedule's plans, to start a custom one from).
std::string plans_csv(const std::vector<std::vector<Action>>& plans);

}  // namespace tandem::pipeline
