#include "tandem/pipeline/detail/microbatch.h"

#include <ATen/ATen.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "tandem/pipeline/detail/common.h"

namespace tandem::pipeline::detail {

std::vector<at::Tensor> split_batch(const at::Tensor& batch, int64_t m) {
  if (batch.requires_grad()) return at::tensor_split(batch, m);
  // Nothing for autograd to record: the views are made below it (the driver's split of a step's input and target
  // into 8 micro-batches took 40 us here through autograd's dispatch, 12-24 below it).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return at::tensor_split(batch, m);
}

std::vector<int64_t> sizes_of(const std::vector<at::Tensor>& parts) {
  std::vector<int64_t> sizes;
  sizes.reserve(parts.size());
  for (const auto& p : parts) sizes.push_back(p.size(0));
  return sizes;
}

at::Tensor merge_batch(const std::vector<at::Tensor>& parts) { return at::cat(parts); }

Args args_of(c10::IValue output) {
  if (!output.isTuple()) return {std::move(output)};
  const auto& elements = output.toTupleRef().elements();
  return Args(elements.begin(), elements.end());
}

namespace {

template <typename Visit>
void each_tensor(const c10::IValue& v, const Visit& visit) {
  if (v.isTensor()) {
    visit(v.toTensor());
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) each_tensor(e, visit);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) each_tensor(e, visit);
  }
}

// `v` split into m parts: its tensors by split_batch, the rest repeated.
std::vector<c10::IValue> split_value(const c10::IValue& v, int64_t m) {
  std::vector<c10::IValue> parts;
  if (v.isTensor()) {
    for (auto& t : split_batch(v.toTensor(), m)) parts.emplace_back(std::move(t));
    return parts;
  }
  if (v.isTuple() || v.isList()) {
    const bool tuple = v.isTuple();
    std::vector<std::vector<c10::IValue>> items(m);
    auto add = [&](const c10::IValue& e) {
      auto split = split_value(e, m);
      for (int64_t k = 0; k < m; ++k) items[k].push_back(std::move(split[k]));
    };
    if (tuple) {
      for (const auto& e : v.toTupleRef().elements()) add(e);
    } else {
      for (const c10::IValue& e : v.toListRef()) add(e);
    }
    for (int64_t k = 0; k < m; ++k) {
      if (tuple) {
        parts.emplace_back(c10::ivalue::Tuple::create(std::move(items[k])));
      } else {
        c10::impl::GenericList list(v.toList().elementType());
        for (auto& e : items[k]) list.push_back(std::move(e));
        parts.emplace_back(std::move(list));
      }
    }
    return parts;
  }
  return std::vector<c10::IValue>(m, v);
}

}  // namespace

std::vector<Args> split_inputs(const Args& inputs, const std::vector<bool>& replicate, int64_t m, int64_t* rows) {
  if (!replicate.empty() && replicate.size() != inputs.size()) {
    fail(absl::StatusCode::kInvalidArgument,
         absl::StrCat("replicate marks ", replicate.size(), " inputs of ", inputs.size()));
  }
  *rows = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!replicate.empty() && replicate[i]) continue;
    if (tensors_in_dict(inputs[i])) {
      fail(absl::StatusCode::kInvalidArgument,
           absl::StrCat("input ", i, " holds tensors inside a dict: pass them in a tuple or a list"));
    }
    each_tensor(inputs[i], [&](const at::Tensor& t) {
      if (!t.defined())
        fail(absl::StatusCode::kInvalidArgument, absl::StrCat("input ", i, " holds an undefined tensor"));
      if (t.dim() == 0) {
        fail(absl::StatusCode::kInvalidArgument,
             absl::StrCat("input ", i,
                          " holds a tensor without a batch dimension (0-dim): to give it whole to every "
                          "micro-batch, mark it in replicate"));
      }
      if (*rows >= 0 && t.size(0) != *rows) {
        fail(absl::StatusCode::kInvalidArgument,
             absl::StrCat("input ", i, " holds a tensor of ", t.size(0), " rows where the batch has ", *rows));
      }
      *rows = t.size(0);
    });
  }
  if (*rows < 0) {
    fail(absl::StatusCode::kInvalidArgument, "the inputs hold no tensor to split into micro-batches");
  }
  if (*rows == 0) fail(absl::StatusCode::kInvalidArgument, "the batch is empty (the input needs at least one row)");
  if (*rows < m) {
    fail(absl::StatusCode::kInvalidArgument,
         absl::StrCat("a batch of ", *rows, " rows cannot be split into ", m,
                      " non-empty micro-batches: use a larger batch or fewer micro-batches"));
  }
  std::vector<Args> parts(m);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool whole = !replicate.empty() && replicate[i];
    std::vector<c10::IValue> split = whole ? std::vector<c10::IValue>(m, inputs[i]) : split_value(inputs[i], m);
    for (int64_t k = 0; k < m; ++k) parts[k].push_back(std::move(split[k]));
  }
  return parts;
}

bool tensors_in_dict(const c10::IValue& v) {
  if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      if (!tensors_of(entry.value()).empty() || tensors_in_dict(entry.value())) return true;
    }
    return false;
  }
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      if (tensors_in_dict(e)) return true;
    }
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (tensors_in_dict(e)) return true;
    }
  }
  return false;
}

std::vector<at::Tensor> tensors_of(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  each_tensor(v, [&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

std::vector<at::Tensor> tensors_of(const Args& args) {
  std::vector<at::Tensor> out;
  for (const auto& a : args) each_tensor(a, [&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

c10::IValue map_tensors(const c10::IValue& v, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& e : v.toTupleRef().elements()) items.push_back(map_tensors(e, f));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (v.isList()) {
    c10::impl::GenericList list(v.toList().elementType());
    for (const c10::IValue& e : v.toListRef()) list.push_back(map_tensors(e, f));
    return list;
  }
  return v;
}

}  // namespace tandem::pipeline::detail
