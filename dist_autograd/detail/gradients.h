// A lookup of a context's gradients that does not throw, for layers to which a missing context is not an error (the
// distributed optimizer: no gradient reached this worker in that context).
#pragma once

#include <cstdint>
#include <optional>

#include "tandem/dist_autograd/dist_autograd.h"

namespace tandem::dist_autograd::detail {

// The gradients context `context_id` accumulated on this worker; nullopt when this worker does not know the context.
std::optional<Gradients> find_gradients(int64_t context_id);

}  // namespace tandem::dist_autograd::detail
