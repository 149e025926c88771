// Checkpoints: what a training script needs to resume after a restart, written so that a crash never leaves a
// checkpoint that loads.
//
//   checkpoint::State state;
//   int64_t step = 0, epoch = 0;
//   state.add("model", *model).add("optimizer", optimizer).add("sampler", sampler).add("step", step).add("epoch",
//   epoch); checkpoint::Checkpointer ckpt(dir, rank); if (auto resumed = ckpt.restore(state, group.get())) { ... carry
//   on from step+1 ... }   // else a fresh start
//   ... every N steps: ckpt.save(step, state);
//
// Layout: <dir>/step-<N>/rank-<r>.ckpt, one file per rank and step (the directory may be shared by all ranks or be
// each node's own). A file is written aside (<name>.tmp.<pid>), flushed to disk, renamed over its name and its
// directory flushed, so it exists whole or not at all; its header carries its length and a CRC-32 of its contents,
// so a file damaged afterwards is recognised too. A torn or missing file makes restore() fall back to the newest step
// that every rank has intact; after each save a rank removes its own files older than the newest `keep` steps.
//
// Items are saved by name. Modules save their parameters and buffers by their own names, and loading checks that every
// one is present with the same shape and dtype; LibTorch optimizers and Tandem's sampler save their own state;
// a ZeroRedundancyOptimizer saves this rank's shard (a sharded checkpoint: it resumes with the same world size) or,
// consolidated, every rank's (it resumes with any world size);
// counters and tensors are saved as they are; any other state (a RemoteModule, a parameter server's optimizer)
// through a pair of functions of LibTorch archives.
//
// Thread-safety: a State or Checkpointer is used by one thread at a time; the objects a State refers to must not change
// during save() or restore(). Errors: tandem::Error — INVALID_ARGUMENT (a bad item name; an item missing from the
// checkpoint, or of another shape or dtype: the message names the item and the file), DATA_LOSS (load() of a file that
// is torn or damaged), UNAVAILABLE (an I/O error, naming the path and the system's reason), FAILED_PRECONDITION (a
// sharded optimizer state written by a job of another world size; restore() when some ranks of the group have steps
// and others none they share); restore() is collective over the group and fails
// as its collectives do (docs/errors.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize
namespace tandem::comm {
class ProcessGroup;
}
namespace tandem::ddp {
class DistributedSampler;
class ZeroRedundancyOptimizer;
}  // namespace tandem::ddp
namespace tandem::fsdp {
class FullyShardedDataParallel;
}

namespace tandem::checkpoint {

// What to save and restore, by name (letters, digits, '_' and '-'; unique). The objects are referred to, not
// copied: they must outlive the State.
class State {
 public:
  using Save = std::function<void(torch::serialize::OutputArchive&)>;
  using Load = std::function<void(torch::serialize::InputArchive&)>;

  State();
  ~State();
  State(State&&) noexcept;
  State& operator=(State&&) noexcept;

  State& add(const std::string& name, torch::nn::Module& module);           // parameters and buffers
  State& add(const std::string& name, torch::optim::Optimizer& optimizer);  // LibTorch's own state of it
  // A ZeroRedundancyOptimizer's state: this rank's shard (kSharded: resumes with the same world size), or every
  // rank's gathered (kConsolidated: resumes with any world size, with Layout::kReplicated; save() is then collective).
  enum class Zero { kSharded, kConsolidated };
  State& add(const std::string& name, ddp::ZeroRedundancyOptimizer& zero, Zero how = Zero::kSharded);
  // A fully sharded model (fsdp/fsdp.h). kSharded: this rank's part of each parameter, with its offset (save and load
  // are not collective, nothing is gathered; the job resuming must have the saving job's world size, with
  // Layout::kPerRank — or consolidate_fsdp() the files). kFull: every parameter gathered and every buffer, in the
  // format of add(name, Module&), so that a plain Sequential of the same architecture loads it and this loads a plain
  // module's (save() is collective; with Layout::kReplicated a job of any world size resumes from rank 0's file).
  enum class Fsdp { kSharded, kFull };
  State& add(const std::string& name, fsdp::FullyShardedDataParallel& model, Fsdp how = Fsdp::kSharded);
  // The optimizer of a fully sharded model's shards, gathered (FullyShardedDataParallel::full_optimizer_state_dict:
  // Adam, AdamW, SGD): save() is collective; with Layout::kReplicated a job of any world size resumes from rank 0's
  // file, beside the model added with Fsdp::kFull. (add(name, optimizer) alone keeps this rank's shard's state.)
  State& add(const std::string& name, torch::optim::Optimizer& optimizer, fsdp::FullyShardedDataParallel& model);
  State& add(const std::string& name, ddp::DistributedSampler& sampler);  // epoch and position
  State& add(const std::string& name, at::Tensor& tensor);    // restored in place when defined (shape, dtype checked)
  State& add(const std::string& name, int64_t& counter);      // a step, an epoch
  State& add(const std::string& name, Save save, Load load);  // anything else

  struct Item;

 private:
  friend class Checkpointer;
  std::vector<std::unique_ptr<Item>> items_;
};

struct CheckpointOptions {
  // Steps whose files a rank keeps (the newest ones); at least 2, so that the previous step survives a crash while
  // the newest is written.
  int keep = 2;
  // Flush each file and directory to disk (fsync) before a save returns. Off only for tests of speed.
  bool sync = true;
};

// Whose files restore() reads.
enum class Layout {
  // Each rank its own: for state that differs between ranks (a ZeroRedundancyOptimizer's shard). The job must have
  // the world size of the one that saved.
  kPerRank,
  // Every rank reads rank 0's: for state every rank holds the same (DDP's model and optimizer, counters, the
  // sampler, which re-derives this rank's share of what is left of the epoch). The job may have another world size
  // than the one that saved, as after an elastic re-formation (tandem-run --nnodes MIN:MAX); the ranks must then
  // share the directory (or each have a copy of rank 0's files).
  kReplicated,
};

class Checkpointer {
 public:
  // `rank`: this process's rank in the job (it names its files). The directory is made when missing.
  Checkpointer(std::string dir, int rank, CheckpointOptions options = {});

  // Writes this rank's part of checkpoint `step` (>= 0) atomically, then removes this rank's files of steps older than
  // the newest `keep` up to `step` (steps above it, another run's, are left: they never make this one's go). Not
  // collective: every rank saves its own part.
  void save(int64_t step, const State& state);

  // Restores `state` from the newest step that every rank of `group` has intact (this rank alone when `group` is
  // null), and returns it; nullopt when no rank has one (a fresh start: `state` is untouched). Collective over `group`.
  // When some ranks have intact steps and others none they share (a job grown under kPerRank, rank 0's files not
  // shared under kReplicated): FAILED_PRECONDITION on every rank, naming the ranks without.
  // Torn or damaged files are passed over for older steps (and logged); a directory or file that cannot be read
  // otherwise (permissions, no descriptors left) fails every rank with UNAVAILABLE instead of a silent older start.
  std::optional<int64_t> restore(State& state, comm::ProcessGroup* group = nullptr, Layout layout = Layout::kPerRank);

  // Restores `state` from exactly `step` (DATA_LOSS when this rank's file of it is torn or missing). Items are loaded
  // in the order they were added, in place: when one does not fit (INVALID_ARGUMENT), the ones before it are loaded
  // already, so a caller that goes on after the error starts from objects made afresh (as restore()'s callers do).
  void load(int64_t step, State& state);

  // The steps for which this rank has a file, oldest first (intact or not: load() tells).
  std::vector<int64_t> steps() const;
  // The file of this rank for `step`.
  std::string path(int64_t step) const;

 private:
  // The newest step <= bound whose file of `rank` is intact, with its payload; none when there is none; an error when a
  // file or the directory cannot be read (a torn or damaged file is passed over, and logged).
  absl::StatusOr<std::optional<std::pair<int64_t, std::string>>> newest_intact_at_most(int64_t bound, int rank) const;
  std::vector<int64_t> steps_of(int rank) const;
  std::string path_of(int64_t step, int rank) const;
  void load_payload(const std::string& file, const std::string& payload, State& state);
  void prune(int64_t saved) const;

  std::string dir_;
  int rank_;
  CheckpointOptions options_;
  mutable bool warned_newer_ = false;  // prune() said once that the directory holds another run's newer steps
  mutable bool warned_prune_ = false;  // prune() said once that it could not remove an old step (or list them)
};

// The full state (parameters and buffers by name, as a plain module has them) of a fully sharded model that every rank
// of a job saved as item `item` (State::Fsdp::kSharded) of checkpoint `step` in `dir`: each rank's file read and the
// pieces put back together, in one process and with no group. Load it into a plain module, or into a fully sharded
// model of any world size (FullyShardedDataParallel::load_full_state_dict). Errors: as load(), and INVALID_ARGUMENT
// when the ranks' files do not fit together.
std::vector<std::pair<std::string, at::Tensor>> consolidate_fsdp(const std::string& dir, int64_t step,
                                                                 const std::string& item);

}  // namespace tandem::checkpoint
