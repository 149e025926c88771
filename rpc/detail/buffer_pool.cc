#include "tandem/rpc/detail/buffer_pool.h"

#include <ATen/ops/from_blob.h>
#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <new>

#include "absl/base/thread_annotations.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::detail {
namespace {

// How much free memory the pool may hold; beyond it, released buffers are freed.
constexpr size_t kMaxCachedBytes = size_t{1} << 30;

struct Pool {
  Mutex mu;
  std::multimap<size_t, void*> free ABSL_GUARDED_BY(mu);  // capacity -> buffer
  size_t cached ABSL_GUARDED_BY(mu) = 0;
};

Pool& pool() {
  static auto* p = new Pool;  // never destroyed: tensors may be freed during static destruction
  return *p;
}

size_t round_capacity(size_t bytes) {
  if (bytes < kPoolMinBytes) return (bytes + 63) / 64 * 64;
  constexpr size_t kGranule = size_t{1} << 20;  // pooled sizes in whole MiB, so near sizes share buffers
  return (bytes + kGranule - 1) / kGranule * kGranule;
}

}  // namespace

void* acquire_buffer(size_t bytes, size_t* capacity) {
  const size_t cap = round_capacity(std::max<size_t>(bytes, 64));
  *capacity = cap;
  if (cap >= kPoolMinBytes) {
    Pool& p = pool();
    MutexLock lock(&p.mu);
    auto it = p.free.lower_bound(cap);
    if (it != p.free.end() && it->first <= cap + cap / 4) {  // reuse a buffer at most 25% larger
      void* buf = it->second;
      *capacity = it->first;
      p.cached -= it->first;
      p.free.erase(it);
      return buf;
    }
  }
  void* buf = std::aligned_alloc(64, cap);
  if (!buf) throw std::bad_alloc();
  if (cap >= kPoolMinBytes) madvise(buf, cap, MADV_HUGEPAGE);  // fewer faults on first touch where THP allows
  return buf;
}

void release_buffer(void* buffer, size_t capacity) {
  if (!buffer) return;
  if (capacity >= kPoolMinBytes) {
    Pool& p = pool();
    MutexLock lock(&p.mu);
    if (p.cached + capacity <= kMaxCachedBytes) {
      p.free.emplace(capacity, buffer);
      p.cached += capacity;
      return;
    }
  }
  std::free(buffer);
}

at::Tensor pooled_empty(at::IntArrayRef sizes, c10::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  size_t capacity = 0;
  void* buf = acquire_buffer(bytes, &capacity);
  return at::from_blob(
      buf, sizes, [capacity](void* p) { release_buffer(p, capacity); }, at::TensorOptions().dtype(dtype));
}

size_t pooled_bytes_cached() {
  Pool& p = pool();
  MutexLock lock(&p.mu);
  return p.cached;
}

}  // namespace tandem::rpc::detail
