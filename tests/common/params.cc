#include "tests/common/params.h"

#include <ATen/ATen.h>

#include <map>
#include <mutex>

namespace tandem::test {

at::Tensor param(const std::string& name, int64_t rows, int64_t cols) {
  static std::mutex mu;
  static std::map<std::string, at::Tensor> params;
  std::lock_guard<std::mutex> lock(mu);
  auto& p = params[name];
  if (!p.defined()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(std::hash<std::string>{}(name)&0xffffffff);
    p = at::randn({rows, cols}, gen, at::kDouble).mul_(0.5).set_requires_grad(true);
  }
  return p;
}

}  // namespace tandem::test
