// bench/run.sh fsdp — Tandem's side, one configuration per run (--mode), two ranks (tandem-run --nproc-per-node 2),
// one intra-op thread each. Model: the DDP benchmark's MLP 1024-2048-2048-1024 with ReLU (8.4 M parameters, 3 units
// of 8, 16 and 8 MiB), MSE loss, Adam; batch 64 per rank. One iteration: zero_grad, forward, backward, step.
//   fsdp_iter_ms        median iteration on rank 0
//   fsdp_peak_mib       the largest of the ranks' peaks (each rank's in rank_peak_mib, rank_own_peak_mib and
//                       rank_tensor_peak_mib; the peaks below likewise the largest, file_growth_kib the smallest and
//                       uncounted_allocations the sum over ranks): a rank's peak resident memory
//                       over the timed iterations above its resident memory before the
//                       model was built (VmHWM, reset through /proc/self/clear_refs), beside
//                       model_state_mib: what the configuration holds by the formula (P parameters, 4 bytes each:
//                       parameters 4P, gradients 4P, Adam's moments 8P; ZeRO-2 shards the last two, fully sharded
//                       all three) and bar_mib for the fully sharded one: DDP's model state / W + the largest unit,
//                       + 10% (issue 30), and tensor_peak_mib: the tensors' own peak over the same iterations (the
//                       CPU allocator's bytes above those before the model was built, plus fsdp's buffers' peak; the
//                       CPU's torch.cuda.max_memory_allocated: no malloc free pages, code pages or shared-memory
//                       staging; DDP's buckets, shared-memory mappings, are not in it), and own_peak_mib: the
//                       resident peak without file-backed pages (libtorch's and the other libraries' code and data
//                       first touched by training, shared by every rank on the host and by the page cache): VmHWM
//                       less RssFile when the timed iterations began, above VmRSS less RssFile before the model was
//                       built. File pages only grow here, so that bounds the anonymous and shared-memory pages' peak
//                       from above; file_growth_kib, how much they grew during the timed iterations (the smallest
//                       rank's: negative would void the bound), says so
// Modes: ddp (DistributedDataParallel, 25 MiB buckets), zero2 (fsdp::Sharding::kGradientsAndOptimizer), full
// (fsdp::Sharding::kFull, reshard_after_forward), lean (full with the least memory: prefetch and overlap_reduce off,
// and optim::ChunkedAdam, whose step takes no shard-sized temporaries; malloc_trim(0) after each step hands the
// heap's free pages back, which the step's transients would otherwise leave resident for the next). Flags: --mode,
// --iters N (timed, after 3 warm-up), --optimizer adam|chunked_adam (overrides the mode's: to see what each part of
// lean does).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <c10/core/CPUAllocator.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "bench/common.h"
#include "bench/mlp.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/ddp.h"
#include "tandem/fsdp/fsdp.h"
#include "tandem/optim/adam.h"
#include "tandem/rpc/rpc.h"
#include "tools/flags.h"

namespace bench = tandem::bench;
namespace comm = tandem::comm;
namespace rpc = tandem::rpc;

namespace {

// The bytes of the tensors LibTorch's CPU allocator holds, and their peak since reset_peak(): on the CPU what
// torch.cuda.max_memory_allocated is on a GPU (the measure FSDP's memory is usually reported in), without what
// resident memory adds (malloc's free pages, code pages touched, the process group's shared-memory staging).
// Installed before the model is built; fsdp's gathered buffers come from its own pool (Stats::buffer_bytes_peak).
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& the() {
    static auto* a = new CountingAllocator(c10::GetCPUAllocator());
    return *a;
  }
  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    if (inner.get_context() != data || inner.get_deleter() != base_->raw_deleter()) {
      uncounted_.fetch_add(1);  // not the default allocator's kind of pointer: reported, not counted
      return inner;
    }
    inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[data] = n;
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return c10::DataPtr(data, data, &CountingAllocator::free, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free; }
  int64_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  int64_t uncounted() const { return uncounted_.load(); }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
  }

 private:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  static void free(void* data) {
    CountingAllocator& a = the();
    {
      std::lock_guard<std::mutex> lock(a.mu_);
      auto it = a.sizes_.find(data);
      if (it != a.sizes_.end()) a.live_ -= static_cast<int64_t>(it->second), a.sizes_.erase(it);
    }
    a.base_->raw_deleter()(data);
  }
  c10::Allocator* const base_;
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, size_t> sizes_;
  mutable int64_t live_ = 0, peak_ = 0;
  mutable std::atomic<int64_t> uncounted_{0};
};

// A field of /proc/self/status, in KiB.
int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  std::string mode = "full";
  CLI::App app{"Per-rank peak memory and iteration time: DDP, ZeRO-2, fully sharded", "fsdp_bench"};
  std::string optimizer;
  app.add_option("--mode", mode, "ddp, zero2, full or lean")->check(CLI::IsMember({"ddp", "zero2", "full", "lean"}));
  app.add_option("--iters", iters, "timed iterations, after 3 warm-up");
  app.add_option("--optimizer", optimizer, "adam or chunked_adam (default: the mode's)")
      ->check(CLI::IsMember({"adam", "chunked_adam"}));
  tandem::tools::parse_flags(app, argc, argv);
  at::set_num_threads(1);
  c10::SetCPUAllocator(&CountingAllocator::the(), /*priority=*/1);  // before any other thread runs
  rpc::init_rpc();
  auto pg = comm::ProcessGroup::create("fsdp_bench", {}, {.timeout = std::chrono::minutes(5)});
  const int world = pg->size();
  const at::Tensor x = at::randn({64, 1024}), y = at::randn({64, 1024});
  const int64_t before_kib = status_kib("VmRSS"), before_file_kib = status_kib("RssFile");
  const int64_t before_bytes = CountingAllocator::the().live();
  auto model = bench::ddp_mlp();
  int64_t params = 0, largest = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  for (const auto& child : model->children()) {
    int64_t n = 0;
    for (const auto& p : child->parameters()) n += p.numel();
    largest = std::max(largest, n);
  }
  std::unique_ptr<tandem::ddp::DistributedDataParallel<torch::nn::SequentialImpl>> ddp;
  std::unique_ptr<tandem::fsdp::FullyShardedDataParallel> fsdp;
  std::vector<at::Tensor> trained;
  if (mode == "ddp") {
    ddp = std::make_unique<tandem::ddp::DistributedDataParallel<torch::nn::SequentialImpl>>(model.ptr(), pg);
    trained = model->parameters();
  } else {
    tandem::fsdp::FsdpOptions options;
    if (mode == "zero2") options.sharding = tandem::fsdp::Sharding::kGradientsAndOptimizer;
    if (mode == "lean") options.prefetch = options.overlap_reduce = false;
    fsdp = std::make_unique<tandem::fsdp::FullyShardedDataParallel>(model, pg, options);
    trained = fsdp->parameters();
  }
  if (optimizer.empty()) optimizer = mode == "lean" ? "chunked_adam" : "adam";
  std::unique_ptr<torch::optim::Adam> opt =
      optimizer == "adam" ? std::make_unique<torch::optim::Adam>(trained, torch::optim::AdamOptions(1e-4))
                          : std::make_unique<tandem::optim::ChunkedAdam>(trained, torch::optim::AdamOptions(1e-4));
  auto step = [&] {
    opt->zero_grad();
    at::mse_loss(ddp ? ddp->forward(x) : fsdp->forward(x), y).backward();
    opt->step();
    if (mode == "lean") malloc_trim(0);
  };
  for (int i = 0; i < 3; ++i) step();
  std::ofstream("/proc/self/clear_refs") << "5" << std::flush;  // VmHWM := VmRSS
  CountingAllocator::the().reset_peak();
  const int64_t reset_file_kib = status_kib("RssFile");
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const double t0 = bench::now_us();
    step();
    t.push_back((bench::now_us() - t0) / 1e3);
  }
  const int64_t hwm_kib = status_kib("VmHWM"), file_growth_kib = status_kib("RssFile") - reset_file_kib;
  const double peak_mib = static_cast<double>(hwm_kib - before_kib) / 1024;
  const double own_peak_mib = static_cast<double>((hwm_kib - reset_file_kib) - (before_kib - before_file_kib)) / 1024;
  // The tensors' peak: the CPU allocator's above what it held before the model was built, and fsdp's buffers' (the
  // two peaks added: the tensors never held more at one moment). Allocations it could not count are reported.
  const double tensor_peak_mib = static_cast<double>(CountingAllocator::the().peak() - before_bytes +
                                                     (fsdp ? fsdp->stats().buffer_bytes_peak : 0)) /
                                 (1 << 20);
  // Every rank's figures, to rank 0: the value reported is the largest rank's, each rank's beside it.
  const at::Tensor mine = at::tensor({peak_mib, own_peak_mib, tensor_peak_mib, static_cast<double>(file_growth_kib),
                                      static_cast<double>(CountingAllocator::the().uncounted())},
                                     at::kDouble);
  const at::Tensor all = at::empty({world, 5}, at::kDouble);
  comm::wait(pg->allgather(all, mine));
  auto per_rank = [&](int k) {
    std::string list = "[";
    for (int r = 0; r < world; ++r) list += (r > 0 ? "," : "") + std::to_string(all[r][k].item<double>());
    return list + "]";
  };
  auto largest_of = [&](int k) { return all.select(1, k).max().item<double>(); };
  const int64_t file_growth_min = static_cast<int64_t>(all.select(1, 3).min().item<double>());
  const int64_t uncounted_sum = static_cast<int64_t>(all.select(1, 4).sum().item<double>());
  if (pg->rank() == 0) {
    const double mib = 4.0 / (1 << 20), p = static_cast<double>(params);
    const double state = mode == "ddp"     ? 4 * p * mib
                         : mode == "zero2" ? (p + 3 * p / world) * mib
                                           : 4 * p / world * mib;
    const double bar = (4 * p / world + static_cast<double>(largest)) * mib * 1.1;
    const std::string cond =
        "\"processes\":" + std::to_string(world) +
        ",\"intra_op_threads\":1,\"model\":\"mlp1024-2048-2048-1024\",\"params\":" + std::to_string(params) +
        ",\"optimizer\":\"" + optimizer + "\",\"batch_per_rank\":64,\"mode\":\"" + mode +
        "\",\"iters\":" + std::to_string(iters);
    bench::emit("fsdp", "fsdp_iter_ms", bench::median(t), "ms", cond);
    bench::emit("fsdp", "fsdp_peak_mib", largest_of(0), "MiB",
                cond + ",\"model_state_mib\":" + std::to_string(state) + ",\"own_peak_mib\":" +
                    std::to_string(largest_of(1)) + ",\"tensor_peak_mib\":" + std::to_string(largest_of(2)) +
                    ",\"file_growth_kib\":" + std::to_string(file_growth_min) + ",\"rank_peak_mib\":" + per_rank(0) +
                    ",\"rank_own_peak_mib\":" + per_rank(1) + ",\"rank_tensor_peak_mib\":" + per_rank(2) +
                    ",\"uncounted_allocations\":" + std::to_string(uncounted_sum) +
                    (mode == "full" || mode == "lean" ? ",\"bar_mib\":" + std::to_string(bar) : std::string()));
  }
  rpc::shutdown();
  return 0;
}
