#include "tandem/comm/detail/shm.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tandem/log/log.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/store.h"
#include "tandem/sync/futex.h"

namespace tandem::comm::detail {
namespace {

using std::chrono::milliseconds;
using Clock = ShmGroup::Clock;

// "tandemsi" ("tandemsh" before RankLine::arrived carried kGoneBit): a process of an older build cannot map the
// segment as its own.
constexpr uint64_t kMagic = 0x74616e64656d7369;
constexpr size_t kSlotBytes = size_t{2} << 20;  // per rank: two halves of 1 MiB, one per round
constexpr size_t kHalfBytes = kSlotBytes / 2;
// An allreduce round this small is reduced whole by every rank, in rank order (one barrier); a larger one in shares,
// each rank reducing its own (two barriers).
constexpr size_t kSmallBytes = size_t{256} << 10;
constexpr size_t kPage = 4096;
constexpr int kMaxRanks = 64;                                   // the control lines fit in one page
constexpr auto kSpin = std::chrono::microseconds(20);           // spinning before sleeping on the futex
constexpr auto kLivenessCheck = std::chrono::milliseconds(50);  // how often a waiter looks for ended processes
constexpr const char* kPrefix = "tandem-pg-";

// Why the group failed (Layout::culprit): a rank's process ended, a rank did not arrive by a deadline, or a rank's
// group broke on another path (abandon()). Not a destroyed group (kGoneBit): each waiter sees that one itself.
enum Reason : int32_t { kGone = 1, kLate = 2, kLeft = 3 };

// Set in RankLine::arrived once the rank's group is destroyed (ShmGroup::destroyed); the rest of the word counts the
// barriers it reached.
constexpr uint64_t kGoneBit = uint64_t{1} << 63;
uint64_t arrivals(uint64_t word) { return word & ~kGoneBit; }

// What an operation on the slots posts before its first barrier (ShmGroup::post): its kind, dtype, reduce op or root
// and element count, so that ranks calling different operations or passing other sizes all fail at that barrier
// (ShmGroup::check_posted) instead of reading each other's data as theirs. Bit 0 is 0: an allreduce of a shared tensor
// posts a hash of its part with bit 0 set.
enum Kind : uint64_t { kAllreduce = 1, kBroadcast = 2, kAllgather = 3, kReduceScatter = 4, kBarrier = 5, kShared = 6 };
constexpr int kNumelShift = 18;
constexpr uint64_t kNumelMask = (uint64_t{1} << (64 - kNumelShift)) - 1;  // larger counts compared modulo 2^46

uint64_t signature(Kind kind, c10::ScalarType dtype, int64_t op_or_root, int64_t numel) {
  return ((static_cast<uint64_t>(numel) & kNumelMask) << kNumelShift) |
         ((static_cast<uint64_t>(op_or_root) & 0x7f) << 11) | ((static_cast<uint64_t>(dtype) & 0x7f) << 4) |
         (static_cast<uint64_t>(kind) << 1);
}

std::string describe(uint64_t word) {
  if (word & 1) return "a part of a shared tensor";
  static const char* const kinds[] = {"?",       "allreduce",    "broadcast", "allgather", "reduce_scatter",
                                      "barrier", "shared_tensor"};
  static const char* const ops[] = {"sum", "avg", "min", "max", "product"};  // ReduceOp's order
  const uint64_t kind = (word >> 1) & 7, arg = (word >> 11) & 0x7f;
  if (kind == kBarrier) return "a barrier";
  const auto dtype = static_cast<c10::ScalarType>((word >> 4) & 0x7f);
  std::string out = absl::StrCat(kind < std::size(kinds) ? kinds[kind] : "?", " of ", word >> kNumelShift, " ",
                                 dtype < c10::ScalarType::NumOptions ? c10::toString(dtype) : "?", " elements");
  if (kind == kAllreduce || kind == kReduceScatter)
    absl::StrAppend(&out, " (", arg < std::size(ops) ? ops[arg] : "?", ")");
  if (kind == kBroadcast) absl::StrAppend(&out, " from rank ", arg);
  return out;
}

struct alignas(64) RankLine {
  // The barriers this rank reached, and kGoneBit once its group is destroyed. One word: a rank arrives only while the
  // bit is clear (a compare-and-swap), so a waiter that sees the bit sees the last barrier the rank will ever reach.
  // With a flag of its own beside the count, a peer could read the flag and the old count while the rank was arriving,
  // and fail a barrier the rank reached.
  std::atomic<uint64_t> arrived;
  int64_t pid;
  uint64_t start_time;  // /proc/<pid>/stat field 22: tells a reused pid apart
  uint64_t pid_ns;      // inode of /proc/self/ns/pid: pids are comparable only within one namespace
  // A word for the other ranks to compare after a barrier (ShmGroup::post), by the barrier's parity: a rank is at most
  // one barrier ahead of another, so it never overwrites the word the other may still be reading.
  std::atomic<uint64_t> posted[2];
};

size_t data_offset() { return kPage + kPage; }
size_t segment_bytes(int size) { return data_offset() + static_cast<size_t>(size) * kSlotBytes; }

uint64_t inode_of(const char* path) {
  struct stat st {};
  return stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// State (field 3) and start time (field 22) of a process, from /proc/<pid>/stat; false when it does not exist.
bool process_stat(int64_t pid, char* state, uint64_t* start_time) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!in || !std::getline(in, line)) return false;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::vector<std::string> f = absl::StrSplit(line.substr(close + 2), ' ');
  if (f.size() < 20 || f[0].empty()) return false;
  *state = f[0][0];
  return absl::SimpleAtoi(f[19], start_time);
}

// Removes segments of this pid namespace whose creator is dead: a rank 0 that died between creating a group's segment
// and unlinking it (a window of one store round trip), or any rank that died between creating a shared tensor's
// segment and the barrier after which it unlinks it, would otherwise leave it in /dev/shm until reboot.
void remove_stale_segments(uint64_t pid_ns) {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  const std::string mine = absl::StrCat(kPrefix, pid_ns, "-");
  std::vector<std::string> stale;
  while (dirent* e = readdir(dir)) {
    const std::string n = e->d_name;
    if (n.rfind(mine, 0) != 0) continue;
    const std::string rest = n.substr(mine.size());
    int64_t pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0) continue;
    if (kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) stale.push_back("/" + n);
  }
  closedir(dir);
  for (const auto& n : stale) shm_unlink(n.c_str());
}

// Creates (O_EXCL; its bytes reserved, so that a full /dev/shm is an error here and not a SIGBUS at the first write) or
// opens the segment `name` of `bytes` bytes, and maps it whole. A segment it created and could not map is removed
// again. Opening one of another size: FAILED_PRECONDITION; a system call's failure: UNAVAILABLE naming it.
absl::StatusOr<void*> map_segment(const std::string& name, size_t bytes, bool create) {
  auto sys_error = [](const std::string& what, int e) {
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(e)));
  };
  const int fd = shm_open(name.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) {
    const int e = errno;  // before anything that may allocate
    return sys_error("shm_open " + name, e);
  }
  absl::Status failed;
  if (create) {
    if (int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
      failed = sys_error(absl::StrCat("reserving ", bytes, " bytes in /dev/shm for ", name), e);
    }
  } else if (struct stat st{}; fstat(fd, &st) != 0) {
    const int e = errno;
    failed = sys_error("fstat " + name, e);
  } else if (static_cast<size_t>(st.st_size) != bytes) {
    failed = absl::FailedPreconditionError(absl::StrCat(name, " is not the segment expected (its size differs)"));
  }
  void* base = MAP_FAILED;
  if (failed.ok()) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) {
      const int e = errno;
      failed = sys_error("mmap " + name, e);
    }
  }
  close(fd);
  if (!failed.ok()) {
    if (create) shm_unlink(name.c_str());
    return failed;
  }
  return base;
}

}  // namespace

struct ShmGroup::Layout {
  uint64_t magic;
  uint64_t nonce;
  int32_t size;
  alignas(64) std::atomic<uint32_t> generation;  // bumped at every arrival and failure: the futex word waiters sleep on
  alignas(64) std::atomic<uint32_t> sleepers;    // waiters asleep (or about to be) on `generation`
  // 0, or the failure: (Reason << 16) | (1 + the rank that failed the group), one word so that a reader never sees the
  // rank without its reason.
  alignas(64) std::atomic<int32_t> culprit;

  RankLine* line(int r) { return reinterpret_cast<RankLine*>(reinterpret_cast<char*>(this) + kPage) + r; }
  char* slot(int r) { return reinterpret_cast<char*>(this) + data_offset() + static_cast<size_t>(r) * kSlotBytes; }
};
static_assert(sizeof(ShmGroup::Layout) <= kPage);
// The segment's atomics are used where they lie in zero-filled shared memory, never constructed: only lock-free ones
// work across processes that way.
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free &&
              std::atomic<int32_t>::is_always_lock_free);
static_assert(sizeof(RankLine) == 64 && sizeof(RankLine) * kMaxRanks <= kPage);

// One shared tensor: this rank's segment and its mappings of every other rank's (by rank), each `bytes` long.
struct ShmGroup::Shared {
  uint64_t id = 0;
  size_t bytes = 0;
  std::vector<char*> base;
  Shared() = default;
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
  ~Shared() {
    for (char* b : base) {
      if (b != nullptr) munmap(b, bytes);
    }
  }
};

std::string host_place() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(in, boot);
  return absl::StrCat(boot, "/", inode_of("/proc/self/ns/net"));
}

absl::StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::attach(rpc::Store& store, const std::string& key, int rank,
                                                           std::vector<std::string> labels, milliseconds timeout) {
  const int size = static_cast<int>(labels.size());
  const size_t bytes = segment_bytes(size);
  const uint64_t pid_ns = inode_of("/proc/self/ns/pid");
  std::string name;
  uint64_t nonce = 0;
  void* base = MAP_FAILED;
  if (rank == 0) {
    // Every failure still publishes "-", so that the other ranks do not wait for a name until the timeout.
    auto publish = [&](const std::string& value, absl::Status status) -> absl::Status {
      absl::Status s = store.set(key, value);
      return status.ok() ? s : status;
    };
    if (size > kMaxRanks) {
      return publish("-", absl::FailedPreconditionError(
                              absl::StrCat("shared memory serves at most ", kMaxRanks, " ranks, not ", size)));
    }
    remove_stale_segments(pid_ns);
    std::random_device rd;
    nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    name = absl::StrCat("/", kPrefix, pid_ns, "-", getpid(), "-", absl::Hex(nonce));
    auto mapped = map_segment(name, bytes, /*create=*/true);
    if (!mapped.ok()) return publish("-", mapped.status());
    base = *mapped;
    auto* layout = static_cast<Layout*>(base);
    layout->magic = kMagic;
    layout->nonce = nonce;
    layout->size = size;
    if (absl::Status s = store.set(key, absl::StrCat(name, " ", nonce)); !s.ok()) {
      munmap(base, bytes);
      shm_unlink(name.c_str());
      return s;
    }
  } else {
    auto value = store.get(key, timeout);
    if (!value.ok()) return value.status();
    std::vector<std::string> parts = absl::StrSplit(*value, ' ');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &nonce)) {
      return absl::FailedPreconditionError("rank 0 could not create the shared-memory segment");
    }
    name = parts[0];
    auto mapped = map_segment(name, bytes, /*create=*/false);
    if (!mapped.ok()) return mapped.status();
    base = *mapped;
    const auto* layout = static_cast<const Layout*>(base);
    if (layout->magic != kMagic || layout->nonce != nonce || layout->size != size) {
      munmap(base, bytes);
      return absl::FailedPreconditionError(absl::StrCat(name, " is not the group's segment"));
    }
    name.clear();  // only rank 0 unlinks
  }
  auto* line = static_cast<Layout*>(base)->line(rank);
  char state = 0;
  uint64_t start_time = 0;
  // Without a readable /proc (a sandbox) nobody can tell this process ended: pid 0 keeps gone_ranks() from taking it
  // for gone (the deadline still bounds every wait).
  const bool known = pid_ns != 0 && process_stat(getpid(), &state, &start_time);
  line->pid = known ? getpid() : 0;
  line->start_time = start_time;
  line->pid_ns = pid_ns;
  return std::unique_ptr<ShmGroup>(new ShmGroup(rank, std::move(labels), base, bytes, std::move(name), timeout));
}

ShmGroup::ShmGroup(int rank, std::vector<std::string> labels, void* base, size_t bytes, std::string name,
                   milliseconds timeout)
    : rank_(rank),
      size_(static_cast<int>(labels.size())),
      labels_(std::move(labels)),
      base_(base),
      bytes_(bytes),
      name_(std::move(name)),
      layout_(static_cast<Layout*>(base)),
      timeout_(timeout) {}

ShmGroup::~ShmGroup() {
  unlink();
  munmap(base_, bytes_);
}

void ShmGroup::unlink() {
  if (!name_.empty()) shm_unlink(name_.c_str());
  name_.clear();
}

at::Tensor ShmGroup::half(int r, size_t bytes, c10::ScalarType dtype) {
  const int64_t n = static_cast<int64_t>(bytes / c10::elementSize(dtype));
  return at::from_blob(layout_->slot(r) + (round_ % 2) * kHalfBytes, {n}, at::TensorOptions().dtype(dtype));
}

std::string ShmGroup::gone_ranks() const {
  const uint64_t my_ns = layout_->line(rank_)->pid_ns;
  std::string out;
  for (int q = 0; q < size_; ++q) {
    const RankLine* l = layout_->line(q);
    if (q == rank_ || l->pid_ns != my_ns || l->pid <= 0) continue;
    // Only the ranks this barrier waits for: one that reached it and ended since (its group destroyed, its process
    // gone) posted what the barrier needs, and its segment stays mapped here; the next barrier it misses names it.
    if (arrivals(l->arrived.load()) >= met_) continue;
    char state = 0;
    uint64_t start = 0;
    if (!process_stat(l->pid, &state, &start) || state == 'Z' || state == 'X' || start != l->start_time) {
      absl::StrAppend(&out, out.empty() ? "" : ", ", labels_[q]);
    }
  }
  return out;
}

void ShmGroup::mark_failed(int culprit, int reason) {
  int32_t none = 0;
  layout_->culprit.compare_exchange_strong(none, (reason << 16) | (culprit + 1));  // the first failure stays
  layout_->generation.fetch_add(1);
  futex_wake_all(&layout_->generation);
}

void ShmGroup::fail(int culprit, int reason, const std::string& message) {
  mark_failed(culprit, reason);
  throw_error(reason == kLate ? absl::DeadlineExceededError(message) : absl::UnavailableError(message));
}

void ShmGroup::abandon() { mark_failed(rank_, kLeft); }

void ShmGroup::destroyed() {
  layout_->line(rank_)->arrived.fetch_or(kGoneBit);
  layout_->generation.fetch_add(1);
  futex_wake_all(&layout_->generation);  // this rank's own waiter, and the others'
}

void ShmGroup::meet(Clock::time_point deadline) {
  wait_for_all(deadline);
  if (const char* what = std::exchange(check_after_meet_, nullptr)) check_posted(what);
}

void ShmGroup::begin(const char* what, uint64_t word) {
  post(word);
  check_after_meet_ = what;
}

void ShmGroup::wait_for_all(Clock::time_point deadline) {
  auto cancelled = [] {  // the caller's prefix names the group, this rank and the operation
    throw_error(absl::CancelledError(
        "the group was destroyed on this rank while the operation ran: it stopped at a barrier (shared memory)"));
  };
  // This rank arrives unless its group is destroyed (then the others fail at this barrier, naming it): the count moves
  // only while kGoneBit is clear, so a peer never sees the bit without the count this rank stopped at.
  std::atomic<uint64_t>& mine = layout_->line(rank_)->arrived;
  uint64_t seen = mine.load();
  do {
    if (seen & kGoneBit) cancelled();
  } while (!mine.compare_exchange_weak(seen, met_ + 1));
  ++met_;
  layout_->generation.fetch_add(1);
  if (layout_->sleepers.load() > 0) futex_wake_all(&layout_->generation);
  // A failure first: once a rank gave up, the others' arrivals no longer mean their data is there.
  auto all_arrived = [this] {
    if (layout_->culprit.load() != 0) return false;
    for (int q = 0; q < size_; ++q) {
      if (arrivals(layout_->line(q)->arrived.load(std::memory_order_acquire)) < met_) return false;
    }
    return true;
  };
  const Clock::time_point spin_until = Clock::now() + kSpin;
  while (Clock::now() < spin_until) {
    if (all_arrived()) return;
    if (layout_->culprit.load(std::memory_order_relaxed) != 0) break;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  Clock::time_point next_check = Clock::now() + kLivenessCheck;
  for (;;) {
    const uint32_t generation = layout_->generation.load();
    if (all_arrived()) return;
    if (mine.load() & kGoneBit) cancelled();  // destroyed while this rank waited
    if (const int32_t word = layout_->culprit.load(); word != 0) {
      const int reason = word >> 16, c = word & 0xffff;
      const std::string who = c - 1 >= 0 && c - 1 < size_ ? labels_[c - 1] : absl::StrCat("rank ", c - 1);
      throw_error(reason == kLate
                      ? absl::DeadlineExceededError(absl::StrCat(who, " did not take part within ", timeout_.count(),
                                                                 " ms (seen by another rank; shared memory)"))
                  : reason == kLeft
                      ? absl::UnavailableError(absl::StrCat(
                            who,
                            " left the group: an operation failed there (its log says which), so it takes part "
                            "in no more"))
                      : absl::UnavailableError(absl::StrCat(who, " is gone: its process ended")));
    }
    // A rank whose group was destroyed before it reached this barrier never will: fail now, naming it. Each waiter
    // sees that itself and marks nothing (no culprit): a slower rank may still sleep in an earlier barrier that rank
    // reached, and must pass it.
    for (int q = 0; q < size_; ++q) {
      const uint64_t theirs = q == rank_ ? 0 : layout_->line(q)->arrived.load();
      if ((theirs & kGoneBit) != 0 && arrivals(theirs) < met_) {
        throw_error(absl::UnavailableError(
            absl::StrCat(labels_[q],
                         " destroyed its process group before this barrier: it takes part in no more "
                         "operations (shared memory)")));
      }
    }
    const Clock::time_point now = Clock::now();
    if (now >= next_check) {
      if (std::string gone = gone_ranks(); !gone.empty()) {
        int first = 0;
        for (int q = 0; q < size_; ++q) {
          if (gone.rfind(labels_[q], 0) == 0) first = q;
        }
        fail(first, kGone, absl::StrCat(gone, " is gone: its process ended"));
      }
      next_check = now + kLivenessCheck;
    }
    if (now >= deadline) {
      std::string late;
      int first = -1;
      for (int q = 0; q < size_; ++q) {
        if (arrivals(layout_->line(q)->arrived.load()) >= met_) continue;
        if (first < 0) first = q;
        absl::StrAppend(&late, late.empty() ? "" : ", ", labels_[q]);
      }
      if (first < 0) continue;  // the last one arrived since all_arrived() looked: the barrier is passed
      fail(first, kLate,
           absl::StrCat("a rank did not take part within ", timeout_.count(), " ms: ", late,
                        " did not arrive (shared memory)"));
    }
    layout_->sleepers.fetch_add(1);
    futex_wait(&layout_->generation, generation, std::min(deadline, next_check) - now);
    layout_->sleepers.fetch_sub(1);
  }
}

void ShmGroup::post(uint64_t word) {
  layout_->line(rank_)->posted[(met_ + 1) % 2].store(word, std::memory_order_relaxed);  // meet() publishes it
}

uint64_t ShmGroup::posted(int r) const {
  return layout_->line(r)->posted[met_ % 2].load(std::memory_order_relaxed);  // after meet()'s acquire
}

void ShmGroup::check_posted(const char* what) {
  for (int q = 1; q < size_; ++q) {
    const uint64_t theirs = posted(q), first = posted(0);
    if (theirs == first) continue;
    const bool shared = (theirs & 1) != 0 || (first & 1) != 0;
    throw_error(absl::FailedPreconditionError(absl::StrCat(
        what, ": ", labels_[q], " called ",
        (theirs & 1) != 0 && (first & 1) != 0 ? "another part of a shared tensor" : describe(theirs), " where ",
        labels_[0], " called ", describe(first),
        shared
            ? ": every rank must pass the same part of the same shared tensor, or a plain tensor"
            : ": every rank must run the same collectives in the same order, on tensors of the same size and dtype")));
  }
}

at::Tensor ShmGroup::shared_tensor(int64_t numel, c10::ScalarType dtype, Clock::time_point deadline) {
  auto s = std::make_shared<Shared>();
  s->id = ++shared_made_;
  s->bytes = std::max(kPage, (static_cast<size_t>(numel) * c10::elementSize(dtype) + kPage - 1) / kPage * kPage);
  s->base.assign(static_cast<size_t>(size_), nullptr);
  // Named for its creator's process (remove_stale_segments finds it if that process dies before removing it).
  auto name_of = [&](int r) {
    const RankLine* l = layout_->line(r);
    return absl::StrCat("/", kPrefix, l->pid_ns, "-", l->pid, "-", absl::Hex(layout_->nonce), "-t", s->id);
  };
  auto map = [&](const std::string& name, bool create) -> char* {
    auto mapped = map_segment(name, s->bytes, create);
    if (mapped.ok()) return static_cast<char*>(*mapped);
    TANDEM_LOG(kWarn, "comm") << "shared_tensor: " << mapped.status().message();
    return nullptr;
  };
  struct Unlink {  // this rank's name goes once every rank has mapped it
    std::string name;
    ~Unlink() {
      if (!name.empty()) shm_unlink(name.c_str());
    }
  } mine{name_of(rank_)};
  // First every rank says what it calls: a rank that runs another operation meanwhile (or asks for another size or
  // dtype) fails here on every rank, naming it, instead of reading the other's signature as "could not map".
  begin("shared_tensor", signature(kShared, dtype, 0, numel));
  meet(deadline);
  s->base[rank_] = map(mine.name, /*create=*/true);
  if (!s->base[rank_]) mine.name.clear();  // not made (map_segment removed what it made), or not ours to remove
  auto everyone = [&](bool ok) {
    post(ok ? 1 : 0);
    meet(deadline);
    for (int q = 0; q < size_; ++q) ok = ok && posted(q) == 1;
    return ok;
  };
  bool ok = everyone(s->base[rank_] != nullptr);
  for (int q = 0; q < size_ && ok; ++q) {
    if (q != rank_) ok = (s->base[q] = map(name_of(q), /*create=*/false)) != nullptr;
  }
  if (!everyone(ok)) return at::Tensor();
  for (auto it = shared_.begin(); it != shared_.end();) {
    it = it->second.expired() ? shared_.erase(it) : std::next(it);
  }
  char* const data = s->base[rank_];
  shared_[reinterpret_cast<uintptr_t>(data)] = s;
  return at::from_blob(
      data, {numel}, [s](void*) {}, at::TensorOptions().dtype(dtype));
}

std::shared_ptr<ShmGroup::Shared> ShmGroup::shared_of(const at::Tensor& t) {
  const auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
  auto it = shared_.upper_bound(p);
  if (it == shared_.begin()) return nullptr;
  --it;
  std::shared_ptr<Shared> s = it->second.lock();
  if (!s || p + t.nbytes() > it->first + s->bytes) return nullptr;
  return s;
}

namespace {

// The user's tensor as a plain flat alias of its memory, as Gloo sees it: no autograd (parameters and gradients that
// require grad are reduced in place) and no bump of its version counter.
at::Tensor raw(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {t.numel()}, at::TensorOptions().dtype(t.scalar_type()));
}

void combine(at::Tensor& acc, const at::Tensor& x, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      acc.add_(x);
      return;
    case ReduceOp::kProduct:
      acc.mul_(x);
      return;
    case ReduceOp::kMin:
      at::minimum_out(acc, acc, x);
      return;
    case ReduceOp::kMax:
      at::maximum_out(acc, acc, x);
      return;
  }
}

// out = the reduction of part(0), ..., part(size - 1), in that order: the same result on every rank that computes it.
template <typename Part>
void reduce_in_rank_order(at::Tensor& out, int size, ReduceOp op, Part&& part) {
  out.copy_(part(0));
  for (int q = 1; q < size; ++q) combine(out, part(q), op);
}

}  // namespace

template <typename F>
void ShmGroup::each_round(int64_t n, int64_t per_round, F&& round) {
  for (int64_t at = 0; at < n; at += per_round) {
    ++round_;
    round(at, std::min(per_round, n - at));
  }
}

namespace {

// A float or double share [lo, hi): `sources` summed (and averaged) into `acc` after its own values, in their order,
// and the result written to each of `dests`, in blocks small enough to stay in the core's first-level cache between the
// passes: each value is read from memory once and written once per destination (ATen's passes over the share, one per
// operation, read and wrote it each time). Offsets count elements from each pointer.
template <typename T>
void fused_share(T* acc_base, const std::vector<const char*>& sources, const std::vector<char*>& dests, int64_t lo,
                 int64_t hi, bool avg, int size) {
  constexpr int64_t kBlock = 2048;
  const T divisor = static_cast<T>(size);
  for (int64_t a = lo; a < hi; a += kBlock) {
    const int64_t n = std::min(kBlock, hi - a);
    T* __restrict acc = acc_base + a;
    for (const char* o : sources) {
      const T* __restrict x = reinterpret_cast<const T*>(o) + a;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
    }
    if (avg) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) acc[i] /= divisor;
    }
    for (char* o : dests) {
      T* __restrict y = reinterpret_cast<T*>(o) + a;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[i] = acc[i];
    }
  }
}

// fused_share() when `t`'s dtype and `op` allow it (a sum or an average of floats or doubles); false otherwise.
bool fused_share_of(const at::Tensor& t, ReduceOp op, const std::vector<const char*>& sources,
                    const std::vector<char*>& dests, int64_t lo, int64_t hi, int size) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) return false;
  if (t.scalar_type() == at::kFloat) {
    fused_share<float>(static_cast<float*>(t.data_ptr()), sources, dests, lo, hi, op == ReduceOp::kAvg, size);
  } else if (t.scalar_type() == at::kDouble) {
    fused_share<double>(static_cast<double*>(t.data_ptr()), sources, dests, lo, hi, op == ReduceOp::kAvg, size);
  } else {
    return false;
  }
  return true;
}

}  // namespace

void ShmGroup::allreduce(const at::Tensor& t, ReduceOp op, Clock::time_point deadline) {
  const auto dtype = t.scalar_type();
  const size_t es = t.element_size();
  const std::shared_ptr<Shared> s = t.numel() > 0 ? shared_of(t) : nullptr;
  if (s) {
    // Which part of which shared tensor, as which dtype and with which op: every rank must pass the same (checked
    // after the first barrier).
    uint64_t word = 1469598103934665603ull;
    for (uint64_t v : {s->id, static_cast<uint64_t>(static_cast<char*>(t.data_ptr()) - s->base[rank_]), t.nbytes(),
                       static_cast<uint64_t>(dtype), static_cast<uint64_t>(op)}) {
      word = (word ^ v) * 1099511628211ull;
    }
    begin("allreduce", word | 1);
    return push_allreduce(*s, t, op, deadline);
  }
  begin("allreduce", signature(kAllreduce, dtype, static_cast<int64_t>(op), t.numel()));
  if (t.numel() == 0) return barrier_only(deadline);
  at::Tensor flat = raw(t);
  each_round(t.numel(), static_cast<int64_t>(kHalfBytes / es), [&](int64_t at, int64_t m) {
    const size_t bytes = static_cast<size_t>(m) * es;
    at::Tensor out = flat.slice(0, at, at + m);
    at::Tensor mine = half(rank_, bytes, dtype);
    if (bytes <= kSmallBytes) {
      mine.copy_(out);
      meet(deadline);
      reduce_in_rank_order(out, size_, op, [&](int q) { return half(q, bytes, dtype); });
      if (op == ReduceOp::kAvg) out.div_(size_);
      return;
    }
    // In shares: rank r reduces share r. Each rank puts in its half only the shares the others reduce, reduces its own
    // share in place in the tensor (its own values first, then the others' in rank order: the same sums as every rank
    // gets; kAvg divides that sum, as Gloo's path does), puts the result in its half for the others, and copies out
    // only the others' shares.
    auto share = [&](int r) { return std::make_pair(m * r / size_, m * (r + 1) / size_); };
    const auto [lo, hi] = share(rank_);
    for (int q = 0; q < size_; ++q) {
      const auto [a, b] = share(q);
      if (q != rank_) mine.slice(0, a, b).copy_(out.slice(0, a, b));
    }
    meet(deadline);
    std::vector<const char*> others;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) others.push_back(static_cast<const char*>(half(q, bytes, dtype).data_ptr()));
    }
    // The sum (and average) and its copy into this rank's half in one pass over the share (about a fifth of a 64 MiB
    // allreduce's time on 2 ranks here, against ATen's add, div and copy).
    if (!fused_share_of(out, op, others, {static_cast<char*>(mine.data_ptr())}, lo, hi, size_)) {
      at::Tensor acc = out.slice(0, lo, hi);
      for (int q = 0; q < size_; ++q) {
        if (q != rank_) combine(acc, half(q, bytes, dtype).slice(0, lo, hi), op);
      }
      if (op == ReduceOp::kAvg) acc.div_(size_);  // on the share just reduced: no extra pass over the tensor
      mine.slice(0, lo, hi).copy_(acc);
    }
    meet(deadline);
    for (int q = 0; q < size_; ++q) {
      const auto [a, b] = share(q);
      if (q != rank_) out.slice(0, a, b).copy_(half(q, bytes, dtype).slice(0, a, b));
    }
  });
}

void ShmGroup::push_allreduce(Shared& s, const at::Tensor& t, ReduceOp op, Clock::time_point deadline) {
  const size_t offset = static_cast<size_t>(static_cast<char*>(t.data_ptr()) - s.base[rank_]);
  const int64_t m = t.numel();
  auto of = [&](int q) { return at::from_blob(s.base[q] + offset, {m}, at::TensorOptions().dtype(t.scalar_type())); };
  meet(deadline);  // every rank's values are in place (and every rank passed the same part: begin())
  // Rank r reduces share r: its own values first, then the others' in rank order (as the copying path does), and
  // writes the result into every other rank's tensor.
  const int64_t lo = m * rank_ / size_, hi = m * (rank_ + 1) / size_;
  if (hi > lo) {
    std::vector<char*> others;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) others.push_back(s.base[q] + offset);
    }
    if (!fused_share_of(t, op, {others.begin(), others.end()}, others, lo, hi, size_)) {
      at::Tensor acc = raw(t).slice(0, lo, hi);
      for (int q = 0; q < size_; ++q) {
        if (q != rank_) combine(acc, of(q).slice(0, lo, hi), op);
      }
      if (op == ReduceOp::kAvg) acc.div_(size_);
      for (int q = 0; q < size_; ++q) {
        if (q != rank_) of(q).slice(0, lo, hi).copy_(acc);
      }
    }
  }
  meet(deadline);  // every share written everywhere; nobody reads this rank's tensor any more
}

void ShmGroup::broadcast(const at::Tensor& t, int root, Clock::time_point deadline) {
  const auto dtype = t.scalar_type();
  const size_t es = t.element_size();
  begin("broadcast", signature(kBroadcast, dtype, root, t.numel()));
  if (t.numel() == 0) return barrier_only(deadline);
  at::Tensor flat = raw(t);
  each_round(t.numel(), static_cast<int64_t>(kHalfBytes / es), [&](int64_t at, int64_t m) {
    at::Tensor part = flat.slice(0, at, at + m);
    if (rank_ == root) half(root, m * es, dtype).copy_(part);
    meet(deadline);
    if (rank_ != root) part.copy_(half(root, m * es, dtype));
  });
}

void ShmGroup::allgather(const at::Tensor& output, const at::Tensor& input, Clock::time_point deadline) {
  const auto dtype = input.scalar_type();
  const size_t es = input.element_size();
  const int64_t n = input.numel();
  begin("allgather", signature(kAllgather, dtype, 0, n));
  if (n == 0) return barrier_only(deadline);
  at::Tensor in = raw(input), out = raw(output).view({size_, n});
  each_round(n, static_cast<int64_t>(kHalfBytes / es), [&](int64_t at, int64_t m) {
    half(rank_, m * es, dtype).copy_(in.slice(0, at, at + m));
    meet(deadline);
    for (int q = 0; q < size_; ++q) out[q].slice(0, at, at + m).copy_(half(q, m * es, dtype));
  });
}

void ShmGroup::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                              Clock::time_point deadline) {
  const auto dtype = input.scalar_type();
  const size_t es = input.element_size();
  const int64_t n = output.numel();
  begin("reduce_scatter", signature(kReduceScatter, dtype, static_cast<int64_t>(op), n));
  if (n == 0) return barrier_only(deadline);
  at::Tensor in = raw(input).view({size_, n}), out = raw(output);
  each_round(n, static_cast<int64_t>(kHalfBytes / (es * size_)), [&](int64_t at, int64_t m) {
    const size_t bytes = static_cast<size_t>(m * size_) * es;
    half(rank_, bytes, dtype).view({size_, m}).copy_(in.slice(1, at, at + m));  // chunk q's part at row q
    meet(deadline);
    at::Tensor part = out.slice(0, at, at + m);
    reduce_in_rank_order(part, size_, op, [&](int q) { return half(q, bytes, dtype).view({size_, m})[rank_]; });
  });
  if (op == ReduceOp::kAvg) out.div_(size_);
}

void ShmGroup::barrier(Clock::time_point deadline) {
  begin("barrier", signature(kBarrier, c10::ScalarType::Byte, 0, 0));
  barrier_only(deadline);
}

void ShmGroup::barrier_only(Clock::time_point deadline) {
  ++round_;
  meet(deadline);
}

}  // namespace tandem::comm::detail
