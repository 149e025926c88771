#include "tandem/rpc/script.h"

#include "absl/strings/str_cat.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"

namespace tandem::rpc {
namespace {

// Checks (and normalizes: defaults, typed lists) the arguments against `schema`; a mismatch is the caller's error.
void check_arguments(const c10::FunctionSchema& schema, std::vector<c10::IValue>& args) {
  try {
    schema.checkAndNormalizeInputs(args, {});
  } catch (const c10::Error& e) {
    throw_error(absl::InvalidArgumentError(e.what_without_backtrace()));
  }
}

}  // namespace

void register_script_function(const std::string& name, std::shared_ptr<torch::jit::CompilationUnit> unit,
                              const std::string& function) {
  torch::jit::Function* fn = unit->find_function(function);
  if (!fn) throw RpcError(absl::NotFoundError(absl::StrCat("no TorchScript function '", function, "' to register")));
  throw_if_error(register_handler(name, [unit, fn](std::vector<c10::IValue>&& args) {
    check_arguments(fn->getSchema(), args);
    torch::jit::Stack stack(std::move(args));
    fn->run(stack);
    return Future::ready(stack.empty() ? c10::IValue() : std::move(stack.back()));
  }));
}

void register_script_method(const std::string& name, torch::jit::Module module, const std::string& method) {
  if (!module.find_method(method)) {
    throw RpcError(absl::NotFoundError(absl::StrCat("the module has no method '", method, "' to register")));
  }
  throw_if_error(register_handler(name, [module, method](std::vector<c10::IValue>&& args) {
    torch::jit::Method m = module.get_method(method);
    args.insert(args.begin(), module._ivalue());  // self
    check_arguments(m.function().getSchema(), args);
    args.erase(args.begin());
    return Future::ready(m(std::move(args)));
  }));
}

}  // namespace tandem::rpc
