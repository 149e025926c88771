// libFuzzer target: what a pipeline stage worker reads from a same-host ring (pipeline/detail/shm_p2p.h), written by
// a peer that may be broken: the value encoding alone, and a whole ring (records, padding, the sender's tail and the
// receiver's head, which live in shared memory too) drained as an inbox does. Every input must decode or be refused
// with an error; nothing may crash, read out of bounds or allocate more than the bytes given justify.
//
// Input: [mode byte][bytes]. Mode even: the bytes are one encoded value. Mode odd: the bytes are the start of a ring
// (its first 16 bytes the tail and head to publish, the rest its records); the rest of the ring is zeros.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/pipeline/detail/shm_p2p.h"

namespace {

using tandem::pipeline::detail::Inbox;
using tandem::pipeline::detail::MailKey;

constexpr size_t kHeader = 256;  // shm_p2p.cc's ring header: the tail at byte 64, the head at byte 128

// One inbox and a second mapping of its ring for the whole run: making them costs a memfd and 4 MiB each.
struct Ring {
  Ring() : inbox(std::make_unique<Inbox>()) {
    const auto ends = inbox->ends_for(1);
    const int fd = open(absl::StrCat("/proc/self/fd/", ends.ring_fd).c_str(), O_RDWR);
    base = static_cast<uint8_t*>(mmap(nullptr, kHeader + Inbox::kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  std::unique_ptr<Inbox> inbox;
  uint8_t* base = nullptr;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  ++data, --size;
  if (mode % 2 == 0) {
    // A 64-byte-aligned copy, as in a ring.
    std::vector<uint8_t> buf(size + 64);
    uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    if (size > 0) std::memcpy(at, data, size);
    try {
      (void)tandem::pipeline::detail::decode(at, size);
    } catch (const std::exception&) {
    }
    return 0;
  }
  static Ring ring;
  if (ring.base == MAP_FAILED || size < 16) return 0;
  uint64_t tail = 0, head = 0;
  std::memcpy(&tail, data, 8);
  std::memcpy(&head, data + 8, 8);
  data += 16, size -= 16;
  const size_t n = std::min(size, Inbox::kRingBytes);
  static size_t dirty = 0;  // what earlier inputs wrote
  std::memset(ring.base + kHeader, 0, std::max(dirty, n));
  dirty = n;
  if (n > 0) std::memcpy(ring.base + kHeader, data, n);
  reinterpret_cast<std::atomic<uint64_t>*>(ring.base + 128)->store(head % (2 * Inbox::kRingBytes + 1));
  reinterpret_cast<std::atomic<uint64_t>*>(ring.base + 64)->store(tail % (2 * Inbox::kRingBytes + 1));
  std::vector<std::tuple<MailKey, c10::IValue, int>> got;
  (void)ring.inbox->drain(&got);
  return 0;
}
