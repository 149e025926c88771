#include "tandem/rpc/registry.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "tandem/rpc/errors.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {
namespace {

struct Registry {
  Mutex mu;
  std::map<std::string, Handler> handlers ABSL_GUARDED_BY(mu);
  std::map<std::string, std::shared_ptr<const MessageHandler>> messages ABSL_GUARDED_BY(mu);
};

Registry& registry() {
  static auto* r = new Registry;  // never destroyed: handlers may be looked up during static destruction
  return *r;
}

}  // namespace

absl::Status register_handler(const std::string& name, Handler handler) {
  if (name.empty()) return absl::InvalidArgumentError("cannot register a function with an empty name");
  if (!handler) return absl::InvalidArgumentError(absl::StrCat("cannot register an empty handler as '", name, "'"));
  auto& r = registry();
  MutexLock lock(&r.mu);
  if (!r.handlers.emplace(name, std::move(handler)).second) {
    return absl::AlreadyExistsError(absl::StrCat("a function named '", name, "' is already registered"));
  }
  return absl::OkStatus();
}

bool unregister_function(const std::string& name) {
  auto& r = registry();
  Handler handler;  // destroyed after the lock: what it holds (a batched function's batcher) may take locks of its own
  std::shared_ptr<const MessageHandler> message;
  MutexLock lock(&r.mu);
  if (auto m = r.messages.find(name); m != r.messages.end()) {
    message = std::move(m->second);
    r.messages.erase(m);
  }
  auto it = r.handlers.find(name);
  if (it == r.handlers.end()) return false;
  handler = std::move(it->second);
  r.handlers.erase(it);
  return true;
}

std::shared_ptr<const MessageHandler> find_message(const std::string& name) {
  auto& r = registry();
  MutexLock lock(&r.mu);
  auto it = r.messages.find(name);
  return it == r.messages.end() ? nullptr : it->second;
}

Handler find_function(const std::string& name) {
  auto& r = registry();
  MutexLock lock(&r.mu);
  auto it = r.handlers.find(name);
  return it == r.handlers.end() ? Handler() : it->second;
}

std::vector<std::string> registered_functions() {
  auto& r = registry();
  MutexLock lock(&r.mu);
  std::vector<std::string> names;
  for (const auto& [name, h] : r.handlers) names.push_back(name);
  return names;
}

namespace detail {

absl::Status register_message_handlers(const std::string& name, Handler handler, MessageHandler message) {
  if (name.empty()) return absl::InvalidArgumentError("cannot register a message with an empty name");
  if (!handler || !message) {
    return absl::InvalidArgumentError(absl::StrCat("cannot register an empty message as '", name, "'"));
  }
  auto& r = registry();
  MutexLock lock(&r.mu);
  if (r.handlers.count(name) > 0 || r.messages.count(name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("a function named '", name, "' is already registered"));
  }
  r.handlers.emplace(name, std::move(handler));
  r.messages.emplace(name, std::make_shared<const MessageHandler>(std::move(message)));
  return absl::OkStatus();
}

void arity_error(size_t expected, size_t got) {
  throw_error(absl::InvalidArgumentError(
      absl::StrCat("expects ", expected, " argument", expected == 1 ? "" : "s", ", got ", got)));
}

void argument_error(size_t index, const std::exception& e) {
  // The cause's message without its code: whatever failed to convert, the argument is what the caller got wrong.
  throw_error(
      absl::InvalidArgumentError(absl::StrCat("argument ", index + 1, ": ", status_from_exception(e).message())));
}

}  // namespace detail
}  // namespace tandem::rpc
