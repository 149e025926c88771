// Receive buffers that stay faulted in. A fresh 64 MiB buffer costs ~20 ms of page faults here before the first byte
// lands in it, more than the transfer itself; so buffers of received tensors and frames go back to a pool when the last
// tensor using them dies, and the next receive of a similar size reuses one.
//
// Thread-safety: all functions may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>

namespace tandem::rpc::detail {

// Buffers under this size are not pooled (malloc serves them well).
constexpr size_t kPoolMinBytes = size_t{1} << 20;

// A 64-byte aligned buffer of at least `bytes`; `*capacity` receives its real size, which release() needs.
void* acquire_buffer(size_t bytes, size_t* capacity);
void release_buffer(void* buffer, size_t capacity);

// An uninitialised contiguous tensor whose storage comes from the pool and returns to it when freed.
at::Tensor pooled_empty(at::IntArrayRef sizes, c10::ScalarType dtype);

// Bytes currently cached (for tests and introspection).
size_t pooled_bytes_cached();

}  // namespace tandem::rpc::detail
