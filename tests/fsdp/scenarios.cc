// Fully sharded scenarios. The equivalence scenario trains the sharded model on W ranks, each on its own rows, and in
// the same process a reference model that computes what the ranks compute, one rank after another, with the average
// of their losses; after every step every gathered parameter must equal the reference's.
#include "tests/fsdp/scenarios.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/comm/process_group.h"
#include "tandem/fsdp/fsdp.h"
#include "tandem/optim/adam.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rpc.h"
#include "tests/common/files.h"
#include "tests/common/scenario.h"
#include "tests/common/time_scale.h"

namespace tandem::test {
namespace {

// Units of 117, 310, 373 and 42 parameters: two not divisible by 2, two not by 3 (padded shards on 2 and on 3 ranks).
constexpr int64_t kRows = 3, kIn = 8, kHidden = 13, kOut = 3;

// A unit with a parameter used only when asked (on rank 0 in the scenario) and one never used.
struct PartialImpl : torch::nn::Module {
  PartialImpl() {
    used = register_module("used", torch::nn::Linear(kHidden, kHidden));
    sometimes = register_module("sometimes", torch::nn::Linear(kHidden, kHidden));
    never = register_module("never", torch::nn::Linear(2, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return use_sometimes ? used(x) + sometimes(x) : used(x); }
  torch::nn::Linear used{nullptr}, sometimes{nullptr}, never{nullptr};
  bool use_sometimes = false;
};
TORCH_MODULE(Partial);

// A nested unit: a Sequential inside (a Sequential cannot hold one directly).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    layers = register_module("layers", torch::nn::Sequential(torch::nn::Linear(kHidden, 11), torch::nn::Tanh(),
                                                             torch::nn::Linear(11, kHidden)));
  }
  at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(Block);

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential seq(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), Block(), Partial(), torch::nn::ReLU(),
                            torch::nn::Linear(kHidden, kOut));
  seq->to(at::kDouble);
  return seq;
}

std::pair<at::Tensor, at::Tensor> data(int64_t step, int world) {
  auto gen = at::detail::createCPUGenerator(100 + step);
  return {at::randn({world * kRows, kIn}, gen).to(at::kDouble), at::randn({world * kRows, kOut}, gen).to(at::kDouble)};
}

// Rank r's loss on its rows (rank 0 uses Partial's second layer).
at::Tensor rank_loss(const std::function<at::Tensor(const at::Tensor&)>& forward, torch::nn::Sequential& seq, int r,
                     const at::Tensor& x, const at::Tensor& y) {
  seq->ptr<PartialImpl>(3)->use_sometimes = r == 0;
  return torch::mse_loss(forward(x.narrow(0, r * kRows, kRows)), y.narrow(0, r * kRows, kRows));
}

// The reference's backward: what the W ranks compute together, the average of their losses, in one process. Returns
// each rank's loss.
std::vector<double> reference_backward(torch::nn::Sequential& ref, int world, const at::Tensor& x,
                                       const at::Tensor& y) {
  at::Tensor total = at::zeros({}, at::kDouble);
  std::vector<double> losses;
  for (int r = 0; r < world; ++r) {
    at::Tensor loss = rank_loss([&](const at::Tensor& in) { return ref->forward(in); }, ref, r, x, y);
    losses.push_back(loss.item<double>());
    total = total + loss;
  }
  (total / world).backward();
  return losses;
}

// The gathered parameters against the reference's, by name and order, within 1e-10 ("" when they are).
std::string same_parameters(int step, const fsdp::FullyShardedDataParallel::StateDict& gathered,
                            const torch::OrderedDict<std::string, at::Tensor>& expected) {
  if (gathered.size() != expected.size()) {
    return absl::StrCat("gathered ", gathered.size(), " parameters, the model has ", expected.size());
  }
  for (size_t i = 0; i < gathered.size(); ++i) {
    const auto& [name, value] = gathered[i];
    if (name != expected[i].key())
      return absl::StrCat("parameter ", i, " is '", name, "', not '", expected[i].key(), "'");
    const double diff = (value - expected[i].value()).abs().max().item<double>();
    if (!(diff <= 1e-10)) return absl::StrCat("step ", step, ": ", name, " differs by ", diff);
  }
  return "";
}

// The options of an equivalence variant: "keep" keeps each unit gathered from its forward to its backward; "lean", the
// least memory, neither prefetches nor overlaps reductions; "no_prefetch"; "zero2" shards gradients and optimizer
// state only.
fsdp::FsdpOptions options_of(const std::string& variant) {
  fsdp::FsdpOptions options;
  options.reshard_after_forward = variant != "keep";
  options.prefetch = variant != "no_prefetch" && variant != "lean";
  options.overlap_reduce = variant != "lean";
  if (variant == "zero2") options.sharding = fsdp::Sharding::kGradientsAndOptimizer;
  return options;
}

// Adam, or for "sgd" SGD with momentum, which (unlike Adam) would also show a gradient off by a factor.
std::unique_ptr<torch::optim::Optimizer> optimizer_of(const std::string& variant, std::vector<at::Tensor> params) {
  if (variant == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// The bytes of the storages of `m`'s parameters (a unit's parameters share one).
int64_t held_bytes(torch::nn::Module& m) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& p : m.parameters()) {
    if (seen.insert(p.storage().unsafeGetStorageImpl()).second) bytes += static_cast<int64_t>(p.storage().nbytes());
  }
  return bytes;
}

std::string equivalence(const std::string& variant) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  auto group = comm::ProcessGroup::create("fsdp_" + variant);
  const fsdp::FsdpOptions options = options_of(variant);
  // "lean" is stepped by ChunkedAdam against the reference's Adam.
  const bool lean = variant == "lean", zero2 = variant == "zero2";
  torch::nn::Sequential sharded_model = make_model();
  fsdp::FullyShardedDataParallel model(sharded_model, group, options);
  torch::nn::Sequential ref = make_model();
  std::unique_ptr<torch::optim::Optimizer> opt_ptr =
      lean ? std::make_unique<tandem::optim::ChunkedAdam>(model.parameters(), torch::optim::AdamOptions(0.01), 64)
           : optimizer_of(variant, model.parameters());
  auto ref_opt_ptr = optimizer_of(variant, ref->parameters());
  torch::optim::Optimizer &opt = *opt_ptr, &ref_opt = *ref_opt_ptr;
  // Between uses the model's parameters hold no memory; with reshard_after_forward, not even between a forward and
  // its backward. Under ZeRO-2 they hold it from the first forward on.
  auto held = [&] { return held_bytes(*sharded_model); };
  // Each unit's parameters, padded to a multiple of W, in doubles.
  std::vector<int64_t> unit_bytes;
  bool uneven = false;
  for (int64_t n : {kIn * kHidden + kHidden, (kHidden * 11 + 11) + (11 * kHidden + kHidden),
                    2 * (kHidden * kHidden + kHidden) + (2 * 3 + 3), kHidden * kOut + kOut}) {
    unit_bytes.push_back((n + world - 1) / world * world * 8);
    uneven = uneven || n % world != 0;
  }
  if (!uneven) return absl::StrCat("every unit's size divides by ", world, ": no shard is padded");
  const int64_t all_units = std::accumulate(unit_bytes.begin(), unit_bytes.end(), int64_t{0});
  if (held() != 0) return absl::StrCat("after construction the parameters hold ", held(), " bytes");
  // "no_sync": the first two micro-batches of a step unsynchronised from their forward on; "sync_off_late": turned
  // off between each one's forward and its backward (the Linear units' backwards then wrote into their buffers, and
  // those gradients go to .grad instead of a reduction).
  const bool late = variant == "sync_off_late";
  const int micro = variant == "no_sync" || late ? 3 : 1;
  int64_t mapped = 0;
  for (int step = 0; step < 3; ++step) {
    // Fully sharded, from the third step on every buffer a step takes is one the step before released and the pool
    // kept. (ZeRO-2 holds every unit gathered, and its gradients' buffers, of several sizes, do not all fit beside
    // them within the peak, which bounds what the pool keeps: some are mapped afresh every step.)
    if (step == 2) mapped = model.stats().buffers_mapped;
    opt.zero_grad();
    ref_opt.zero_grad();
    for (int k = 0; k < micro; ++k) {
      auto [x, y] = data(step * micro + k, world);
      model.set_requires_gradient_sync(late || k == micro - 1);
      at::Tensor loss = rank_loss([&](const at::Tensor& in) { return model.forward(in); }, sharded_model, rank, x, y);
      if (late) model.set_requires_gradient_sync(k == micro - 1);
      // Resharding, only the last unit stays gathered, for the backward it begins; otherwise every unit is.
      if (held() != (options.reshard_after_forward && !zero2 ? unit_bytes.back() : all_units)) {
        return absl::StrCat("after forward the parameters hold ", held(), " bytes");
      }
      loss.backward();
      if ((held() != 0) != zero2) return absl::StrCat("after backward the parameters hold ", held(), " bytes");
      const double ref_loss = reference_backward(ref, world, x, y)[rank];
      if (!(std::abs(loss.item<double>() - ref_loss) <= 1e-10)) {
        return absl::StrCat("step ", step, ": loss ", loss.item<double>(), ", one process's ", ref_loss);
      }
    }
    opt.step();
    ref_opt.step();
    if (auto e = same_parameters(step, model.full_parameters(), ref->named_parameters()); !e.empty()) return e;
  }
  const auto stats = model.stats();
  if (stats.units != 4) return absl::StrCat("units: ", stats.units);
  // Both Linear units (the first and the last) wrote their gradients into their buffers in every synchronising
  // backward, fully sharded; ZeRO-2 keeps its parameters, so never.
  if (stats.gradients_into_buffers != (zero2 ? 0 : late ? 3 * 2 * micro : 3 * 2)) {
    return absl::StrCat("gradients written into the units' buffers: ", stats.gradients_into_buffers);
  }
  if (!zero2 && stats.buffers_mapped != mapped) {
    return absl::StrCat("the third step mapped ", stats.buffers_mapped - mapped, " buffers afresh");
  }
  // Lean: never more than the largest unit gathered at once (its parameters, or its gradients being reduced).
  const int64_t largest = *std::max_element(unit_bytes.begin(), unit_bytes.end()) / 8;
  if (lean && stats.peak_gathered_elements != largest) {
    return absl::StrCat("gathered at once: ", stats.peak_gathered_elements, " elements, the largest unit ", largest);
  }
  // The pool's buffers in use at once, gathered units and reductions' inputs alike: on the workers, which run this
  // model only (the pool's mark is the process's; rank 0, the test process, may have run other tests' models before:
  // scripts/ctest_by_suite.py runs a suite's tests in one process).
  if (lean && rank != 0 && stats.buffer_bytes_peak != largest * 8) {
    return absl::StrCat("buffers in use at once: ", stats.buffer_bytes_peak, " bytes, the largest unit ", largest * 8);
  }
  return "";
}

// Mixed precision on float32 shards, against the float64 reference of the equivalence scenario (SGD, 3 steps): "bf16"
// gathers and computes in bfloat16 and reduces in it; "reduce_fp16" computes in float32 and reduces in float16; "fp32",
// the control, is float32 throughout. The low-precision runs must stay within what their precision explains (5e-3;
// 2.2e-4 and 2.2e-5 here) and differ from the reference by more than the control may (2e-6; 3.9e-8 here), else the
// low precision was not used; the module computes in the gathered dtype while the shards and their gradients stay
// float32.
std::string mixed(const std::string& variant) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  auto group = comm::ProcessGroup::create("fsdp_mixed_" + variant);
  fsdp::FsdpOptions options;
  at::ScalarType compute = at::kFloat;
  if (variant == "bf16") {
    options.mixed_precision.param_dtype = compute = at::kBFloat16;
  } else if (variant == "reduce_fp16") {
    options.mixed_precision.reduce_dtype = at::kHalf;
  } else if (variant != "fp32") {
    return "unknown variant " + variant;
  }
  options.mixed_precision.output_dtype = at::kFloat;
  torch::nn::Sequential sharded_model = make_model();
  sharded_model->to(at::kFloat);
  fsdp::FullyShardedDataParallel model(sharded_model, group, options);
  torch::nn::Sequential ref = make_model();
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  double largest = 0;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    auto [x, y] = data(step, world);
    const at::Tensor xf = x.to(at::kFloat), yf = y.to(at::kFloat);
    at::Tensor loss = rank_loss([&](const at::Tensor& in) { return model.forward(in); }, sharded_model, rank, xf, yf);
    // The last unit stays gathered for its backward: in the compute dtype.
    const at::Tensor last = sharded_model->ptr(5)->parameters()[0];
    if (last.scalar_type() != compute) {
      return absl::StrCat("the gathered parameters are ", c10::toString(last.scalar_type()), ", not ",
                          c10::toString(compute));
    }
    if (loss.scalar_type() != at::kFloat) return absl::StrCat("the output is ", c10::toString(loss.scalar_type()));
    loss.backward();
    for (const at::Tensor& shard : model.parameters()) {
      if (shard.scalar_type() != at::kFloat || shard.grad().scalar_type() != at::kFloat) {
        return "a shard or its gradient is not float32";
      }
    }
    reference_backward(ref, world, x, y);
    opt.step();
    ref_opt.step();
    const auto gathered = model.full_parameters();
    const auto expected = ref->named_parameters();
    for (size_t i = 0; i < gathered.size(); ++i) {
      const double diff = (gathered[i].second.to(at::kDouble) - expected[i].value()).abs().max().item<double>();
      largest = std::max(largest, diff);
      if (!(diff <= 5e-3)) return absl::StrCat("step ", step, ": ", gathered[i].first, " differs by ", diff);
    }
  }
  std::fprintf(stderr, "fsdp mixed precision %s: largest difference from float64 %.3g\n", variant.c_str(), largest);
  // The control, all in float32: within its rounding.
  if (variant == "fp32") return largest <= 2e-6 ? "" : absl::StrCat("float32 differs by ", largest);
  if (!(largest > 2e-6)) return absl::StrCat("within ", largest, " of float64: the low precision was not used");
  return "";
}

// A memory cgroup this process joins: what it allocates from then on is charged to it, and above `cap` bytes the
// kernel's OOM killer ends the process. Pages it held before joining stay charged where they were. It is made in the
// hierarchy that has the memory controller, whichever is mounted: cgroup v1's (memory.limit_in_bytes; the peak in
// memory.max_usage_in_bytes) or else v2's (memory.max; the peak in memory.peak), at the hierarchy's root. As root.
class MemoryCap {
 public:
  explicit MemoryCap(int64_t cap) {
    if (!find_hierarchy()) {
      error_ = "no memory cgroup controller is mounted (cgroup v1's memory hierarchy, or v2's with memory available)";
      return;
    }
    remove_abandoned();
    // v2 gives a cgroup the memory controller only when its parent enables it for its children (a systemd host's
    // root does; a container's may not yet). Left enabled: another rank's cgroup beside this one may be using it.
    if (v2_ && !has_word(read(base_ + "/cgroup.subtree_control"), "memory") &&
        !write_file(base_ + "/cgroup.subtree_control", "+memory")) {
      error_ = absl::StrCat(
          "cannot enable the memory controller for the children of ", base_,
          " (cgroup v2; a cgroup with processes of its own, not the root, cannot): ", std::strerror(errno));
      return;
    }
    const std::string dir = absl::StrCat(base_, "/tandem_fsdp_", getpid());
    if (::mkdir(dir.c_str(), 0755) != 0) {
      error_ = absl::StrCat("cannot make the memory cgroup ", dir, " (cgroup ", v2_ ? "v2" : "v1",
                            "'s memory controller, as root): ", std::strerror(errno));
      return;
    }
    dir_ = dir;
    if (!write(v2_ ? "memory.max" : "memory.limit_in_bytes", std::to_string(cap)) ||
        !write("cgroup.procs", std::to_string(getpid()))) {
      error_ = absl::StrCat("cannot cap ", dir_, " at ", cap, " bytes and join it: ", std::strerror(errno));
    }
  }
  ~MemoryCap() {
    if (dir_.empty()) return;
    // Back to the cgroup it came from, so that the emptied one can go.
    write_file(home_ + "/cgroup.procs", std::to_string(getpid()));
    if (!v2_) write("memory.force_empty", "0");  // v2 has none: pages still charged stay with the removed cgroup
    ::rmdir(dir_.c_str());
  }
  const std::string& error() const { return error_; }
  int64_t peak() const {  // the most charged at once since joining
    int64_t bytes = -1;
    // A v2 kernel before 5.19 has no memory.peak: then what is charged now, which shows at least that the cgroup
    // held the process and its memory.
    if (!v2_) {
      std::ifstream(dir_ + "/memory.max_usage_in_bytes") >> bytes;
    } else if (!(std::ifstream(dir_ + "/memory.peak") >> bytes)) {
      std::ifstream(dir_ + "/memory.current") >> bytes;
    }
    return bytes;
  }

 private:
  static std::string read(const std::string& path) { return test::read_file(path); }
  // Whether `word` is one of the words of `list`, separated by spaces, commas or newlines.
  static bool has_word(const std::string& list, const std::string& word) {
    std::string spaced = " " + list + " ";
    std::replace(spaced.begin(), spaced.end(), ',', ' ');
    std::replace(spaced.begin(), spaced.end(), '\n', ' ');
    return spaced.find(" " + word + " ") != std::string::npos;
  }
  // Where the memory controller's hierarchy is mounted, from /proc/self/mountinfo ("id parent dev root point options
  // [optional...] - type source super-options"): v1's mount whose super options include memory, else a v2 mount
  // whose root offers memory (in v1 and v2 side by side, v2's holds no controller v1 has). And the cgroup this
  // process is in there, from /proc/self/cgroup ("4:memory:/a/b" in v1, "0::/a/b" in v2), when its directory is
  // under the mount point (in a container the mount's root may be the container's own cgroup: then the mount point).
  bool find_hierarchy() {
    std::string v2_point;
    std::istringstream mounts(read("/proc/self/mountinfo"));
    for (std::string line; std::getline(mounts, line);) {
      std::istringstream f(line);
      std::string id, parent, dev, root, point, field, type, source, options;
      f >> id >> parent >> dev >> root >> point;
      while (f >> field && field != "-") {
      }
      f >> type >> source >> options;
      if (type == "cgroup" && has_word(options, "memory")) {
        base_ = point;
        break;
      }
      if (type == "cgroup2" && v2_point.empty() && has_word(read(point + "/cgroup.controllers"), "memory")) {
        v2_point = point;
      }
    }
    if (base_.empty()) {
      if (v2_point.empty()) return false;
      base_ = v2_point;
      v2_ = true;
    }
    home_ = base_;
    std::istringstream lines(read("/proc/self/cgroup"));
    for (std::string line; std::getline(lines, line);) {
      const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      const bool mine = v2_ ? line.compare(0, b + 1, "0::") == 0 : has_word(line.substr(a + 1, b - a - 1), "memory");
      struct stat st;
      const std::string dir = base_ + line.substr(b + 1);
      if (mine && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) home_ = dir;
    }
    return true;
  }
  // Earlier runs' cgroups whose process died inside them (the OOM killer's): named after a process that no longer
  // exists. (Not "no process inside": another rank may have made its own and not joined it yet.)
  void remove_abandoned() const {
    DIR* root = ::opendir(base_.c_str());
    if (root == nullptr) return;
    const std::string prefix = "tandem_fsdp_";
    while (const dirent* e = ::readdir(root)) {
      const std::string name = e->d_name;
      if (name.rfind(prefix, 0) != 0) continue;
      const pid_t pid = static_cast<pid_t>(std::atoi(name.c_str() + prefix.size()));
      if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) ::rmdir((base_ + "/" + name).c_str());
    }
    ::closedir(root);
  }
  static bool write_file(const std::string& path, const std::string& value) {
    std::ofstream out(path);
    out << value << std::flush;
    return static_cast<bool>(out);
  }
  bool write(const std::string& file, const std::string& value) const { return write_file(dir_ + "/" + file, value); }
  bool v2_ = false;
  std::string base_;  // the hierarchy's mount point, under which the cgroup is made
  std::string home_;  // the cgroup this process was in, to go back to
  std::string dir_;   // the cgroup made; empty when none was
  std::string error_;
};

// An MLP whose parameters, gradients and Adam's two moments (4 x 128 MiB) do not fit a 400 MiB cap trains fully
// sharded on 3 ranks within it: each rank builds, wraps and trains the model inside a memory cgroup capped at 400 MiB
// (the kernel would end it above), and reports its peak.
std::string memory() {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  constexpr int64_t kWidth = 2048, kLayers = 8, kMiB = 1 << 20, kCap = 400 * kMiB;
  auto group = comm::ProcessGroup::create("fsdp_memory");
  MemoryCap cap(kCap);
  // Every rank goes on only if every rank is capped (one returning alone would leave the others waiting in the
  // model's collectives).
  at::Tensor capped = at::tensor({cap.error().empty() ? 1.0 : 0.0}, at::kDouble);
  comm::wait(group->allreduce(capped, comm::ReduceOp::kMin));
  if (!cap.error().empty()) return cap.error();
  if (capped.item<double>() < 1) return "another rank could not join its memory cgroup";
  torch::manual_seed(3);
  torch::nn::Sequential seq;
  for (int64_t l = 0; l < kLayers; ++l) {
    seq->push_back(torch::nn::Linear(kWidth, kWidth));
    seq->push_back(torch::nn::ReLU());
  }
  const int64_t param_bytes = kLayers * (kWidth * kWidth + kWidth) * 4;
  fsdp::FullyShardedDataParallel model(seq, group);
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(1e-4));
  auto gen = at::detail::createCPUGenerator(50 + rank);
  const at::Tensor x = at::randn({32, kWidth}, gen), y = at::randn({32, kWidth}, gen);
  double first = 0, last = 0;
  for (int step = 0; step < 4; ++step) {
    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(model.forward(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  const int64_t peak = cap.peak();
  std::fprintf(stderr,
               "fsdp memory: rank %d of %d: peak %.1f MiB charged within a %.0f MiB cap; unsharded, the model state "
               "(parameters, gradients, Adam's two moments) is %.1f MiB, sharded %.1f MiB; largest unit %.1f MiB\n",
               rank, world, static_cast<double>(peak) / kMiB, static_cast<double>(kCap) / kMiB,
               4.0 * param_bytes / kMiB, 4.0 * param_bytes / world / kMiB,
               static_cast<double>(model.stats().largest_unit_elements) * 4 / kMiB);
  if (4 * param_bytes <= kCap) return "the unsharded model state would fit the cap: the test shows nothing";
  if (peak <= 0 || peak > kCap) return absl::StrCat("peak ", peak, " bytes");
  if (!(last < first)) return absl::StrCat("the loss did not fall: ", first, " then ", last);
  return "";
}

// The bytes a Sequential child's unit buffer holds now (its first parameter is a view of the buffer): 0 once released.
size_t unit_buffer_bytes(torch::nn::Sequential& seq, size_t child) {
  return seq->ptr(child)->parameters().at(0).storage().nbytes();
}

// A unit whose collective failed keeps its buffer: the failed operation may still write into it (a Gloo operation can
// outlive its deadline), so resizing it away would free it under the writer; it goes with its storage once the
// operation and the model's parameters let go. Rank 1 takes part in the construction and the forward, then leaves
// the group; rank 0's backward fails there, with unit 1's gradients in its buffer being reduced in place. "overlap"
// (defaults): unit 0's prefetched gather fails too, and the model is then destroyed. "lean" (no prefetch or overlap):
// the failed in-place reduction is what the next forward drops (that forward fails at unit 0's gather), then the
// model is destroyed. Rank 0 checks the units' buffers after each.
std::string failed_collective(const std::string& variant) {
  const int rank = rpc::get_worker_info().id;
  const std::string name = "fsdp_failed_" + variant;
  fsdp::FsdpOptions options;
  options.prefetch = options.overlap_reduce = variant != "lean";
  // Rank 0's backward fails at once, when rank 1 destroys its group; this bound (20 s under ThreadSanitizer's scale)
  // would end it otherwise, within rank 1's wait for rank 0 in its graceful shutdown.
  auto group = comm::ProcessGroup::create(name, {}, {.timeout = scaled(std::chrono::milliseconds(2000))});
  torch::manual_seed(7);
  torch::nn::Sequential seq(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(), torch::nn::Linear(kHidden, kOut));
  seq->to(at::kDouble);
  auto model = std::make_unique<fsdp::FullyShardedDataParallel>(seq, group, options);
  auto [x, y] = data(0, 2);
  const at::Tensor mine = x.narrow(0, rank * kRows, kRows);
  at::Tensor loss = torch::mse_loss(model->forward(mine), y.narrow(0, rank * kRows, kRows));
  if (rank != 0) return "";  // leaves: its group goes with this scenario
  try {
    loss.backward();
    return "a backward succeeded without rank 1";
  } catch (const std::exception& e) {
    const std::string m = e.what();
    if (m.find("process group '" + name + "'") == std::string::npos) return "the error does not name the group: " + m;
  }
  if (model->stats().gradients_into_buffers != 1) {
    return absl::StrCat("unit 1 wrote its gradients into its buffer ", model->stats().gradients_into_buffers,
                        " times, not once: its reduction was not in place");
  }
  auto kept = [&](const std::vector<size_t>& children, const std::string& when) -> std::string {
    for (size_t c : children) {
      if (unit_buffer_bytes(seq, c) == 0) {
        return absl::StrCat(variant, ": the buffer of the unit of child ", c, " was released ", when,
                            " though its collective failed");
      }
    }
    return "";
  };
  if (variant == "lean") {
    try {
      model->forward(mine);
      return "a forward succeeded on a failed group";
    } catch (const std::exception&) {
    }
    if (std::string err = kept({2}, "by the next forward"); !err.empty()) return err;
  }
  model.reset();
  return kept({0, 2}, "when the model was destroyed");
}

// The last rank dies between two steps ("between") or after a forward, before its backward ("backward"): the others'
// next forward or backward fails within the group's timeout, naming the group and the operation.
std::string killed(const std::string& when) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  auto group = comm::ProcessGroup::create("fsdp_dead", {}, {.timeout = std::chrono::milliseconds(3000)});
  torch::nn::Sequential seq = make_model();
  fsdp::FullyShardedDataParallel model(seq, group);
  auto [x, y] = data(0, world);
  rank_loss([&](const at::Tensor& in) { return model.forward(in); }, seq, rank, x, y).backward();
  const bool last = rank == world - 1;
  try {
    if (when == "between" && last) ::_exit(9);
    at::Tensor loss = rank_loss([&](const at::Tensor& in) { return model.forward(in); }, seq, rank, x, y);
    if (last) ::_exit(9);
    loss.backward();
    return "a step succeeded without the dead rank";
  } catch (const std::exception& e) {
    const std::string m = e.what();
    if (m.find("process group 'fsdp_dead'") == std::string::npos ||
        (m.find("allgather") == std::string::npos && m.find("reduce_scatter") == std::string::npos)) {
      return "the error does not name the group and the operation: " + m;
    }
  }
  return "";
}

// Whether two state dicts hold the same names, in the same order, with equal values; "" when they do.
std::string same_state(const fsdp::FullyShardedDataParallel::StateDict& got,
                       const fsdp::FullyShardedDataParallel::StateDict& want, const std::string& what) {
  if (got.size() != want.size()) return absl::StrCat(what, ": ", got.size(), " entries, not ", want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].first != want[i].first) return absl::StrCat(what, ": '", got[i].first, "' where '", want[i].first, "'");
    if (!got[i].second.equal(want[i].second)) return absl::StrCat(what, ": '", got[i].first, "' differs");
  }
  return "";
}

// Checkpoints of a fully sharded model, in both forms, on 3 ranks. Ranks 0 and 1 train a pair's model 2 steps and save
// it sharded (with its Adam state) and full. The pair resumes from the sharded one bit-exact (a further step equals
// the original's); the 3 ranks resume from the full one (another world size), and refuse the pair's sharded one; the
// pair's shards consolidated in one process, and the full checkpoint loaded into a plain Sequential, equal the
// pair's model.
std::string checkpoints(const std::string& dir) {
  const int rank = rpc::get_worker_info().id;
  auto make = [] {
    torch::nn::Sequential seq = make_model();
    seq->push_back(torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(kOut)));  // buffers too
    seq->to(at::kDouble);
    return seq;
  };
  auto perturbed = [&] {  // not the saved values
    torch::nn::Sequential seq = make();
    at::NoGradGuard no_grad;
    for (auto& p : seq->parameters()) p.add_(1.0);
    return seq;
  };
  auto train_step = [&](fsdp::FullyShardedDataParallel& model, torch::nn::Sequential& seq, torch::optim::Optimizer& opt,
                        int64_t step) {
    auto [x, y] = data(step, 3);  // rows for up to 3 ranks
    opt.zero_grad();
    rank_loss([&](const at::Tensor& in) { return model.forward(in); }, seq, rank, x, y).backward();
    opt.step();
  };
  auto adam = [](fsdp::FullyShardedDataParallel& model) {
    return torch::optim::Adam(model.parameters(), torch::optim::AdamOptions(0.01));
  };
  const std::string sharded_dir = dir + "/sharded", full_dir = dir + "/full";
  using StateDict = fsdp::FullyShardedDataParallel::StateDict;
  StateDict saved, after;     // the pair's model at the save, and one step later
  StateDict saved_optimizer;  // the pair's Adam state at the save, gathered
  // The pair's part; its failure is told to rank 2 below, which would otherwise wait for the pair in vain.
  auto pair_part = [&]() -> std::string {
    auto pair = comm::ProcessGroup::create("fsdp_ckpt_pair", {0, 1});
    torch::nn::Sequential seq = make();
    fsdp::FullyShardedDataParallel model(seq, pair);
    torch::optim::Adam opt = adam(model);
    train_step(model, seq, opt, 0);
    train_step(model, seq, opt, 1);
    {  // the same buffers on both ranks (each tracked its own rows' statistics)
      at::NoGradGuard no_grad;
      for (auto& b : seq->buffers()) b.copy_(at::arange(b.numel()).view_as(b).to(b.scalar_type()));
    }
    checkpoint::State sharded_state, full_state;
    sharded_state.add("model", model).add("optimizer", opt);
    full_state.add("model", model, checkpoint::State::Fsdp::kFull).add("optimizer", opt, model);
    checkpoint::Checkpointer(sharded_dir, rank).save(2, sharded_state);
    checkpoint::Checkpointer(full_dir, rank).save(2, full_state);  // collective over the pair
    saved = model.full_state_dict();
    saved_optimizer = model.full_optimizer_state_dict(opt);
    train_step(model, seq, opt, 2);
    after = model.full_state_dict();

    torch::nn::Sequential seq2 = perturbed();
    fsdp::FullyShardedDataParallel resumed(seq2, pair);
    torch::optim::Adam opt2 = adam(resumed);
    checkpoint::State state;
    state.add("model", resumed).add("optimizer", opt2);
    const auto step = checkpoint::Checkpointer(sharded_dir, rank).restore(state, pair.get());
    if (!step || *step != 2) return "the pair resumed from " + (step ? std::to_string(*step) : "nothing");
    if (auto e = same_state(resumed.full_state_dict(), saved, "resumed from the sharded checkpoint"); !e.empty()) {
      return e;
    }
    train_step(resumed, seq2, opt2, 2);
    return same_state(resumed.full_state_dict(), after, "a step after resuming");
  };
  const std::string pair_error = rank < 2 ? pair_part() : "";

  auto all = comm::ProcessGroup::create("fsdp_ckpt_all");
  at::Tensor failed = at::tensor({pair_error.empty() ? 0.0 : 1.0}, at::kDouble);
  comm::wait(all->allreduce(failed, comm::ReduceOp::kMax));
  if (failed.item<double>() > 0) return rank < 2 ? pair_error : "";
  torch::nn::Sequential seq3 = perturbed();
  fsdp::FullyShardedDataParallel three(seq3, all);
  torch::optim::Adam opt3 = adam(three);
  checkpoint::State state;
  state.add("model", three, checkpoint::State::Fsdp::kFull).add("optimizer", opt3, three);
  const auto step = checkpoint::Checkpointer(full_dir, rank).restore(state, all.get(), checkpoint::Layout::kReplicated);
  if (!step || *step != 2) return "the 3 ranks resumed from " + (step ? std::to_string(*step) : "nothing");
  // The pair's model, as every rank can know it: the plain Sequential loaded from the full checkpoint of rank 0.
  torch::nn::Sequential plain = make();
  checkpoint::State plain_state;
  plain_state.add("model", *plain);
  checkpoint::Checkpointer(full_dir, 0).load(2, plain_state);
  StateDict plain_dict;
  for (const auto& p : plain->named_parameters()) plain_dict.emplace_back(p.key(), p.value().detach());
  for (const auto& b : plain->named_buffers()) plain_dict.emplace_back(b.key(), b.value());
  if (rank < 2) {
    if (auto e = same_state(plain_dict, saved, "a plain Sequential loaded from the full checkpoint"); !e.empty()) {
      return e;
    }
  }
  if (auto e = same_state(three.full_state_dict(), plain_dict, "3 ranks resumed from the full checkpoint");
      !e.empty()) {
    return e;
  }
  // Their Adam state, resharded over 3, gathered again: the pair's (every rank gathers the same).
  const StateDict optimizer3 = three.full_optimizer_state_dict(opt3);
  if (rank < 2) {
    if (auto e = same_state(optimizer3, saved_optimizer, "3 ranks' Adam state resumed"); !e.empty()) return e;
    if (saved_optimizer.size() != 3 * plain->parameters().size()) {  // each: exp_avg, exp_avg_sq and step
      return absl::StrCat("the gathered Adam state has ", saved_optimizer.size(), " entries");
    }
  }
  train_step(three, seq3, opt3, 2);  // it steps with the loaded state
  // Optimizer state without a parameter's step is refused, naming what is missing.
  StateDict partial;
  for (const auto& entry : optimizer3) {
    if (entry.first != "0.weight.step") partial.push_back(entry);
  }
  try {
    three.load_full_optimizer_state_dict(opt3, partial);
    return "optimizer state without a step loaded";
  } catch (const Error& e) {
    if (e.code() != absl::StatusCode::kInvalidArgument ||
        std::string(e.what()).find("0.weight.step") == std::string::npos) {
      return std::string("refusing optimizer state without a step: ") + e.what();
    }
  }
  const StateDict consolidated = checkpoint::consolidate_fsdp(sharded_dir, 2, "model");
  if (auto e = same_state(consolidated, plain_dict, "the sharded checkpoint consolidated"); !e.empty()) return e;
  torch::nn::Sequential seq4 = perturbed();
  fsdp::FullyShardedDataParallel from_consolidated(seq4, all);
  from_consolidated.load_full_state_dict(consolidated);
  if (auto e = same_state(from_consolidated.full_state_dict(), plain_dict, "3 ranks loading the consolidated dict");
      !e.empty()) {
    return e;
  }
  // The pair's sharded checkpoint in a job of 3: refused, saying why.
  checkpoint::State wrong;
  wrong.add("model", from_consolidated);
  try {
    checkpoint::Checkpointer(sharded_dir, rank % 2).load(2, wrong);
    return "a sharded checkpoint of 2 ranks loaded into 3";
  } catch (const Error& e) {
    if (e.code() != absl::StatusCode::kFailedPrecondition ||
        std::string(e.what()).find("2 ranks") == std::string::npos) {
      return std::string("refusing the sharded checkpoint of 2 ranks: ") + e.what();
    }
  }
  // A dict that does not fit is refused, naming the entry, and leaves the model as it was.
  StateDict bad = consolidated;
  for (auto& entry : bad) entry.second = entry.second + 1;  // values the model does not have: a partial load shows
  bad[1].second = bad[1].second.narrow(0, 0, 1);
  try {
    from_consolidated.load_full_state_dict(bad);
    return "a state dict entry of another shape loaded";
  } catch (const Error& e) {
    if (e.code() != absl::StatusCode::kInvalidArgument ||
        std::string(e.what()).find(bad[1].first) == std::string::npos) {
      return std::string("refusing an entry of another shape: ") + e.what();
    }
  }
  return same_state(from_consolidated.full_state_dict(), plain_dict, "after a refused dict");
}

// Named units (fsdp::Unit) in a model of the user's own type: the root's own parameters (an embedding Linear and a
// scale, outside every Unit), an encoder Unit with a Unit nested in it, a Unit whose module takes two tensors
// (forward_as) with a parameter used on rank 0 only and one never used, and a Linear head Unit. Units of 120, 310,
// 132, 369 and 42 parameters: 369 odd, 310 not a multiple of 3. Built without Units it is the plain model, the
// reference.
struct MixerImpl : torch::nn::Module {
  MixerImpl() {
    proj = register_module("proj", torch::nn::Linear(kHidden, kHidden));
    gate = register_module("gate", torch::nn::Linear(kHidden, kHidden));
    unused = register_parameter("unused", torch::randn({5}));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context) {
    const at::Tensor y = proj(x) * torch::sigmoid(context);
    return use_gate ? y + gate(context) : y;
  }
  torch::nn::Linear proj{nullptr}, gate{nullptr};
  at::Tensor unused;
  bool use_gate = false;
};

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool units) {
    embed = register_module("embed", torch::nn::Linear(kIn, kHidden));
    torch::nn::Sequential layers(torch::nn::Linear(kHidden, 11), torch::nn::Tanh());
    if (units) {
      layers->push_back(fsdp::Unit(torch::nn::Linear(11, 11)));
    } else {
      layers->push_back(torch::nn::Linear(11, 11));
    }
    layers->push_back(torch::nn::ReLU());
    layers->push_back(torch::nn::Linear(11, kHidden));
    mixer_module = std::make_shared<MixerImpl>();
    torch::nn::Linear head_module(kHidden, kOut);
    if (units) {
      encoder_unit = register_module("encoder", fsdp::Unit(layers));
      mixer_unit = register_module("mixer", fsdp::Unit(mixer_module));
      head_unit = register_module("head", fsdp::Unit(head_module));
      encode = [this](const at::Tensor& x) { return encoder_unit(x); };
      mix = [this](const at::Tensor& x, const at::Tensor& c) { return mixer_unit->forward_as<MixerImpl>(x, c); };
      project = [this](const at::Tensor& x) { return head_unit(x); };
    } else {
      register_module("encoder", layers);
      register_module("mixer", mixer_module);
      register_module("head", head_module);
      encode = [layers](const at::Tensor& x) mutable { return layers->forward(x); };
      mix = [m = mixer_module.get()](const at::Tensor& x, const at::Tensor& c) { return m->forward(x, c); };
      project = [head_module](const at::Tensor& x) mutable { return head_module->forward(x); };
    }
    scale = register_parameter("scale", torch::rand({kOut}) + 0.5);
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = torch::tanh(embed(x));
    at::Tensor e = encode(h);
    if (encode_twice) e = encode(e);
    const at::Tensor m = mix(e, h);
    if (grad_inside) {
      // A backward inside the forward through the units' outputs (as a penalty on an input's gradient would): its
      // value changes nothing here (no graph kept), but the units must be gathered for it and nothing reduced.
      const at::Tensor g = torch::autograd::grad({m.sum()}, {h}, {}, /*retain_graph=*/true)[0];
      if (!(g.abs().sum().item<double>() > 0)) throw std::runtime_error("the gradient inside the forward is zero");
    }
    return project(m) * scale;
  }
  torch::nn::Linear embed{nullptr};
  fsdp::Unit encoder_unit{nullptr}, mixer_unit{nullptr}, head_unit{nullptr};
  std::shared_ptr<MixerImpl> mixer_module;
  std::function<at::Tensor(const at::Tensor&)> encode, project;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> mix;
  at::Tensor scale;
  bool encode_twice = false, grad_inside = false;
};

std::shared_ptr<NetImpl> make_net(bool units) {
  torch::manual_seed(11);
  auto net = std::make_shared<NetImpl>(units);
  net->to(at::kDouble);
  return net;
}

// Code and message of what `f` throws ("" when nothing).
std::string thrown(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return absl::StrCat(absl::StatusCodeToString(e.code()), ": ", e.what());
  }
  return "";
}

// Misuse, refused naming why, leaving the model usable (after the equivalence steps of "reshard").
std::string named_units_misuse(std::unique_ptr<fsdp::FullyShardedDataParallel> model, std::shared_ptr<NetImpl> net,
                               NetImpl& plain, const std::shared_ptr<comm::ProcessGroup>& group, int world) {
  auto [x, y] = data(0, world);
  // State dicts go by the plain model's names: its parameters (doubled, values the model does not have) load, and
  // the full state dict gives them back; the sharded one loads back into the model.
  fsdp::FullyShardedDataParallel::StateDict doubled;
  for (const auto& p : plain.named_parameters()) doubled.emplace_back(p.key(), p.value().detach() * 2);
  model->load_full_state_dict(doubled);
  if (auto e = same_state(model->full_state_dict(), doubled, "the plain model's state loaded"); !e.empty()) return e;
  const auto sharded = model->sharded_state_dict();
  model->load_full_state_dict(plain.named_parameters().pairs());
  model->load_sharded_state_dict(sharded);
  if (auto e = same_state(model->full_state_dict(), doubled, "the sharded state loaded back"); !e.empty()) return e;
  // A Unit runs only inside the model's forward, and a unit once per forward.
  std::string e = thrown([&] { net->encoder_unit(at::zeros({1, kHidden}, at::kDouble)); });
  if (e.find("FAILED_PRECONDITION") != 0 || e.find("only inside") == std::string::npos) {
    return "a Unit run outside the model's forward: " + (e.empty() ? "no error" : e);
  }
  net->encode_twice = true;
  e = thrown([&] { model->forward(x); });
  net->encode_twice = false;
  if (e.find("FAILED_PRECONDITION") != 0 || e.find("'encoder' ran twice") == std::string::npos) {
    return "a unit run twice in one forward: " + (e.empty() ? "no error" : e);
  }
  e = thrown([&] { model->forward(x).sum().backward(); });  // the model works on after the refused forward
  if (!e.empty()) return "a step after a refused forward: " + e;
  e = thrown([&] { model->forward_as<MixerImpl>(x, x); });
  if (e.find("INVALID_ARGUMENT") != 0 || e.find("MixerImpl") == std::string::npos) {
    return "forward_as of another type: " + (e.empty() ? "no error" : e);
  }
  e = thrown([&] { model->forward_as<NetImpl>(x); });  // the root's forward of one tensor, by its type: runs
  if (!e.empty()) return "forward_as<NetImpl>: " + e;
  model.reset();
  e = thrown([&] { net->encoder_unit(at::zeros({1, kHidden}, at::kDouble)); });
  if (e.find("FAILED_PRECONDITION") != 0 || e.find("destroyed") == std::string::npos) {
    return "a Unit of a destroyed model: " + (e.empty() ? "no error" : e);
  }
  fsdp::FsdpOptions options;
  // Refused at construction, the model left as it was (its parameters whole, its Units free to run plainly): a
  // parameter in two places, a unit of two dtypes, a parameter registered on a Unit's module after the Unit was built,
  // a model without parameters.
  auto refused = [&](const std::string& what, const std::shared_ptr<NetImpl>& bad, const std::string& says) {
    const int64_t before = held_bytes(*bad);
    const std::string got = thrown([&] { fsdp::FullyShardedDataParallel m(bad, group, options); });
    if (got.find("INVALID_ARGUMENT") != 0 || got.find(says) == std::string::npos) return what + ": " + got;
    if (held_bytes(*bad) != before) return what + ": the refused model's parameters changed";
    return thrown([&] {
             bad->encoder_unit(at::zeros({1, kHidden}, at::kDouble));
           }).empty()
               ? std::string()
               : what + ": the refused model's Unit does not run plainly";
  };
  auto tied = make_net(true);
  tied->register_parameter("tied", tied->embed->weight);
  if (auto r = refused("tied parameters", tied, "tied"); !r.empty()) return r;
  auto two_dtypes = make_net(true);
  two_dtypes->mixer_module->unused.set_data(two_dtypes->mixer_module->unused.to(at::kFloat));
  if (auto r = refused("a unit of two dtypes", two_dtypes, "differ in dtype"); !r.empty()) return r;
  auto late = make_net(true);
  late->mixer_module->register_parameter("late", torch::zeros({2}, at::kDouble));
  if (auto r = refused("a parameter registered late", late, "'mixer'"); !r.empty()) return r;
  e = thrown([&] { fsdp::FullyShardedDataParallel m(torch::nn::Sequential(torch::nn::ReLU()), group, options); });
  if (e.find("INVALID_ARGUMENT") != 0) return "a model without parameters: " + e;
  return "";
}

// W ranks follow one process running the plain model (the same architecture without Units) within 1e-10 over 3
// steps (Adam, or SGD, which would also show a gradient off by a factor); the parameters hold memory only as the
// variant says; Unit(Linear)s write their gradients into their buffers. "twice": two forwards before one backward;
// "grad_inside": a backward inside the forward; "eval_between": a forward without gradients between a forward and its
// backward.
std::string named_units(const std::string& variant) {
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  const int rank = rpc::get_worker_info().id;
  auto group = comm::ProcessGroup::create("fsdp_units_" + variant);
  const fsdp::FsdpOptions options = options_of(variant);
  const bool lean = variant == "lean", zero2 = variant == "zero2", twice = variant == "twice";
  const int micro = variant == "no_sync" ? 3 : 1;
  auto net = make_net(true);
  auto ref = make_net(false);
  net->grad_inside = ref->grad_inside = variant == "grad_inside";
  auto model = std::make_unique<fsdp::FullyShardedDataParallel>(net, group, options);
  const auto stats = model->stats();
  if (stats.units != 5) return absl::StrCat("units: ", stats.units, ", not 5");
  const std::vector<int64_t> sizes = {120, 310, 132, 369, 42};
  bool uneven = false;
  int64_t all_bytes = 0;
  for (int64_t n : sizes) uneven = uneven || n % world != 0, all_bytes += (n + world - 1) / world * world * 8;
  if (!uneven) return absl::StrCat("every unit's size divides by ", world);
  auto padded = [&](int64_t n) { return (n + world - 1) / world * world; };
  if (stats.largest_unit_elements != padded(369)) {
    return absl::StrCat("the largest unit: ", stats.largest_unit_elements);
  }
  const int64_t root_bytes = (sizes[0] + world - 1) / world * world * 8;
  auto opt = optimizer_of(variant, model->parameters()), ref_opt = optimizer_of(variant, ref->parameters());
  auto loss_of = [&](const std::function<at::Tensor(const at::Tensor&)>& forward, NetImpl& m, int r,
                     const at::Tensor& x, const at::Tensor& y) {
    m.mixer_module->use_gate = r == 0;
    return torch::mse_loss(forward(x.narrow(0, r * kRows, kRows)), y.narrow(0, r * kRows, kRows));
  };
  for (int step = 0; step < 3; ++step) {
    opt->zero_grad();
    ref_opt->zero_grad();
    for (int k = 0; k < micro; ++k) {
      auto [x, y] = data(step * micro + k, world);
      auto [x2, y2] = data(100 + step, world);  // "twice": the second forward's rows
      model->set_requires_gradient_sync(k == micro - 1);
      auto sharded = [&](const at::Tensor& in) { return model->forward(in); };
      at::Tensor loss = loss_of(sharded, *net, rank, x, y);
      if (twice) loss = loss + loss_of(sharded, *net, rank, x2, y2);
      // Resharding, the root's unit (gathered for the whole forward) stays gathered for the backward it begins.
      const int64_t after_forward = variant == "grad_inside" ? held_bytes(*net)  // its backward gathered some again
                                    : options.reshard_after_forward && !zero2 ? root_bytes
                                                                              : all_bytes;
      if (held_bytes(*net) != after_forward) {
        return absl::StrCat("after forward the parameters hold ", held_bytes(*net), " bytes");
      }
      if (variant == "eval_between") {  // an evaluation between the forward and its backward
        at::NoGradGuard no_grad;
        net->mixer_module->use_gate = true;
        model->forward(x);
        net->mixer_module->use_gate = rank == 0;
      }
      loss.backward();
      if ((held_bytes(*net) != 0) != zero2) {
        return absl::StrCat("after backward the parameters hold ", held_bytes(*net), " bytes");
      }
      at::Tensor total = at::zeros({}, at::kDouble);
      double ref_loss = 0;
      auto plain = [&](const at::Tensor& in) { return ref->forward(in); };
      for (int r = 0; r < world; ++r) {
        at::Tensor l = loss_of(plain, *ref, r, x, y);
        if (twice) l = l + loss_of(plain, *ref, r, x2, y2);
        if (r == rank) ref_loss = l.item<double>();
        total = total + l;
      }
      (total / world).backward();
      if (!(std::abs(loss.item<double>() - ref_loss) <= 1e-10)) {
        return absl::StrCat("step ", step, ": loss ", loss.item<double>(), ", one process's ", ref_loss);
      }
    }
    opt->step();
    ref_opt->step();
    if (auto e = same_parameters(step, model->full_parameters(), ref->named_parameters()); !e.empty()) return e;
  }
  // The nested Unit(Linear) and the head wrote their gradients into their buffers in every synchronising backward
  // after one forward.
  if (model->stats().gradients_into_buffers != (zero2 || twice ? 0 : 3 * 2)) {
    return absl::StrCat("gradients written into the units' buffers: ", model->stats().gradients_into_buffers);
  }
  // Lean: at most the root, the encoder and the unit nested in it gathered at once (padded).
  if (lean && model->stats().peak_gathered_elements != padded(120) + padded(310) + padded(132)) {
    return absl::StrCat("lean: ", model->stats().peak_gathered_elements, " elements gathered at once");
  }
  if (variant != "reshard") return "";
  return named_units_misuse(std::move(model), net, *ref, group, world);
}

std::string run(const std::string& name) {
  if (name.rfind("checkpoints|", 0) == 0) return checkpoints(name.substr(12));
  if (name == "memory") return memory();
  if (name.rfind("mixed/", 0) == 0) return mixed(name.substr(6));
  if (name.rfind("killed/", 0) == 0) return killed(name.substr(7));
  if (name.rfind("failed_collective/", 0) == 0) return failed_collective(name.substr(18));
  if (name.rfind("equivalence/", 0) == 0) return equivalence(name.substr(12));
  if (name.rfind("units/", 0) == 0) return named_units(name.substr(6));
  return "unknown scenario " + name;
}

}  // namespace

void register_fsdp_scenarios() { register_scenario_runner(run); }

}  // namespace tandem::test
