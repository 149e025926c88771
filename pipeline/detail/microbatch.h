// Micro-batches: a batch split along its first dimension for the schedule, the outputs merged back, and the structured
// values (a tensor, or tuples and lists of tensors and other values) that micro-batches and activations carry.
//
// Thread-safety: pure functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace tandem::pipeline::detail {

// `batch` in `m` parts along dimension 0, as torch.tensor_split: sizes differ by at most one row, the first ones the
// larger. Views, not copies. The caller checks that there are at least m rows.
std::vector<at::Tensor> split_batch(const at::Tensor& batch, int64_t m);
// Each part's number of rows.
std::vector<int64_t> sizes_of(const std::vector<at::Tensor>& parts);
// The parts concatenated along dimension 0 (the batch's order).
at::Tensor merge_batch(const std::vector<at::Tensor>& parts);

// A stage's arguments: the model's inputs (first stage), or what the previous stage returned (a tuple is its
// elements, anything else one argument).
using Args = std::vector<c10::IValue>;
Args args_of(c10::IValue output);

// The model's inputs split into `m` micro-batches, as PyTorch's split_args_kwargs_into_chunks with its default
// TensorChunkSpec: every tensor, also inside tuples and lists, split along dimension 0 by split_batch (so all of them
// must have the batch's rows); other values (a scalar, a string, a config), and the inputs marked in `replicate`,
// whole in every micro-batch. Returns each micro-batch's arguments; `*rows` gets the batch's rows. Throws
// tandem::Error (INVALID_ARGUMENT) naming the input: no tensor to split, an undefined tensor or one without a batch
// dimension, batch sizes that differ, fewer rows than m, tensors inside a dict, `replicate` of another length.
std::vector<Args> split_inputs(const Args& inputs, const std::vector<bool>& replicate, int64_t m, int64_t* rows);

// Whether `v` holds a tensor inside a dict (dicts are neither split nor given gradients: refused where they come in).
bool tensors_in_dict(const c10::IValue& v);
// The tensors of `v` (a tensor, or tuples and lists of values; dicts and other values hold none here), depth first.
std::vector<at::Tensor> tensors_of(const c10::IValue& v);
std::vector<at::Tensor> tensors_of(const Args& args);
// `v` with each of its tensors (in tensors_of's order) replaced by f(tensor); tuples and lists rebuilt.
c10::IValue map_tensors(const c10::IValue& v, const std::function<at::Tensor(const at::Tensor&)>& f);

}  // namespace tandem::pipeline::detail
