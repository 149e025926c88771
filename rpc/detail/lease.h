// A caller's word that the tensors it sent by reference are still its to read (wire.h, TensorMeta.by_reference).
//
// A callee reads such tensors from the caller's memory (process_vm_readv) whenever it gets to the request, which may be
// after the caller gave up on the call (its timeout) and let them go: it would then read freed memory and run the
// function on garbage. So a request carrying tensors by reference also carries a lease: the address of a word in the
// caller's memory and the id it holds while the caller keeps the tensors. The caller ends the lease (the word reads 0,
// or another call's id once the slot is reused) before it lets them go; the callee reads the word after the tensors,
// and runs the call only if it still holds the id: then the tensors were alive when read.
//
// Thread-safety: take() from any thread; a Lease object is used by one thread at a time. Words are never freed, so a
// late read of one never faults.
#pragma once

#include <atomic>
#include <cstdint>

namespace tandem::rpc::detail {

class Lease {
 public:
  Lease() = default;  // none: address() and id() are 0
  // A free word holding a fresh id (unique in this process).
  static Lease take();
  Lease(Lease&& other) noexcept : word_(other.word_), id_(other.id_) { other.word_ = nullptr, other.id_ = 0; }
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() { end(); }

  // From now on the word does not hold this lease's id; the word goes back for reuse. Idempotent.
  void end();
  uint64_t address() const { return reinterpret_cast<uintptr_t>(word_); }
  uint64_t id() const { return id_; }

 private:
  std::atomic<uint64_t>* word_ = nullptr;
  uint64_t id_ = 0;
};

}  // namespace tandem::rpc::detail
