#include "tests/comm/scenarios.h"

#include "tests/common/scenario.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "rpc/errors.h"
#include "rpc/registry.h"
#include "rpc/rpc.h"
#include "rpc/store.h"

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

std::string run(const std::string& name) {
  const int rank = rpc::get_worker_info().id;
  const int world = static_cast<int>(rpc::get_all_worker_infos().size());
  if (name == "basic") return basic(comm::ProcessGroup::create("basic"));
  if (name == "subgroup") {
    // Ranks 0 and 2 of 3 form a group of their own; rank 1 is not in it.
    if (rank == 1) return "";
    auto pg = comm::ProcessGroup::create("pair", {0, 2});
    if (pg->size() != 2 || pg->rank() != (rank == 0 ? 0 : 1)) return "subgroup ranks wrong";
    return basic(pg);
  }
  if (name == "dead_rank") {
    // The last rank dies before the allreduce: the others get an error within the group's timeout.
    auto pg = comm::ProcessGroup::create("dead", {}, {.timeout = std::chrono::milliseconds(3000)});
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
    }
    try {
      comm::wait(pg->barrier());
      return "a failed group kept working";
    } catch (const RpcError&) {
    }
    return "";
  }
  if (name == "p2p_timeout") {
    // A recv whose send never comes fails within the timeout, naming the peer. Gloo closes the connection on a
    // timeout, so the group is broken: the next operation fails at once here, and with an error on the peer.
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
      if (pg->allreduce(t).status().ok()) err += "allreduce with the broken peer succeeded; ";
    }
    return err;
  }
  if (name == "mismatch") {
    // Debug mode: rank 1 passes a tensor of another shape, then (in a new group) calls another collective.
    std::string err;
    auto pg = comm::ProcessGroup::create("debug", {}, {.timeout = std::chrono::milliseconds(10000), .debug = true});
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
    return err;
  }
  return "unknown scenario " + name;
}

}  // namespace

void register_scenarios() { register_scenario_runner(run); }

}  // namespace tandem::test
