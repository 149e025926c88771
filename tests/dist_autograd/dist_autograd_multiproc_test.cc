// Distributed autograd across real processes: the test process is rank 0, ranks 1.. are `--worker serve` children.
// Every split model is rebuilt in one process with local autograd; the gradients must match (1e-6).
#include <ATen/ATen.h>
#include <gmock/gmock.h>

#include <atomic>
#include <thread>

#include "tandem/dist_autograd/dist_autograd.h"
#include "tandem/rref/rref.h"
#include "tests/common/params.h"
#include "tests/common/rpc_fixture.h"

namespace tandem::test {
namespace {

// A leaf copy of parameter `name` for the local reference computation.
at::Tensor local(const std::string& name) { return param(name, 4, 4).detach().clone().set_requires_grad(true); }

at::Tensor input() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  return at::randn({3, 4}, gen, at::kDouble);
}

// The gradient worker `rank` accumulated for its parameter `name` in context `ctx`.
at::Tensor remote_grad(int rank, int64_t ctx, const std::string& name) {
  auto [found, g] = rpc::rpc_sync<std::tuple<bool, at::Tensor>>(rank, "grad_of", ctx, name);
  EXPECT_TRUE(found) << "no gradient for " << name << " on rank " << rank;
  return g;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_TRUE(want.defined()) << what;
  EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6)) << what << "\ngot\n" << got << "\nwant\n" << want;
}

class MultiprocDistAutograd : public MultiprocRpc {
 protected:
  static int64_t contexts_on(int rank) { return rpc::rpc_sync<int64_t>(rank, "contexts"); }
  // Waits (bounded) until no worker holds a context; returns the counts last seen otherwise.
  static std::string wait_no_contexts(int world) {
    const auto deadline = Clock::now() + scaled(milliseconds(20000));
    std::string last;
    for (;;) {
      bool zero = true;
      last.clear();
      for (int r = 0; r < world; ++r) {
        const int64_t n = contexts_on(r);
        zero &= n == 0;
        last += "rank " + std::to_string(r) + ": " + std::to_string(n) + " ";
      }
      if (zero || Clock::now() > deadline) return zero ? "" : last;
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
};

TEST_F(MultiprocDistAutograd, MlpChainAcrossTwoWorkers) {
  start({.world_size = 2});
  at::Tensor x = input();
  at::Tensor w0 = param("a0", 4, 4), w2 = param("a2", 4, 4);
  dist_autograd::ContextGuard ctx;
  at::Tensor h = at::tanh(x.mm(w0));
  at::Tensor h1 = rpc::rpc_sync<at::Tensor>("worker1", "layer", "a1", h);
  EXPECT_TRUE(h1.requires_grad());
  at::Tensor loss = h1.mm(w2).pow(2).sum();
  dist_autograd::backward(ctx.id(), {loss});
  auto grads = dist_autograd::get_gradients(ctx.id());
  EXPECT_EQ(grads.size(), 2u);
  EXPECT_FALSE(w0.grad().defined()) << "distributed gradients must not land in .grad";

  at::Tensor l0 = local("a0"), l1 = local("a1"), l2 = local("a2");
  at::tanh(at::tanh(x.mm(l0)).mm(l1)).mm(l2).pow(2).sum().backward();
  expect_close(grads[w0], l0.grad(), "a0");
  expect_close(grads[w2], l2.grad(), "a2");
  expect_close(remote_grad(1, ctx.id(), "a1"), l1.grad(), "a1 on worker1");
}

TEST_F(MultiprocDistAutograd, NestedCallsThreeHops) {
  start({.world_size = 3});
  at::Tensor x = input().set_requires_grad(true);
  dist_autograd::ContextGuard ctx;
  // worker0 -> worker1 ("b1") -> worker2 ("b2") -> back through worker1 (* 2) -> worker0
  at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "nested", "worker2", "b1", "b2", x);
  dist_autograd::backward(ctx.id(), {y.sum()});

  at::Tensor lx = input().set_requires_grad(true), l1 = local("b1"), l2 = local("b2");
  (at::tanh(at::tanh(lx.mm(l1)).mm(l2)) * 2).sum().backward();
  expect_close(dist_autograd::get_gradients(ctx.id())[x], lx.grad(), "input x");
  expect_close(remote_grad(1, ctx.id(), "b1"), l1.grad(), "b1 on worker1");
  expect_close(remote_grad(2, ctx.id(), "b2"), l2.grad(), "b2 on worker2");
}

TEST_F(MultiprocDistAutograd, FanOutFanInAndAParameterUsedOnSeveralWorkers) {
  start({.world_size = 3});
  at::Tensor x = input();
  at::Tensor w = param("shared", 4, 4);  // lives here, used on worker1 and worker2
  dist_autograd::ContextGuard ctx;
  rpc::Future f1 = rpc::rpc_async("worker1", "mix", "c1", x, w);
  rpc::Future f2 = rpc::rpc_async("worker2", "mix", "c2", x, w);
  at::Tensor y = f1.get<at::Tensor>() * f2.get<at::Tensor>() + x.mm(w);
  dist_autograd::backward(ctx.id(), {y.sum()});

  at::Tensor lw = local("shared"), l1 = local("c1"), l2 = local("c2");
  auto mix = [&](const at::Tensor& p) { return at::sigmoid(x.mm(lw) + x.mm(p)); };
  (mix(l1) * mix(l2) + x.mm(lw)).sum().backward();
  expect_close(dist_autograd::get_gradients(ctx.id())[w], lw.grad(), "shared parameter (three uses)");
  expect_close(remote_grad(1, ctx.id(), "c1"), l1.grad(), "c1 on worker1");
  expect_close(remote_grad(2, ctx.id(), "c2"), l2.grad(), "c2 on worker2");
}

TEST_F(MultiprocDistAutograd, RecurrentLoopOverRpcAndASharedParameterUsedTwice) {
  start({.world_size = 3});
  at::Tensor x = input();
  at::Tensor u = param("r0", 4, 4);
  dist_autograd::ContextGuard ctx;
  at::Tensor h = x;
  for (int t = 0; t < 4; ++t) {
    h = at::tanh(h.mm(u));                                                                // here
    h = rpc::rpc_sync<at::Tensor>(t % 2 == 0 ? "worker1" : "worker2", "layer", "rr", h);  // "rr" on both, twice each
  }
  dist_autograd::backward(ctx.id(), {h.pow(2).sum()});

  at::Tensor lu = local("r0"), lr1 = local("rr"), lr2 = local("rr");
  at::Tensor lh = x;
  for (int t = 0; t < 4; ++t) lh = at::tanh(at::tanh(lh.mm(lu)).mm(t % 2 == 0 ? lr1 : lr2));
  lh.pow(2).sum().backward();
  expect_close(dist_autograd::get_gradients(ctx.id())[u], lu.grad(), "r0 (four steps)");
  expect_close(remote_grad(1, ctx.id(), "rr"), lr1.grad(), "rr on worker1 (two steps)");
  expect_close(remote_grad(2, ctx.id(), "rr"), lr2.grad(), "rr on worker2 (two steps)");
}

TEST_F(MultiprocDistAutograd, ThroughRRefsRemoteAndToHere) {
  start({.world_size = 3});
  at::Tensor x = input().set_requires_grad(true);
  dist_autograd::ContextGuard ctx;
  // The result stays on worker1; worker2 fetches nothing; we fetch it here (a send on worker1, a recv here).
  rref::RRef r = rref::remote("worker1", "layer", "d1", x);
  at::Tensor h = r.to_here<at::Tensor>();
  at::Tensor y = rpc::rpc_sync<at::Tensor>("worker2", "layer", "d2", h);
  dist_autograd::backward(ctx.id(), {y.sum()});

  at::Tensor lx = input().set_requires_grad(true), l1 = local("d1"), l2 = local("d2");
  at::tanh(at::tanh(lx.mm(l1)).mm(l2)).sum().backward();
  expect_close(dist_autograd::get_gradients(ctx.id())[x], lx.grad(), "x");
  expect_close(remote_grad(1, ctx.id(), "d1"), l1.grad(), "d1 on worker1 (via the RRef)");
  expect_close(remote_grad(2, ctx.id(), "d2"), l2.grad(), "d2 on worker2");
}

TEST_F(MultiprocDistAutograd, ConcurrentContextsDoNotMix) {
  start({.world_size = 2});
  at::Tensor x = input();
  auto run = [&](double scale) {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "layer", "e1", x * scale);
    dist_autograd::backward(ctx.id(), {y.sum()});
    return remote_grad(1, ctx.id(), "e1");
  };
  std::vector<at::Tensor> got(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) threads.emplace_back([&, i] { got[i] = run(1.0 + i); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    at::Tensor l1 = local("e1");
    at::tanh((x * (1.0 + i)).mm(l1)).sum().backward();
    expect_close(got[i], l1.grad(), "e1 in context " + std::to_string(i));
  }
}

TEST_F(MultiprocDistAutograd, TenThousandContextsLeaveNoneBehind) {
  start({.world_size = 3});
  at::Tensor x = input().set_requires_grad(true);
  for (int i = 0; i < 10000; ++i) {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = rpc::rpc_sync<at::Tensor>(i % 2 ? "worker1" : "worker2", "nested", i % 2 ? "worker2" : "worker1",
                                             "f1", "f2", x);
    if (i % 500 == 0) dist_autograd::backward(ctx.id(), {y.sum()});
  }
  EXPECT_EQ(wait_no_contexts(3), "");
  EXPECT_EQ(dist_autograd::stats().failed_releases, 0);
}

// A worker's backward-part hook runs once its part of the pass is done (its gradients are in the context), and the
// caller's backward waits for the hook's future; the future's error, or what the hook throws, fails the backward.
TEST_F(MultiprocDistAutograd, ABackwardPartHookRunsWhenThePartIsDoneAndTheBackwardWaitsForIt) {
  start({.world_size = 2});
  // A forward through worker1's layer (in the current context).
  auto through_worker1 = [] { return rpc::rpc_sync<at::Tensor>("worker1", "layer", "k1", input()); };
  auto hooked = [] { return rpc::rpc_sync<std::vector<int64_t>>("worker1", "hooked"); };
  // Runs a backward through worker1's layer on a thread; returns once worker1's hook has seen context `id` (bounded).
  auto until_hooked = [&](int64_t id) {
    const auto deadline = Clock::now() + scaled(milliseconds(20000));
    while (Clock::now() < deadline) {
      for (int64_t c : hooked()) {
        if (c == id || c == -id) return c;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    ADD_FAILURE() << "the hook never saw context " << id;
    return int64_t{0};
  };
  rpc::rpc_sync("worker1", "set_hook", std::string("hold"));
  for (bool ok : {true, false}) {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = through_worker1();
    std::atomic<bool> returned{false};
    std::string error;
    std::thread pass([&] {
      try {
        dist_autograd::backward(ctx.id(), {y.sum()});
      } catch (const std::exception& e) {
        error = e.what();
      }
      returned = true;
    });
    EXPECT_EQ(until_hooked(ctx.id()), ctx.id()) << "the hook ran before this part's gradient was in the context";
    EXPECT_FALSE(returned) << "backward returned while the hook's future was pending";
    rpc::rpc_sync("worker1", "release_hook", ok);
    pass.join();
    if (ok) {
      EXPECT_EQ(error, "");
    } else {
      EXPECT_THAT(error, testing::HasSubstr("the round was refused"));
    }
  }
  rpc::rpc_sync("worker1", "set_hook", std::string("throw"));
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = through_worker1();
    try {
      dist_autograd::backward(ctx.id(), {y.sum()});
      ADD_FAILURE() << "backward succeeded";
    } catch (const RpcError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("hook refused"));
      EXPECT_THAT(e.what(), testing::HasSubstr("backward hook on worker 'worker1'"));
    }
  }
  rpc::rpc_sync("worker1", "set_hook", std::string("none"));
  const size_t seen = hooked().size();
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = through_worker1();
    dist_autograd::backward(ctx.id(), {y.sum()});
  }
  EXPECT_EQ(hooked().size(), seen);
}

// The backward's timeout holds on every hop: worker1's gradient message to worker2, whose part takes longer than the
// RPC timeout, waits for it as long as the backward may take (before, it failed at rpc_timeout).
TEST_F(MultiprocDistAutograd, TheBackwardsTimeoutHoldsForEveryHop) {
  const auto rpc_timeout = scaled(milliseconds(1500));
  rpc::RpcOptions options = options_from_env();
  options.rpc_timeout = rpc_timeout;
  start({.world_size = 3, .extra_env = {{"TANDEM_TEST_RPC_MS", std::to_string(rpc_timeout.count())}}}, options);
  dist_autograd::ContextGuard ctx;
  at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "nested_slow", std::string("worker2"), std::string("t1"),
                                           std::string("t2"), int64_t{2 * rpc_timeout.count()}, input());
  dist_autograd::backward(ctx.id(), {y.sum()}, false, 4 * rpc_timeout + scaled(milliseconds(10000)));
  EXPECT_TRUE(
      std::get<0>(rpc::rpc_sync<std::tuple<bool, at::Tensor>>("worker2", "grad_of", ctx.id(), std::string("t2"))));
}

// A call still running on its callee when its context is released there: its reply does not make the context again
// on the callee (nobody would release it). The input requires grad, so the request makes the context on worker1 when
// it arrives; the guard ends once the call runs there and has seen it (a release that came between the request's
// arrival and the call's start would leave the call without its context: it failed so once in CI).
TEST_F(MultiprocDistAutograd, AReplyAfterItsContextWasReleasedDoesNotBringItBack) {
  start({.world_size = 2});
  rpc::Future reply;
  {
    dist_autograd::ContextGuard ctx;
    reply = rpc::rpc_async("worker1", "layer_after_release", std::string("r1"), input().set_requires_grad(true));
    const auto deadline = Clock::now() + scaled(milliseconds(20000));
    // (A call that ended already, with an error, says why below.)
    while (rpc::rpc_sync<int64_t>(1, "after_release_started") == 0 && !reply.wait_for(milliseconds(0))) {
      ASSERT_LT(Clock::now(), deadline) << "the call never ran with its context on worker1";
      std::this_thread::sleep_for(milliseconds(2));
    }
  }  // released here and on worker1, where the call waits for that before it computes
  ASSERT_TRUE(reply.wait_for(scaled(milliseconds(60000))));
  ASSERT_TRUE(reply.status().ok()) << reply.status();
  EXPECT_EQ(contexts_on(1), 0);
}

TEST_F(MultiprocDistAutograd, AnErrorInARemoteBackwardReachesTheCaller) {
  start({.world_size = 3});
  at::Tensor x = input().set_requires_grad(true);
  dist_autograd::ContextGuard ctx;
  at::Tensor a = rpc::rpc_sync<at::Tensor>("worker1", "fails_in_backward", x);
  at::Tensor b = rpc::rpc_sync<at::Tensor>("worker2", "layer", "g2", a);
  try {
    dist_autograd::backward(ctx.id(), {b.sum()});
    FAIL() << "backward succeeded";
  } catch (const RpcError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("boom in a remote backward"));
    EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
  }
  // The worker stays usable.
  dist_autograd::ContextGuard again;
  at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "layer", "g1", x);
  dist_autograd::backward(again.id(), {y.sum()});
  EXPECT_TRUE(dist_autograd::get_gradients(again.id())[x].defined());
}

TEST_F(MultiprocDistAutograd, AWorkerDyingMidBackwardIsAnErrorNotAHang) {
  start({.world_size = 2});
  expect_clean_children_ = false;
  at::Tensor x = input().set_requires_grad(true);
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "dies_in_backward", x);
    const auto t0 = Clock::now();
    try {
      dist_autograd::backward(ctx.id(), {y.sum()});
      FAIL() << "backward succeeded";
    } catch (const RpcError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("worker1"));
    }
    EXPECT_LT(Clock::now() - t0, scaled(milliseconds(30000)));
  }
  rpc::shutdown(false);
  for (int code : job_->wait_children(milliseconds(30000))) EXPECT_EQ(code, 7);
}

TEST_F(MultiprocDistAutograd, UnknownContextAndBadRootsAreErrors) {
  start({.world_size = 2});
  EXPECT_THROW(dist_autograd::get_gradients(12345), RpcError);
  EXPECT_THROW(dist_autograd::backward(12345, {at::ones({1}).set_requires_grad(true)}), RpcError);
  dist_autograd::ContextGuard ctx;
  EXPECT_THROW(dist_autograd::backward(ctx.id(), {at::ones({1})}), RpcError);  // does not require grad
  EXPECT_EQ(dist_autograd::current_context(), ctx.id());
}

// A context adopted while serving a call takes gradients from another thread of that worker, and goes with the
// caller's release; adopting outside a call is FAILED_PRECONDITION.
TEST_F(MultiprocDistAutograd, AnAdoptedContextTakesGradientsFromAnyThreadAndGoesWithTheCaller) {
  start({.world_size = 2});
  EXPECT_THROW(dist_autograd::adopt_current_context(), RpcError);
  {
    dist_autograd::ContextGuard ctx;
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "adopt_and_add", std::string("pa")),
              static_cast<int64_t>(absl::StatusCode::kFailedPrecondition));
    auto [known, g] = rpc::rpc_sync<std::tuple<bool, at::Tensor>>("worker1", "grad_of", ctx.id(), std::string("pa"));
    EXPECT_TRUE(known);
    EXPECT_TRUE(g.equal(at::ones({4, 4}, at::kDouble)));
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts"), 1);
  }
  const auto deadline = Clock::now() + scaled(milliseconds(5000));
  while (rpc::rpc_sync<int64_t>("worker1", "contexts") != 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts"), 0);
}

// Work sent without a call (a pipeline step through shared memory) adopts the sender's context; after the context's
// release reached this worker, adopting it is NOT_FOUND: it is not brought back for nobody to release.
TEST_F(MultiprocDistAutograd, AContextAdoptedAfterItsReleaseIsRefused) {
  start({.world_size = 2});
  int64_t id = -1;
  {
    dist_autograd::ContextGuard ctx;
    id = ctx.id();
    dist_autograd::adopt_context(id, 1);  // known here: taken as is
    EXPECT_EQ(dist_autograd::stats().contexts, 1);
  }
  try {
    dist_autograd::adopt_context(id, 1);
    ADD_FAILURE() << "a released context was adopted";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find("was released"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dist_autograd::stats().contexts, 0);
  EXPECT_EQ(wait_no_contexts(2), "");
}

}  // namespace
}  // namespace tandem::test

namespace tandem::test {
namespace {

TEST_F(MultiprocDistAutograd, MalformedAutogradRecordsGetErrorRepliesAndTheWorkerSurvives) {
  start({.world_size = 2});
  pb::Request request;  // layer("a1", <4x4 double tensor>), with a hand-made autograd record
  request.set_function("layer");
  request.mutable_args()->add_values()->set_s("h1");
  request.mutable_args()->add_values()->set_tensor(0);
  auto* meta = request.mutable_args()->add_tensors();
  meta->set_dtype(static_cast<int>(at::kDouble));
  meta->add_sizes(1);
  meta->add_sizes(4);
  meta->set_nbytes(32);
  const std::string bytes(32, '\0');
  // An AutogradTrace (proto/tandem_rpc.proto): context 5, send 7 of the tensors at `indices`.
  auto trace = [](int64_t context, int64_t send, std::vector<uint32_t> indices, bool has_send = true) {
    tandem::wire::AutogradTrace t;
    t.set_context_id(context);
    t.set_has_send(has_send);
    t.set_send_id(send);
    for (uint32_t i : indices) t.add_tensor_indices(i);
    return t.SerializeAsString();
  };
  const std::vector<std::pair<std::string, std::string>> bad = {{"does not parse", "\xff\xff\xff"},
                                                                {"a send without tensors", trace(5, 7, {})},
                                                                {"index out of range", trace(5, 7, {1})},
                                                                {"an index twice", trace(5, 7, {0, 0})},
                                                                {"negative send id", trace(5, -7, {0})},
                                                                {"negative context", trace(-5, 7, {0})},
                                                                {"indices without a send", trace(5, 0, {0}, false)}};
  for (const auto& [what, record] : bad) {
    request.set_trace(record);
    absl::Status s = raw_error(1, make_frame(request, bytes));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
  }
  meta->set_dtype(static_cast<int>(at::kLong));  // an integer tensor cannot require grad
  request.set_trace(trace(5, 7, {0}));
  EXPECT_EQ(raw_error(1, make_frame(request, bytes)).code(), absl::StatusCode::kInvalidArgument);
  meta->set_dtype(static_cast<int>(at::kDouble));
  request.set_trace(trace(5, 7, {0}));  // well formed: accepted, and the call runs
  EXPECT_TRUE(raw_error(1, make_frame(request, bytes)).ok());
  // Releasing the context the record created there leaves the worker clean and serving.
  (void)rpc::rpc_sync(1, "__tandem.dist_autograd.release", std::vector<int64_t>{5});
  EXPECT_EQ(wait_no_contexts(2), "");
}

}  // namespace
}  // namespace tandem::test

namespace tandem::test {
namespace {

// Faults between the workers (rpc/fault_injection.h) during backward: each ends in the documented error or is
// recovered, and every context is released.
class MultiprocDistAutogradFaults : public MultiprocDistAutograd {
 protected:
  void start_with(const std::string& mine, const std::string& theirs) {
    rpc::RpcOptions options = options_from_env();
    if (!mine.empty()) options.faults = rpc::parse_faults(mine).value();
    JobSpec spec{.world_size = 2};
    if (!theirs.empty()) spec.extra_env["TANDEM_TEST_FAULTS"] = theirs;
    start(spec, options);
  }
  // The chain of MlpChainAcrossTwoWorkers; returns the gradient of a0 here, of a1 on worker1.
  static std::pair<at::Tensor, at::Tensor> chain_grads(int64_t ctx, milliseconds timeout = milliseconds(0)) {
    at::Tensor w0 = param("f0", 4, 4), w2 = param("f2", 4, 4);
    at::Tensor h = at::tanh(input().mm(w0));
    at::Tensor h1 = rpc::rpc_sync<at::Tensor>("worker1", "layer", "f1", h);
    dist_autograd::backward(ctx, {h1.mm(w2).pow(2).sum()}, false, timeout);
    return {dist_autograd::get_gradients(ctx)[w0], remote_grad(1, ctx, "f1")};
  }
};

TEST_F(MultiprocDistAutogradFaults, DuplicatedGradientMessagesAreCountedOnce) {
  // Every gradient message, both ways, arrives twice.
  start_with("duplicate worker0->worker1 request fn=__tandem.dist_autograd.grad count=0",
             "duplicate worker1->worker0 request fn=__tandem.dist_autograd.grad count=0");
  at::Tensor l0 = local("f0"), l1 = local("f1"), l2 = local("f2");
  at::tanh(at::tanh(input().mm(l0)).mm(l1)).mm(l2).pow(2).sum().backward();
  for (int step = 0; step < 3; ++step) {
    dist_autograd::ContextGuard ctx;
    auto [g0, g1] = chain_grads(ctx.id());
    expect_close(g0, l0.grad(), "f0");
    expect_close(g1, l1.grad(), "f1 on worker1");
  }
  EXPECT_EQ(wait_no_contexts(2), "");
}

TEST_F(MultiprocDistAutogradFaults, GradientMessageCutMidTensorFailsTheBackwardAndTheNextOneWorks) {
  start_with("cut worker0->worker1 request fn=__tandem.dist_autograd.grad nth=1", "");
  {
    dist_autograd::ContextGuard ctx;
    expect_error([&] { chain_grads(ctx.id()); }, absl::StatusCode::kUnavailable, {"worker1"});
  }
  {
    dist_autograd::ContextGuard ctx;
    at::Tensor l0 = local("f0"), l1 = local("f1"), l2 = local("f2");
    at::tanh(at::tanh(input().mm(l0)).mm(l1)).mm(l2).pow(2).sum().backward();
    auto [g0, g1] = chain_grads(ctx.id());
    expect_close(g0, l0.grad(), "f0");
  }
  EXPECT_EQ(wait_no_contexts(2), "");
}

// A release that a worker passes on does not wait behind another one in flight to the same worker: worker1's forward
// of context X's release to worker2 is held for `held`; context Y, made on worker3 through worker1 to worker2, is
// released meanwhile, and worker1 forwards it at once (before, behind X's: each handler's reply waits for its
// forwards, so around a ring of workers releases waited on themselves until their RPC timeouts).
TEST_F(MultiprocDistAutogradFaults, AForwardedReleaseDoesNotWaitBehindAnotherInFlight) {
  const auto held = scaled(milliseconds(2000));
  JobSpec spec{.world_size = 4};
  spec.extra_env["TANDEM_TEST_FAULTS"] =
      "delay worker1->worker2 request fn=__tandem.dist_autograd.release nth=1 ms=" + std::to_string(held.count());
  start(spec, options_from_env());
  {
    dist_autograd::ContextGuard x;
    rpc::rpc_sync<at::Tensor>("worker1", "nested", std::string("worker2"), std::string("x1"), std::string("x2"),
                              input());
  }
  const auto deadline = Clock::now() + scaled(milliseconds(20000));
  // X's forward sent (and so the one held) before Y's: worker1 sends no release messages of its own.
  while (rpc::rpc_sync<int64_t>("worker1", "release_messages_sent") == 0) {
    ASSERT_LT(Clock::now(), deadline) << "worker1 never passed X's release on";
    std::this_thread::sleep_for(milliseconds(2));
  }
  const auto y_ms =
      rpc::rpc_sync<int64_t>("worker3", "nested_then_release", std::string("worker1"), std::string("worker2"));
  EXPECT_LT(y_ms, held.count() / 2) << "Y's release waited behind X's";
  EXPECT_EQ(wait_no_contexts(4), "");
}

TEST_F(MultiprocDistAutogradFaults, GradientReplyThatNeverComesFailsAtTheBackwardsTimeout) {
  start_with("", "drop worker1->worker0 reply fn=__tandem.dist_autograd.grad nth=1");
  {
    dist_autograd::ContextGuard ctx;
    expect_error([&] { chain_grads(ctx.id(), milliseconds(1000)); }, absl::StatusCode::kDeadlineExceeded, {"worker1"});
  }
  {
    dist_autograd::ContextGuard ctx;
    EXPECT_TRUE(chain_grads(ctx.id()).first.defined());
  }
  EXPECT_EQ(wait_no_contexts(2), "");
}

}  // namespace
}  // namespace tandem::test
