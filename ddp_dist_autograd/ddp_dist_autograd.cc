#include "tandem/ddp_dist_autograd/ddp_dist_autograd.h"

#include "absl/strings/str_cat.h"
#include "tandem/dist_autograd/dist_autograd.h"

namespace tandem::ddp {
namespace {

const bool g_installed = [] {
  set_external_backward_probe([] { return dist_autograd::current_context() >= 0; });
  return true;
}();

}  // namespace

void reduce_context_gradients(DistributedDataParallelBase& ddp, int64_t context_id) {
  (void)g_installed;
  const dist_autograd::Gradients grads = dist_autograd::get_gradients(context_id);
  ddp.reduce_external(
      [&grads](const at::Tensor& p) { return grads[p]; },
      [context_id](const at::Tensor& p, at::Tensor avg) { dist_autograd::set_gradient(context_id, p, std::move(avg)); },
      absl::StrCat("distributed autograd context ", context_id));
}

}  // namespace tandem::ddp
