// TorchScript functions and module methods, callable by name like registered C++ functions.
//
//   auto cu = torch::jit::compile("def scale(x: Tensor, k: float) -> Tensor:\n  return x * k\n");
//   tandem::rpc::register_script_function("scale", cu, "scale");
//   tandem::rpc::register_script_method("classify", torch::jit::load("model.pt"), "forward");
//
// Arguments are checked against the function's schema before it runs; a mismatch is an INVALID_ARGUMENT reply.
// Kept apart from rpc/rpc.h so that only code using TorchScript pays for its headers.
#pragma once

#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <string>

namespace tandem::rpc {

// Registers function `function` of `unit` under `name`. Throws RpcError when the function does not exist or the name is
// taken.
void register_script_function(const std::string& name, std::shared_ptr<torch::jit::CompilationUnit> unit,
                              const std::string& function);
// Registers `method` of `module` under `name`.
void register_script_method(const std::string& name, torch::jit::Module module, const std::string& method);

}  // namespace tandem::rpc
