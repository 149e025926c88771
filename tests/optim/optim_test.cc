// ChunkedAdam equals torch::optim::Adam exactly: parameters and moments after several steps, for every option, every
// chunking (one element short of, equal to and past a chunk; a tensor of one chunk; several), float and double, one
// intra-op thread and two (where Adam's whole tensor is split between the threads mid-vector and the chunks are not),
// contiguous parameters and not.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include <ostream>
#include <string>
#include <vector>

#include "tandem/optim/adam.h"

namespace {

using tandem::optim::ChunkedAdam;
using torch::optim::Adam;
using torch::optim::AdamOptions;
using torch::optim::AdamParamState;

struct Case {
  AdamOptions options;
  at::ScalarType dtype;
  int threads;
  std::string name;
};

// Parameters of several sizes (around the chunk, 64 elements here; one large enough for LibTorch to split Adam's whole
// tensor between two threads at element 50002, in the middle of a vector), one not contiguous (a transposed view),
// one that gets no gradient.
std::vector<at::Tensor> make_params(at::ScalarType dtype) {
  at::manual_seed(7);
  std::vector<at::Tensor> out;
  for (int64_t n : {1, 63, 64, 65, 200, 1000, 100003}) out.push_back(at::randn({n}, at::dtype(dtype)));
  out.push_back(at::randn({7, 9}, at::dtype(dtype)).t());
  out.push_back(at::randn({5}, at::dtype(dtype)));  // no gradient
  for (auto& p : out) p.requires_grad_(true);
  return out;
}

void set_grads(std::vector<at::Tensor>& params, int step) {
  at::manual_seed(100 + step);
  for (size_t i = 0; i + 1 < params.size(); ++i) {
    params[i].mutable_grad() = at::randn(params[i].sizes(), params[i].options().requires_grad(false));
  }
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class UnitChunkedAdam : public ::testing::TestWithParam<Case> {};

TEST_P(UnitChunkedAdam, EqualsLibTorchsAdamExactly) {
  const Case& c = GetParam();
  const int threads_before = at::get_num_threads();
  at::set_num_threads(c.threads);
  std::vector<at::Tensor> a = make_params(c.dtype), b = make_params(c.dtype);
  Adam reference(a, c.options);
  ChunkedAdam chunked(b, c.options, /*chunk_elements=*/64);
  for (int step = 0; step < 4; ++step) {
    set_grads(a, step);
    set_grads(b, step);
    reference.step();
    chunked.step();
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i << " max diff " << (a[i] - b[i]).abs().max().item<double>();
    const auto key_a = c10::guts::to_string(a[i].unsafeGetTensorImpl());
    const auto key_b = c10::guts::to_string(b[i].unsafeGetTensorImpl());
    const bool has = reference.state().count(key_a) > 0;
    ASSERT_EQ(has, chunked.state().count(key_b) > 0) << "parameter " << i;
    if (!has) continue;
    const auto& sa = static_cast<const AdamParamState&>(*reference.state().at(key_a));
    const auto& sb = static_cast<const AdamParamState&>(*chunked.state().at(key_b));
    EXPECT_EQ(sa.step(), sb.step());
    EXPECT_TRUE(at::equal(sa.exp_avg(), sb.exp_avg())) << "parameter " << i;
    EXPECT_TRUE(at::equal(sa.exp_avg_sq(), sb.exp_avg_sq())) << "parameter " << i;
    if (c.options.amsgrad()) EXPECT_TRUE(at::equal(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())) << "parameter " << i;
  }
  at::set_num_threads(threads_before);
}

INSTANTIATE_TEST_SUITE_P(
    UnitOptim, UnitChunkedAdam,
    ::testing::Values(Case{AdamOptions(1e-2), at::kFloat, 1, "float"},
                      Case{AdamOptions(1e-2), at::kDouble, 1, "double"},
                      Case{AdamOptions(1e-2).weight_decay(0.1), at::kFloat, 1, "weight_decay"},
                      Case{AdamOptions(1e-2).amsgrad(true), at::kFloat, 1, "amsgrad"},
                      Case{AdamOptions(3e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.01).amsgrad(true), at::kDouble,
                           1, "all_double"},
                      Case{AdamOptions(1e-2).weight_decay(0.1).amsgrad(true), at::kFloat, 2, "two_threads"},
                      Case{AdamOptions(1e-2).weight_decay(0.1).amsgrad(true), at::kDouble, 2, "two_threads_double"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The default chunk on a parameter several chunks long, as fsdp's shards are.
TEST(UnitChunkedAdamLarge, EqualsAdamOnSeveralDefaultChunks) {
  at::manual_seed(3);
  at::Tensor a = at::randn({3 * ChunkedAdam::kDefaultChunkElements + 100}).requires_grad_(true);
  at::Tensor b = a.detach().clone().requires_grad_(true);
  Adam reference({a}, AdamOptions(1e-3));
  ChunkedAdam chunked({b}, AdamOptions(1e-3));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g = at::randn(a.sizes());
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    reference.step();
    chunked.step();
  }
  EXPECT_TRUE(at::equal(a, b));
}

TEST(UnitChunkedAdamOptions, RefusesAChunkThatIsNotAMultipleOf64) {
  at::Tensor p = at::zeros({4}).requires_grad_(true);
  EXPECT_THROW(ChunkedAdam({p}, AdamOptions(), 100), c10::Error);
  EXPECT_THROW(ChunkedAdam({p}, AdamOptions(), 0), c10::Error);
}

}  // namespace
