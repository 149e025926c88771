#include "tandem/rpc/detail/lease.h"

#include <mutex>
#include <vector>

namespace tandem::rpc::detail {
namespace {

struct Words {
  std::mutex mu;
  std::vector<std::atomic<uint64_t>*> free;  // words not leased now
  std::atomic<uint64_t> next_id{1};
};

Words& words() {
  static auto* w = new Words;  // never destroyed: a callee may read a word until this process ends
  return *w;
}

constexpr size_t kChunk = 1024;  // words made at once when none is free

}  // namespace

Lease Lease::take() {
  Words& w = words();
  Lease lease;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.free.empty()) {
      auto* chunk = new std::atomic<uint64_t>[kChunk];  // never freed (see the header)
      for (size_t i = 0; i < kChunk; ++i) {
        chunk[i].store(0, std::memory_order_relaxed);
        w.free.push_back(&chunk[i]);
      }
    }
    lease.word_ = w.free.back();
    w.free.pop_back();
  }
  lease.id_ = w.next_id.fetch_add(1, std::memory_order_relaxed);
  lease.word_->store(lease.id_, std::memory_order_seq_cst);
  return lease;
}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    end();
    word_ = other.word_, id_ = other.id_;
    other.word_ = nullptr, other.id_ = 0;
  }
  return *this;
}

void Lease::end() {
  if (!word_) return;
  // Before the tensors go (the caller ends the lease first): a callee reading the word after this sees 0. The fence
  // keeps every later store of this thread (into the tensors' memory, reused) from becoming visible before the zero,
  // on any architecture (a release store alone orders only what came before it).
  word_->store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  Words& w = words();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.free.push_back(word_);
  }
  word_ = nullptr;
  id_ = 0;
}

}  // namespace tandem::rpc::detail
