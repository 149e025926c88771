#include "tandem/ddp_dist_autograd/ddp_dist_autograd.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "tandem/dist_autograd/dist_autograd.h"

namespace tandem::ddp {
namespace {

const bool g_installed = [] {
  set_external_backward_probe([] { return dist_autograd::current_context(); });
  return true;
}();

}  // namespace

void reduce_context_gradients(DistributedDataParallelBase& ddp, int64_t context_id) {
  (void)g_installed;
  // Read when first asked: the tapped path (buckets filled as the backward ran) never asks, and a context that does
  // not exist fails inside the reduction, which then ends its launched buckets first.
  std::optional<dist_autograd::Gradients> grads;
  ddp.reduce_external(
      [&grads, context_id](const at::Tensor& p) {
        if (!grads) grads = dist_autograd::get_gradients(context_id);
        return (*grads)[p];
      },
      [context_id](const at::Tensor& p, at::Tensor avg) { dist_autograd::set_gradient(context_id, p, std::move(avg)); },
      absl::StrCat("distributed autograd context ", context_id));
}

}  // namespace tandem::ddp
