#include "tests/comm/scenarios.h"

#include "tests/common/scenario.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include <thread>

#include "absl/strings/str_cat.h"
#include "tandem/comm/process_group.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rpc.h"
#include "tandem/rpc/store.h"
#include "tests/common/multiproc.h"

namespace tandem::test {
namespace {

using comm::ReduceOp;

std::string check(bool ok, const std::string& what) { return ok ? "" : what + "; "; }

// Every collective and dtype on the group, against values each rank can compute.
std::string basic(const std::shared_ptr<comm::ProcessGroup>& pg) {
  std::string err;
  const int n = pg->size(), r = pg->rank();
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kByte, at::kInt, at::kLong}) {
    const std::string d = c10::toString(dtype);
    auto t = at::full({5}, r + 1, at::TensorOptions().dtype(dtype));
    comm::wait(pg->allreduce(t, ReduceOp::kSum));
    err += check(t.equal(at::full({5}, n * (n + 1) / 2, t.options())), d + " sum");
    t.fill_(r + 1);
    comm::wait(pg->allreduce(t, ReduceOp::kMax));
    err += check(t.equal(at::full({5}, n, t.options())), d + " max");
    t.fill_(r + 1);
    comm::wait(pg->allreduce(t, ReduceOp::kMin));
    err += check(t.equal(at::full({5}, 1, t.options())), d + " min");
    t.fill_(r + 1);
    comm::wait(pg->allreduce(t, ReduceOp::kProduct));
    int64_t fact = 1;
    for (int k = 1; k <= n; ++k) fact *= k;
    err += check(t.equal(at::full({5}, fact, t.options())), d + " product");
    auto b = at::full({3}, r == n - 1 ? 7 : 0, t.options());
    comm::wait(pg->broadcast(b, n - 1));
    err += check(b.equal(at::full({3}, 7, t.options())), d + " broadcast");
    auto in = at::full({2}, r, t.options());
    auto out = at::empty({2 * n}, t.options());
    comm::wait(pg->allgather(out, in));
    err += check(out.equal(at::arange(n, t.options()).repeat_interleave(2)), d + " allgather");
  }
  for (int root = 0; root < n; ++root) {
    const std::string at_root = " (root " + std::to_string(root) + ")";
    auto t = at::full({6}, r + 1, at::kLong);
    comm::wait(pg->reduce(t, root, ReduceOp::kSum));
    err += check(t.equal(at::full({6}, r == root ? n * (n + 1) / 2 : r + 1, at::kLong)), "reduce" + at_root);
    auto in = at::full({3}, r * 10, at::kFloat);
    auto out = r == root ? at::empty({3 * n}, at::kFloat) : at::Tensor();
    comm::wait(pg->gather(out, in, root));
    if (r == root) err += check(out.equal((at::arange(n, at::kFloat) * 10).repeat_interleave(3)), "gather" + at_root);
    auto whole = r == root ? at::arange(2 * n, at::kDouble) : at::Tensor();
    auto part = at::empty({2}, at::kDouble);
    comm::wait(pg->scatter(part, whole, root));
    err += check(part.equal(at::arange(2 * r, 2 * r + 2, at::kDouble)), "scatter" + at_root);
  }
  {
    // all_to_all: rank r sends r*100 + i to rank i; rank r receives i*100 + r from each rank i.
    auto in = at::arange(n, at::kInt) + r * 100;
    auto out = at::empty({n}, at::kInt);
    comm::wait(pg->all_to_all(out, in));
    err += check(out.equal(at::arange(n, at::kInt) * 100 + r), "all_to_all");
  }
  for (auto op : {ReduceOp::kSum, ReduceOp::kMax}) {
    // reduce_scatter: rank r contributes (r+1) * [0, 1, ..., 3n-1]; rank i receives chunk i of the reduction.
    auto in = at::arange(3 * n, at::kLong) * (r + 1);
    auto out = at::empty({3}, at::kLong);
    comm::wait(pg->reduce_scatter(out, in, op));
    auto chunk = at::arange(3 * r, 3 * r + 3, at::kLong);
    err += check(out.equal(op == ReduceOp::kSum ? chunk * (n * (n + 1) / 2) : chunk * n), "reduce_scatter");
  }
  {
    // send/recv around the ring, both directions at once, two tags; a recv posted before its send arrives.
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    auto to_next = at::full({1000}, r, at::kFloat), to_prev = at::full({7}, r * 10, at::kLong);
    auto from_prev = at::empty({1000}, at::kFloat), from_next = at::empty({7}, at::kLong);
    auto f1 = pg->recv(from_prev, prev, 1);
    auto f2 = pg->recv(from_next, next, 2);
    auto f3 = pg->send(to_next, next, 1);
    auto f4 = pg->send(to_prev, prev, 2);
    for (auto* f : {&f1, &f2, &f3, &f4}) comm::wait(*f);
    err += check(from_prev.equal(at::full({1000}, prev, at::kFloat)), "recv from previous rank");
    err += check(from_next.equal(at::full({7}, next * 10, at::kLong)), "recv from next rank");
    // Several messages with one tag keep their order.
    std::vector<at::Tensor> got;
    std::vector<rpc::Future> fs;
    for (int i = 0; i < 5; ++i) {
      fs.push_back(pg->send(at::full({3}, i, at::kInt), next, 3));
      got.push_back(at::empty({3}, at::kInt));
      fs.push_back(pg->recv(got.back(), prev, 3));
    }
    for (auto& f : fs) comm::wait(f);
    for (int i = 0; i < 5; ++i)
      err += check(got[i].equal(at::full({3}, i, at::kInt)), "send order " + std::to_string(i));
  }
  auto avg = at::full({4}, static_cast<double>(r), at::kDouble);
  comm::wait(pg->allreduce(avg, ReduceOp::kAvg));
  err += check(avg.equal(at::full({4}, (n - 1) / 2.0, at::kDouble)), "avg");
  // Several operations in flight at once complete in order, each correctly.
  std::vector<at::Tensor> ts;
  std::vector<rpc::Future> fs;
  for (int i = 0; i < 20; ++i) {
    ts.push_back(at::full({1000}, static_cast<float>(i), at::kFloat));
    fs.push_back(pg->allreduce(ts.back()));
  }
  for (int i = 0; i < 20; ++i) {
    comm::wait(fs[i]);
    err +=
        check(ts[i].equal(at::full({1000}, static_cast<float>(i * n), at::kFloat)), "in flight " + std::to_string(i));
  }
  comm::wait(pg->barrier());
  return err;
}

// Segments in /dev/shm named for this process (comm/detail/shm.cc: tandem-pg-<pid ns>-<pid>-<nonce>).
std::vector<std::string> my_segments() {
  std::vector<std::string> out;
  struct stat st {};
  stat("/proc/self/ns/pid", &st);
  const std::string mine = absl::StrCat("tandem-pg-", st.st_ino, "-", getpid(), "-");
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (std::string(e->d_name).rfind(mine, 0) == 0) out.push_back(e->d_name);
    }
    closedir(dir);
  }
  return out;
}

// The shared-memory path against Gloo on the same ranks: every collective it serves, every op and dtype, sizes from
// one element to several rounds of the segment's 1 MiB halves, on data each rank draws from the same seed. Values are
// small integers, so that every sum and product is exact in every dtype and the two paths must agree to the bit.
std::string shm_equals_gloo(int world) {
  auto shm = comm::ProcessGroup::create("shm", {}, {.shared_memory = comm::SharedMemory::kAlways});
  auto gloo = comm::ProcessGroup::create("gloo", {}, {.shared_memory = comm::SharedMemory::kNever});
  std::string err = check(std::string(shm->transport()) == "shared_memory", "shm group's transport") +
                    check(std::string(gloo->transport()) == "gloo", "gloo group's transport") +
                    check(my_segments().empty(), "a segment is left in /dev/shm after create()");
  const int r = shm->rank(), n = shm->size();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + r);
  auto data = [&](int64_t count, at::ScalarType dtype) {
    return at::randint(1, 4, {count}, gen, at::TensorOptions().dtype(at::kLong)).to(dtype);
  };
  auto same = [&](const char* what, const at::Tensor& a, const at::Tensor& b, const std::string& how) {
    err += check(a.equal(b), absl::StrCat(what, " ", how));
  };
  using comm::ReduceOp;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kByte, at::kInt, at::kLong}) {
    // Several rounds of 1 MiB: 5 for float, 9 for int64 (kept to two dtypes and ops: the test also runs under TSan).
    // Every dtype also at a size above the one-round limit (256 KiB: 300001 bytes for the 1-byte types), so each
    // one's reduction by shares runs too.
    std::vector<int64_t> sizes = {1, 1001, 70001};
    if (dtype == at::kFloat || dtype == at::kLong) sizes.push_back(1100001);
    if (c10::elementSize(dtype) <= 2) sizes.push_back(300001);
    for (int64_t count : sizes) {
      const std::string how = absl::StrCat(c10::toString(dtype), "[", count, "]");
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
        if (op == ReduceOp::kProduct && count > 1001) continue;
        if (count > 70001 && op != ReduceOp::kSum && op != ReduceOp::kMax) continue;
        const std::string with_op = absl::StrCat(how, " op ", static_cast<int>(op));
        at::Tensor a = data(count, dtype), b = a.clone();
        comm::wait(shm->allreduce(a, op));
        comm::wait(gloo->allreduce(b, op));
        same("allreduce", a, b, with_op);
        at::Tensor whole = data(count * n, dtype), ra = at::empty({count}, whole.options()), rb = ra.clone();
        comm::wait(shm->reduce_scatter(ra, whole, op));
        comm::wait(gloo->reduce_scatter(rb, whole, op));
        same("reduce_scatter", ra, rb, with_op);
      }
      // From every root at the sizes of one round, from the last at the larger ones.
      for (int root = count > 70001 ? n - 1 : 0; root < n; ++root) {
        at::Tensor a = data(count, dtype), b = a.clone();
        comm::wait(shm->broadcast(a, root));
        comm::wait(gloo->broadcast(b, root));
        same("broadcast", a, b, absl::StrCat(how, " from rank ", root));
      }
      at::Tensor in = data(count, dtype), oa = at::empty({count * n}, in.options()), ob = oa.clone();
      comm::wait(shm->allgather(oa, in));
      comm::wait(gloo->allgather(ob, in));
      same("allgather", oa, ob, how);
    }
  }
  comm::wait(shm->barrier());
  (void)world;
  return err;
}

// Shared tensors (ProcessGroup::shared_tensor): their allreduce (whole, or the same slice on every rank) equals
// Gloo's on the same data, for every op and dtype, and on random floats and doubles is each share's sum in the order
// its rank reduces it, bit for bit; nothing is left in /dev/shm; a Gloo group has none; ranks that pass
// a shared tensor where another passes a plain one all fail; a tensor outlives its group.
std::string shared_tensors() {
  auto shm = comm::ProcessGroup::create("st", {}, {.shared_memory = comm::SharedMemory::kAlways});
  auto gloo = comm::ProcessGroup::create("st_gloo", {}, {.shared_memory = comm::SharedMemory::kNever});
  std::string err = check(!gloo->shared_tensor(10, at::kFloat).defined(), "a Gloo group made a shared tensor");
  const int r = shm->rank();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99 + r);
  using comm::ReduceOp;
  at::Tensor kept;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kByte, at::kInt, at::kLong}) {
    std::vector<int64_t> sizes = {1, 1001};
    if (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kLong) sizes.push_back(1100001);
    for (int64_t count : sizes) {
      at::Tensor t = shm->shared_tensor(count, dtype);
      const std::string how = absl::StrCat(c10::toString(dtype), "[", count, "]");
      err += check(t.defined() && t.numel() == count && t.scalar_type() == dtype, "shared tensor " + how);
      if (!t.defined()) return err;
      err += check(t.eq(0).all().item<bool>(), "a new shared tensor is not zero: " + how);
      err += check(my_segments().empty(), "a segment is left in /dev/shm after shared_tensor " + how);
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
        if (op == ReduceOp::kProduct && count > 1001) continue;
        // The whole tensor, then a slice of it (the same on every rank) with the rest left alone.
        for (bool slice : {false, true}) {
          t.copy_(at::randint(1, 4, {count}, gen, at::TensorOptions().dtype(at::kLong)).to(dtype));
          const at::Tensor before = t.clone();
          at::Tensor part = slice ? t.narrow(0, count / 3, count - count / 3) : t;
          at::Tensor expected = part.clone();
          comm::wait(shm->allreduce(part, op));
          comm::wait(gloo->allreduce(expected, op));
          const std::string what = absl::StrCat(how, " op ", static_cast<int>(op), slice ? " (a slice)" : "");
          err += check(part.equal(expected), "shared allreduce differs from Gloo's: " + what);
          if (slice && count / 3 > 0) {
            err += check(t.narrow(0, 0, count / 3).equal(before.narrow(0, 0, count / 3)),
                         "a shared allreduce of a slice changed the rest: " + what);
          }
        }
      }
      // Floating-point data that does not sum exactly: the result is, bit for bit, each share's sum in the order its
      // rank reduces it (its own values first, then the others' in rank order; avg then divides), computed here one
      // element at a time from every rank's values.
      if ((dtype == at::kFloat || dtype == at::kDouble) && count > 1) {
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          t.copy_(at::randn({count}, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype));
          at::Tensor every = at::empty({shm->size(), count}, dtype);
          comm::wait(gloo->allgather(every, t.clone()));
          comm::wait(shm->allreduce(t, op));
          const int w = shm->size();
          bool same = true;
          AT_DISPATCH_FLOATING_TYPES(dtype, "reference", [&] {
            const at::Tensor values = every.contiguous();
            const scalar_t* v = values.data_ptr<scalar_t>();
            const scalar_t* got = t.data_ptr<scalar_t>();
            for (int q = 0; q < w; ++q) {
              for (int64_t e = count * q / w; e < count * (q + 1) / w; ++e) {
                scalar_t acc = v[q * count + e];
                for (int o = 0; o < w; ++o) {
                  if (o != q) acc += v[o * count + e];
                }
                if (op == ReduceOp::kAvg) acc /= static_cast<scalar_t>(w);
                same = same && std::memcmp(&acc, &got[e], sizeof(acc)) == 0;
              }
            }
          });
          err += check(same, absl::StrCat("shared allreduce of random ", how, " op ", static_cast<int>(op),
                                          " is not each share's sum in its rank's order"));
        }
      }
      kept = t;
    }
  }
  {
    // One rank passes a plain tensor where the others pass their shared one: every rank fails, naming a rank.
    auto mixed = comm::ProcessGroup::create("st_mixed", {}, {.shared_memory = comm::SharedMemory::kAlways});
    at::Tensor t = mixed->shared_tensor(100, at::kFloat);
    at::Tensor plain = at::zeros({100});
    const absl::Status s = mixed->allreduce(r == 0 ? plain : t).status();
    err += check(s.code() == absl::StatusCode::kFailedPrecondition &&
                     std::string(s.message()).find("a shared tensor") != std::string::npos,
                 "a shared tensor against a plain one: " + s.ToString());
  }
  shm.reset();
  kept.fill_(7);  // the storage keeps the mappings after the group is gone
  err += check(kept.eq(7).all().item<bool>(), "a shared tensor after its group");
  comm::wait(gloo->barrier());
  return err;
}

std::string run(const std::string& name) {
  const int rank = rpc::get_worker_info().id;
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  if (name == "basic") return basic(comm::ProcessGroup::create("basic"));
  if (name == "basic_gloo") {
    auto pg = comm::ProcessGroup::create("basic_gloo", {}, {.shared_memory = comm::SharedMemory::kNever});
    return check(std::string(pg->transport()) == "gloo", "transport") + basic(pg);
  }
  if (name == "basic_shm") {
    auto pg = comm::ProcessGroup::create("basic_shm", {}, {.shared_memory = comm::SharedMemory::kAlways});
    return check(std::string(pg->transport()) == "shared_memory", "transport") + basic(pg);
  }
  if (name == "shm_equals_gloo") return shm_equals_gloo(world);
  if (name == "shared_tensors") return shared_tensors();
  if (name == "stale_segment") {
    // A segment whose creator died before removing its name (made here with the pid of a child that has exited) is
    // removed by the next group's creation; the group's own is gone once create() returns.
    std::string err;
    std::string stale;
    if (rank == 0) {
      const pid_t child = fork();
      if (child == 0) _exit(0);
      waitpid(child, nullptr, 0);
      struct stat st {};
      stat("/proc/self/ns/pid", &st);
      stale = absl::StrCat("/dev/shm/tandem-pg-", st.st_ino, "-", child, "-dead");
      FILE* f = std::fopen(stale.c_str(), "w");
      if (!f) return "could not make " + stale;
      std::fclose(f);
    }
    auto pg = comm::ProcessGroup::create("sweep", {}, {.shared_memory = comm::SharedMemory::kAlways});
    comm::wait(pg->barrier());
    if (rank == 0) err += check(access(stale.c_str(), F_OK) != 0, "the stale segment " + stale + " is still there");
    err += check(my_segments().empty(), "a segment is left in /dev/shm");
    return err;
  }
  if (name == "shm_late_rank") {
    // Rank 1 is alive but joins the allreduce after the others' deadline: they fail with DEADLINE_EXCEEDED naming it.
    auto pg = comm::ProcessGroup::create("late", {}, {.timeout = std::chrono::milliseconds(1500)});
    if (std::string(pg->transport()) != "shared_memory") return "not on shared memory";
    // Past the others' deadline by a margin for their own start-up, scaled for slow builds.
    if (rank == 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(1500) + scaled(std::chrono::milliseconds(1000)));
    auto t = at::ones({10});
    const absl::Status s = pg->allreduce(t).status();
    if (rank == 1) return s.ok() ? "the late rank's allreduce succeeded" : "";
    const std::string m(s.message());
    if (s.code() != absl::StatusCode::kDeadlineExceeded || m.find("rank 1 (worker '") == std::string::npos ||
        m.find("process group 'late'") == std::string::npos || m.find("allreduce") == std::string::npos) {
      return "late rank: " + s.ToString();
    }
    return "";
  }
  if (name == "destroy_queued" || name == "destroy_queued_gloo") {
    // Rank 1 queues kOps allreduces and destroys its group at once; rank 0 takes part in them one at a time, kGap
    // (within the timeout) after the previous one ends. Before, the destructor ran them all: kOps x kGap at least
    // (kOps timeouts at worst). Now the queued ones fail at once (CANCELLED, naming the group, the operation and its
    // number), the one running ends within one gap, and rank 0's operations that need rank 1 fail at once, naming it.
    using Clock = std::chrono::steady_clock;
    constexpr int kOps = 8;
    constexpr auto kGap = std::chrono::milliseconds(1500);
    // Longer than a gap, which rank 1's running operation may wait for rank 0: by a margin for slow builds.
    const auto timeout = kGap + scaled(std::chrono::milliseconds(3500));
    const bool gloo = name == "destroy_queued_gloo";
    auto pg = comm::ProcessGroup::create(
        name, {},
        {.timeout = timeout, .shared_memory = gloo ? comm::SharedMemory::kNever : comm::SharedMemory::kAlways});
    comm::wait(pg->barrier());
    auto ms = [](Clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
    std::string err;
    if (rank == 1) {
      std::vector<at::Tensor> ts;
      std::vector<rpc::Future> fs;
      for (int i = 0; i < kOps; ++i) {
        ts.push_back(at::ones({16}));
        fs.push_back(pg->allreduce(ts.back()));
      }
      const auto t0 = Clock::now();
      pg.reset();
      const auto took = Clock::now() - t0;
      // Structural, so not scaled: running them takes kOps x kGap whatever the build's speed.
      if (took > kOps * kGap / 2) err += absl::StrCat("destroying the group took ", ms(took), " ms; ");
      for (int i = 0; i < kOps; ++i) {  // the first may have been running: done, or CANCELLED
        if (!fs[i].completed()) {
          err += absl::StrCat("operation ", i, " is pending after its group went; ");
          continue;
        }
        const absl::Status s = fs[i].status();
        const std::string m(s.message());
        if ((i > 0 || !s.ok()) &&
            (s.code() != absl::StatusCode::kCancelled || m.find("destroyed on this rank") == std::string::npos ||
             m.find(absl::StrCat("process group '", name, "' (rank 1 of ", world, "), allreduce")) ==
                 std::string::npos)) {
          err += absl::StrCat("operation ", i, ": ", s.ToString(), "; ");
        }
      }
      return err;
    }
    bool failed = false;  // rank 0
    for (int i = 0; i < kOps; ++i) {
      if (!failed) std::this_thread::sleep_for(kGap);
      auto t = at::ones({16});
      const auto t0 = Clock::now();
      const absl::Status s = pg->allreduce(t).status();
      const auto took = Clock::now() - t0;
      if (s.ok()) {
        if (i > 0) err += absl::StrCat("allreduce ", i, " succeeded after rank 1 destroyed its group; ");
        continue;
      }
      failed = true;
      const std::string m(s.message());
      // At once, not at the timeout (over Gloo the failure pings the members: 1 s at most).
      if (took > std::chrono::milliseconds(1000) + scaled(std::chrono::milliseconds(1500)) ||
          m.find("rank 1 (worker '") == std::string::npos ||
          m.find("destroyed its process group") == std::string::npos) {
        err += absl::StrCat("allreduce ", i, " after ", ms(took), " ms: ", s.ToString(), "; ");
      }
    }
    return err;
  }
  if (name == "destroy_while_waiting" || name == "destroy_while_waiting_gloo") {
    // Every rank runs allreduce A; then rank 1 lets kSleep pass and destroys its group with nothing queued, while the
    // others already wait in allreduce B (over shared memory asleep on the segment's futex, long past the spin). A
    // passes everywhere, and B fails on every other rank soon after the destroy, naming rank 1, not at the timeout.
    using Clock = std::chrono::steady_clock;
    const auto kSleep = scaled(std::chrono::milliseconds(500));
    const bool gloo = name == "destroy_while_waiting_gloo";
    auto pg =
        comm::ProcessGroup::create(name, {},
                                   {.timeout = std::chrono::milliseconds(30000),
                                    .shared_memory = gloo ? comm::SharedMemory::kNever : comm::SharedMemory::kAlways});
    std::string err;
    auto a = at::ones({16});
    const absl::Status sa = pg->allreduce(a).status();
    err += check(sa.ok() && a.equal(at::full({16}, world, a.options())), "allreduce A: " + sa.ToString());
    if (rank == 1) {
      std::this_thread::sleep_for(kSleep);
      pg.reset();
      return err;
    }
    auto b = at::ones({16});
    const auto t0 = Clock::now();
    const absl::Status s = pg->allreduce(b).status();
    const auto took = Clock::now() - t0;
    const std::string m(s.message());
    // Over Gloo the failure then asks the members (1 s at most).
    if (s.code() != absl::StatusCode::kUnavailable || m.find("rank 1 (worker '") == std::string::npos ||
        m.find("destroyed its process group") == std::string::npos ||
        took > kSleep + std::chrono::milliseconds(1000) + scaled(std::chrono::milliseconds(1500))) {
      err += absl::StrCat("allreduce B after ", std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                          " ms: ", s.ToString(), "; ");
    }
    return err;
  }
  if (name == "destroy_after_arriving") {
    // Three ranks over shared memory. Rank 1 starts allreduce A and destroys its group kSleep later, its thread by then
    // arrived in A's barrier (a post of 64 bytes; its A ends CANCELLED, or done); rank 2 starts A only after that. A
    // barrier the destroyed rank reached still passes: A succeeds on ranks 0 (asleep in it meanwhile) and 2, whole; the
    // next operation, which rank 1 never reaches, fails on both, naming it. (A segment marked failed at the destroy, or
    // a destroyed rank's process taken for gone in a barrier it reached, would fail A.)
    const auto kSleep = scaled(std::chrono::milliseconds(1000));
    auto pg = comm::ProcessGroup::create(
        name, {}, {.timeout = std::chrono::milliseconds(30000), .shared_memory = comm::SharedMemory::kAlways});
    comm::wait(pg->barrier());
    auto a = at::full({16}, rank + 1.0);
    const float want = world * (world + 1) / 2.0f;
    if (rank == 1) {
      rpc::Future f = pg->allreduce(a);
      std::this_thread::sleep_for(kSleep);
      pg.reset();
      if (!f.completed()) return "rank 1's allreduce is pending after its group went";
      const absl::Status s = f.status();
      return check(s.ok() || s.code() == absl::StatusCode::kCancelled, "rank 1's allreduce A: " + s.ToString());
    }
    if (rank == 2) std::this_thread::sleep_for(2 * kSleep);
    const absl::Status sa = pg->allreduce(a).status();
    std::string err = check(sa.ok() && a.equal(at::full({16}, want, a.options())),
                            "allreduce A, which rank 1 reached before it destroyed its group: " + sa.ToString());
    auto b = at::ones({16});
    const absl::Status sb = pg->allreduce(b).status();
    const std::string m(sb.message());
    err += check(sb.code() == absl::StatusCode::kUnavailable && m.find("rank 1 (worker '") != std::string::npos &&
                     m.find("destroyed its process group") != std::string::npos,
                 "allreduce B: " + sb.ToString());
    return err;
  }
  if (name == "subgroup") {
    // Ranks 0 and 2 of 3 form a group of their own; rank 1 is not in it.
    if (rank == 1) return "";
    auto pg = comm::ProcessGroup::create("pair", {0, 2});
    if (pg->size() != 2 || pg->rank() != (rank == 0 ? 0 : 1)) return "subgroup ranks wrong";
    return basic(pg);
  }
  if (name == "dead_rank" || name == "dead_rank_gloo") {
    // The last rank dies before the allreduce: the others get an error within the group's timeout. On shared memory
    // (the default here) they see the process end: UNAVAILABLE naming it, without waiting for the deadline.
    const bool gloo = name == "dead_rank_gloo";
    auto pg =
        comm::ProcessGroup::create("dead", {},
                                   {.timeout = std::chrono::milliseconds(gloo ? 3000 : 60000),
                                    .shared_memory = gloo ? comm::SharedMemory::kNever : comm::SharedMemory::kAlways});
    comm::wait(pg->barrier());
    if (rank == world - 1) _exit(9);
    auto t = at::ones({10});
    try {
      comm::wait(pg->allreduce(t));
      return "allreduce succeeded without the dead rank";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (m.find("process group 'dead'") == std::string::npos || m.find("allreduce") == std::string::npos) {
        return "error does not name the group and operation: " + m;
      }
      const std::string dead = absl::StrCat("rank ", world - 1, " (worker '");
      if (!gloo && (e.status().code() != absl::StatusCode::kUnavailable || m.find(dead) == std::string::npos ||
                    m.find("is gone") == std::string::npos)) {
        return "on shared memory, the error does not name the dead rank: " + e.status().ToString();
      }
    }
    try {
      comm::wait(pg->barrier());
      return "a failed group kept working";
    } catch (const RpcError&) {
    }
    return "";
  }
  if (name == "cut_link") {
    // On test hosts (tests/hosts/run.sh): host 2's link is cut while every rank runs allreduces of 16 MiB. Every rank
    // gets an error naming the group and the operation within the group's timeout; rank 0 heals the link afterwards.
    auto pg = comm::ProcessGroup::create("cut", {}, {.timeout = std::chrono::milliseconds(3000)});
    comm::wait(pg->barrier());
    std::thread cutter;
    if (rank == 0) {
      cutter = std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        host_fault("cut", 2);
      });
    }
    std::string err;
    auto t = at::ones({4 << 20});
    const auto t0 = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point failed_at;
    try {
      for (;;) {
        comm::wait(pg->allreduce(t));
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(20)) {
          err = "allreduces kept succeeding over a cut link; ";
          break;
        }
      }
    } catch (const RpcError& e) {
      failed_at = std::chrono::steady_clock::now();
      const std::string m = e.what();
      if (m.find("process group 'cut'") == std::string::npos || m.find("allreduce") == std::string::npos) {
        err += "error does not name the group and operation: " + m + "; ";
      }
      // The cut came at 300 ms; the error must follow within the group's timeout (plus a margin for the copy).
      if (failed_at - t0 > std::chrono::milliseconds(300 + 3000 + 2000)) err += "the error came too late: " + m + "; ";
    }
    if (rank == 0) {
      cutter.join();
      host_fault("heal", 2);
    }
    return err;
  }
  if (name == "late_gloo_op") {
    // On test hosts: host 1 sends at 32 Mbit/s, so an allreduce of 24 MiB takes about 8 s (a ring: each rank sends
    // two thirds of it twice) while each of Gloo's waits (a segment of 1 MiB) takes a fraction of a second, within the
    // group's timeout (2.5 s). The allreduce's future is due after that timeout plus the 1 s ping: its wait fails
    // then, and when the allreduce ends, late, the group is broken on every rank: the barrier queued behind it fails,
    // naming why (before, it ran as if nothing had happened).
    auto pg = comm::ProcessGroup::create("late_gloo", {}, {.timeout = std::chrono::milliseconds(2500)});
    if (std::string(pg->transport()) != "gloo") return std::string("not over Gloo: ") + pg->transport();
    comm::wait(pg->barrier());
    if (rank == 0) host_fault("rate", 1, "32mbit");
    comm::wait(pg->barrier());
    std::string err;
    auto t = at::ones({6 << 20});
    const absl::Status late = pg->allreduce(t).status();  // waits until the future's deadline
    if (late.code() != absl::StatusCode::kDeadlineExceeded)
      err += "the late allreduce's wait: " + late.ToString() + "; ";
    rpc::Future next = pg->barrier();
    if (!next.wait_for(std::chrono::seconds(60))) {
      err += "the barrier behind the late allreduce never completed; ";
    } else {
      const absl::Status s = next.status();
      if (s.code() != absl::StatusCode::kFailedPrecondition ||
          std::string(s.message()).find("allreduce: ended ") == std::string::npos ||
          std::string(s.message()).find("after its deadline") == std::string::npos) {
        err += "the barrier behind the late allreduce: " + s.ToString() + "; ";
      }
    }
    if (rank == 0) host_fault("rate", 1, "off");
    return err;
  }
  if (name == "p2p_timeout") {
    // A recv whose send never comes fails within the timeout, naming the peer. Gloo closes the connection on a
    // timeout, so the group is broken: the next operation fails at once here, and with an error on the peer (at once
    // too over shared memory, naming this rank).
    auto pg = comm::ProcessGroup::create("p2p", {}, {.timeout = std::chrono::milliseconds(1500)});
    std::string err;
    auto t = at::ones({4});
    if (rank == 0) {
      auto s = pg->recv(t, 1, 9).status();
      if (s.code() != absl::StatusCode::kDeadlineExceeded ||
          std::string(s.message()).find("recv from rank 1 (tag 9)") == std::string::npos) {
        err += "recv without a send: " + s.ToString() + "; ";
      }
      s = pg->allreduce(t).status();
      if (s.code() != absl::StatusCode::kFailedPrecondition ||
          std::string(s.message()).find("failed earlier") == std::string::npos) {
        err += "allreduce after the failed recv: " + s.ToString() + "; ";
      }
      throw_if_error(rpc::job_store().set("p2p_timeout/done", "1"));
    } else {
      throw_if_error(rpc::job_store().wait({"p2p_timeout/done"}, std::chrono::milliseconds(30000)));
      const absl::Status s = pg->allreduce(t).status();
      if (s.ok()) err += "allreduce with the broken peer succeeded; ";
      // Over shared memory the broken peer marked the segment: this rank fails at once, naming it (not
      // DEADLINE_EXCEEDED at its own deadline).
      if (std::string(pg->transport()) == "shared_memory" &&
          (s.code() != absl::StatusCode::kUnavailable ||
           std::string(s.message()).find("rank 0 (worker 'worker0') left the group") == std::string::npos)) {
        err += "allreduce with the peer whose group broke: " + s.ToString() + "; ";
      }
    }
    return err;
  }
  if (name == "shm_mismatch") {
    // Without debug mode, over shared memory: the last rank calls another operation, or passes another size or dtype;
    // every rank fails at the operation's first barrier (not at the deadline), naming that rank and both calls.
    std::string err;
    const int last = world - 1;
    auto expect_refused = [&](const std::string& group, auto&& call, const std::string& theirs,
                              const std::string& rank0s) {
      auto pg = comm::ProcessGroup::create(
          group, {}, {.timeout = std::chrono::milliseconds(20000), .shared_memory = comm::SharedMemory::kAlways});
      comm::wait(pg->barrier());
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status s = call(*pg).status();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::string m(s.message());
      if (s.code() != absl::StatusCode::kFailedPrecondition ||
          m.find("rank " + std::to_string(last) + " ") == std::string::npos || m.find(theirs) == std::string::npos ||
          m.find(rank0s) == std::string::npos || seconds > 10) {
        err += absl::StrCat(group, ": ", s.ToString(), " after ", seconds, " s; ");
      }
    };
    expect_refused(
        "mm_size", [&](comm::ProcessGroup& pg) { return pg.allreduce(at::ones({rank == last ? 5 : 4})); },
        "called allreduce of 5 Float elements (sum)", "called allreduce of 4 Float elements (sum)");
    expect_refused(
        "mm_op",
        [&](comm::ProcessGroup& pg) {
          at::Tensor x = at::ones({4});
          return rank == last ? pg.broadcast(x, 0) : pg.allreduce(x);
        },
        "called broadcast of 4 Float elements from rank 0", "called allreduce of 4 Float elements");
    expect_refused(
        "mm_empty", [&](comm::ProcessGroup& pg) { return pg.allreduce(at::ones({rank == last ? 0 : 4})); },
        "called allreduce of 0 Float elements", "called allreduce of 4 Float elements");
    expect_refused(
        "mm_dtype",
        [&](comm::ProcessGroup& pg) {
          return pg.allgather(at::zeros({world * 3}, rank == last ? at::kDouble : at::kFloat),
                              at::ones({3}, rank == last ? at::kDouble : at::kFloat));
        },
        "called allgather of 3 Double elements", "called allgather of 3 Float elements");
    expect_refused(
        "mm_shared",
        [&](comm::ProcessGroup& pg) -> rpc::Future {
          if (rank != last) return pg.allreduce(at::ones({4}));
          try {
            pg.shared_tensor(4, at::kFloat);
            return rpc::Future::ready(c10::IValue());
          } catch (const Error& e) {
            return rpc::Future::failed(e.status());
          }
        },
        "called shared_tensor of 4 Float elements", "called allreduce of 4 Float elements");
    return err;
  }
  if (name == "mismatch") {
    // Debug mode: rank 1 passes a tensor of another shape, then (in a new group) calls another collective.
    std::string err;
    auto pg = comm::ProcessGroup::create("debug", {}, {.timeout = std::chrono::milliseconds(10000), .debug = true});
    // By default on one host: the debug mode's report on the shared-memory path (issue 15).
    if (std::string(pg->transport()) != "shared_memory") return std::string("debug group on ") + pg->transport();
    auto ok = at::ones({4});
    comm::wait(pg->allreduce(ok));  // matching calls pass
    auto t = at::ones({rank == 1 ? 5 : 4});
    try {
      comm::wait(pg->allreduce(t));
      err += "a shape mismatch went through; ";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (m.find("rank 1 called allreduce(Float[5]") == std::string::npos ||
          m.find("rank 0 called allreduce(Float[4]") == std::string::npos) {
        err += "shape mismatch report: " + m + "; ";
      }
    }
    auto pg2 = comm::ProcessGroup::create("debug2", {}, {.timeout = std::chrono::milliseconds(10000), .debug = true});
    try {
      auto x = at::ones({4});
      comm::wait(rank == world - 1 ? pg2->broadcast(x, 0) : pg2->allreduce(x));
      err += "an operation mismatch went through; ";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (m.find("rank " + std::to_string(world - 1) + " called broadcast(") == std::string::npos) {
        err += "operation mismatch report: " + m + "; ";
      }
    }
    // Shapes that differ only past the fourth dimension (before, the fingerprint held the first four sizes).
    auto pg3 = comm::ProcessGroup::create("debug3", {}, {.timeout = std::chrono::milliseconds(10000), .debug = true});
    try {
      auto x = at::ones({1, 1, 1, 1, rank == 1 ? 5 : 4});
      comm::wait(pg3->allreduce(x));
      err += "a mismatch in the fifth dimension went through; ";
    } catch (const RpcError& e) {
      const std::string m = e.what();
      if (m.find("rank 1 called allreduce(Float[1, 1, 1, 1, ... (5 dimensions") == std::string::npos) {
        err += "fifth-dimension mismatch report: " + m + "; ";
      }
    }
    return err;
  }
  return "unknown scenario " + name;
}

}  // namespace

void register_scenarios() { register_scenario_runner(run); }

}  // namespace tandem::test
