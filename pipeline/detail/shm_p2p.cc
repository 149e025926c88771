#include "tandem/pipeline/detail/shm_p2p.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <algorithm>
#include <cstdlib>
#include <random>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "tandem/sync/futex.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rpc.h"

namespace tandem::pipeline::detail {
namespace {

constexpr uint64_t kBellMagic = 0x6c6c6562706474ULL;  // "tdpbell"
constexpr uint64_t kRingMagic = 0x676e6972706474ULL;  // "tdpring"
constexpr size_t kAlign = 64;                         // records and tensor data start on a cache line
constexpr uint32_t kRecord = 1, kPad = 2;
constexpr int kMaxDepth = 32;
constexpr int kMaxDims = 16;

constexpr size_t align_up(size_t n, size_t a) { return (n + a - 1) & ~(a - 1); }

[[noreturn]] void malformed(const std::string& what) {
  throw RpcError(absl::InvalidArgumentError("malformed pipeline message in shared memory: " + what));
}

std::string errno_text(const std::string& what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Value tags of the encoding.
enum Tag : uint8_t {
  kNone = 0,
  kBool,
  kInt,
  kDouble,
  kString,
  kTensor,
  kTuple,
  kIntList,
  kDoubleList,
  kBoolList,
  kTensorList,
};

bool carried_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

// Writes the encoding at `base` (or only counts its bytes when `base` is null). Offsets are from the start of the
// value, which the caller places on a kAlign boundary: tensor data lands on one too.
class Writer {
 public:
  explicit Writer(uint8_t* base) : base_(base) {}
  size_t size() const { return pos_; }

  // false: `v` holds something not carried.
  bool value(const c10::IValue& v, int depth = 0) {
    if (depth > kMaxDepth) return false;
    if (v.isNone()) return tag(kNone), true;
    if (v.isBool()) return tag(kBool), put<uint8_t>(v.toBool()), true;
    if (v.isInt()) return tag(kInt), pad(8), put<int64_t>(v.toInt()), true;
    if (v.isDouble()) return tag(kDouble), pad(8), put<double>(v.toDouble()), true;
    if (v.isString()) {
      const std::string& s = v.toStringRef();
      tag(kString), pad(8), put<uint64_t>(s.size()), raw(s.data(), s.size());
      return true;
    }
    if (v.isTensor()) return tag(kTensor), tensor(v.toTensor());
    if (v.isTuple()) {
      const auto& e = v.toTupleRef().elements();
      tag(kTuple), pad(8), put<uint64_t>(e.size());
      for (const auto& x : e)
        if (!value(x, depth + 1)) return false;
      return true;
    }
    if (v.isIntList()) return list<int64_t, int64_t>(kIntList, v.toIntList()), true;
    if (v.isDoubleList()) return list<double, double>(kDoubleList, v.toDoubleList()), true;
    if (v.isBoolList()) return list<bool, uint8_t>(kBoolList, v.toBoolList()), true;
    if (v.isTensorList()) {
      auto l = v.toTensorList();
      tag(kTensorList), pad(8), put<uint64_t>(l.size());
      for (const at::Tensor& t : l)
        if (!tensor(t)) return false;
      return true;
    }
    return false;
  }

 private:
  // A list of scalars: its count, then each element as a `Wire`.
  template <typename Elem, typename Wire, typename List>
  void list(Tag t, const List& l) {
    tag(t), pad(8), put<uint64_t>(l.size());
    for (Elem x : l) put<Wire>(static_cast<Wire>(x));
  }
  bool tensor(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != c10::DeviceType::CPU || t.layout() != c10::kStrided ||
        !carried_dtype(t.scalar_type()) || t.dim() > kMaxDims) {
      return false;
    }
    put<int8_t>(static_cast<int8_t>(t.scalar_type()));
    put<uint8_t>(static_cast<uint8_t>(t.dim()));
    put<uint8_t>(t.requires_grad());
    pad(8);
    for (int64_t s : t.sizes()) put<int64_t>(s);
    pad(kAlign);
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    if (base_ && bytes > 0 && t.is_contiguous()) {
      std::memcpy(base_ + pos_, t.data_ptr(), bytes);
    } else if (base_ && bytes > 0) {
      at::NoGradGuard no_grad;
      at::from_blob(base_ + pos_, t.sizes(), at::TensorOptions().dtype(t.scalar_type())).copy_(t.detach());
    }
    pos_ += bytes;
    return true;
  }
  void tag(Tag t) { put<uint8_t>(t); }
  template <typename T>
  void put(T v) {
    raw(&v, sizeof v);
  }
  void raw(const void* p, size_t n) {
    if (base_ && n > 0) std::memcpy(base_ + pos_, p, n);
    pos_ += n;
  }
  void pad(size_t a) {
    const size_t to = align_up(pos_, a);
    if (base_ && to > pos_) std::memset(base_ + pos_, 0, to - pos_);
    pos_ = to;
  }

  uint8_t* const base_;
  size_t pos_ = 0;
};

// Reads what Writer wrote, checking every size against the bytes there are.
class Reader {
 public:
  Reader(const uint8_t* base, size_t bytes) : base_(base), bytes_(bytes) {}
  size_t pos() const { return pos_; }

  c10::IValue value(int depth = 0) {
    if (depth > kMaxDepth) malformed("nested too deep");
    const auto t = get<uint8_t>();
    switch (t) {
      case kNone:
        return c10::IValue();
      case kBool:
        return c10::IValue(get<uint8_t>() != 0);
      case kInt:
        pad(8);
        return c10::IValue(get<int64_t>());
      case kDouble:
        pad(8);
        return c10::IValue(get<double>());
      case kString: {
        pad(8);
        const uint64_t n = count(1);
        std::string s(reinterpret_cast<const char*>(base_ + pos_), n);
        pos_ += n;
        return c10::IValue(std::move(s));
      }
      case kTensor:
        return c10::IValue(tensor());
      case kTuple: {
        pad(8);
        const uint64_t n = count(1);
        std::vector<c10::IValue> e;
        e.reserve(std::min<uint64_t>(n, 1024));  // nested tuples must not reserve more than their bytes justify
        for (uint64_t i = 0; i < n; ++i) e.push_back(value(depth + 1));
        return c10::ivalue::Tuple::create(std::move(e));
      }
      case kIntList:
        return list<int64_t, int64_t>();
      case kDoubleList:
        return list<double, double>();
      case kBoolList:
        return list<bool, uint8_t>();
      case kTensorList: {
        pad(8);
        const uint64_t n = count(8);
        std::vector<at::Tensor> l;
        l.reserve(std::min<uint64_t>(n, 1024));
        for (uint64_t i = 0; i < n; ++i) l.push_back(tensor());
        return c10::IValue(std::move(l));
      }
      default:
        malformed(absl::StrCat("unknown value tag ", static_cast<int>(t)));
    }
  }

 private:
  // What Writer::list wrote (a bool is any byte but 0: true).
  template <typename Elem, typename Wire>
  c10::IValue list() {
    pad(8);
    const uint64_t n = count(sizeof(Wire));
    c10::List<Elem> l;
    l.reserve(n);
    for (uint64_t i = 0; i < n; ++i) {
      const Wire x = get<Wire>();
      if constexpr (std::is_same_v<Elem, bool>) {
        l.push_back(x != 0);
      } else {
        l.push_back(x);
      }
    }
    return c10::IValue(std::move(l));
  }
  at::Tensor tensor() {
    const auto dtype = static_cast<at::ScalarType>(get<int8_t>());
    const int dims = get<uint8_t>();
    const bool requires_grad = get<uint8_t>() != 0;
    if (!carried_dtype(dtype)) malformed(absl::StrCat("tensor of unknown type ", static_cast<int>(dtype)));
    if (dims > kMaxDims) malformed(absl::StrCat("tensor of ", dims, " dimensions"));
    pad(8);
    std::vector<int64_t> sizes(dims);
    uint64_t numel = 1;
    for (auto& s : sizes) {
      s = get<int64_t>();
      if (s < 0) malformed("negative tensor size");
      if (s > 0 && numel > (uint64_t{1} << 48) / static_cast<uint64_t>(s)) malformed("tensor too large");
      numel *= static_cast<uint64_t>(s);
    }
    pad(kAlign);
    const uint64_t bytes = numel * c10::elementSize(dtype);
    need(bytes);
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
    if (bytes > 0 && dtype == at::kBool) {  // a bool is 0 or 1 in memory: other bytes would be undefined in ATen
      auto* out = static_cast<uint8_t*>(t.data_ptr());
      for (uint64_t i = 0; i < bytes; ++i) out[i] = base_[pos_ + i] != 0;
    } else if (bytes > 0) {
      std::memcpy(t.data_ptr(), base_ + pos_, bytes);
    }
    pos_ += bytes;
    if (requires_grad) t.set_requires_grad(true);
    return t;
  }
  // A count of items of at least `item` bytes each, checked against what is left.
  uint64_t count(size_t item) {
    const auto n = get<uint64_t>();
    if (n > (bytes_ - pos_) / item) malformed("count larger than the message");
    return n;
  }
  void need(uint64_t n) {
    if (n > bytes_ - pos_) malformed("value runs past the message's end");
  }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, base_ + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  void pad(size_t a) {
    const size_t to = align_up(pos_, a);
    if (to > bytes_) malformed("value runs past the message's end");
    pos_ = to;
  }

  const uint8_t* const base_;
  const size_t bytes_;
  size_t pos_ = 0;
};

// A message's fixed part, before its value.
struct WireKey {
  int64_t pipe, step;
  int32_t stage, microbatch;
  uint8_t gradient, pad[7];
};
static_assert(sizeof(WireKey) == 32);
constexpr size_t kRecordHeader = 8;                                  // length (u32) and kind (u32)
constexpr size_t kValueAt = align_up(kRecordHeader + sizeof(WireKey), kAlign);  // the value's offset in a record

// A memfd of `bytes`, its size sealed (a peer that opens it cannot shrink it under the receiver's reads), mapped and
// faulted in. Throws RpcError; *fd is -1 then.
void* make_segment(const char* name, size_t bytes, int* fd) {
  *fd = static_cast<int>(syscall(SYS_memfd_create, name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (*fd < 0) throw RpcError(absl::InternalError(errno_text("memfd_create")));
  auto fail_with = [fd](const char* what) {
    const std::string e = errno_text(what);
    close(*fd);
    *fd = -1;
    throw RpcError(absl::InternalError(e));
  };
  if (ftruncate(*fd, static_cast<off_t>(bytes)) != 0) fail_with("ftruncate");
  if (fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) fail_with("fcntl F_ADD_SEALS");
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, *fd, 0);
  if (base == MAP_FAILED) fail_with("mmap");
  return base;
}

// Maps another process's memfd through /proc; its size is checked against `bytes` (0: any, returned in *bytes).
absl::StatusOr<void*> open_segment(int64_t pid, int64_t fd, size_t* bytes) {
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  const int f = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) return absl::UnavailableError(errno_text("open " + path));
  struct stat st {};
  if (fstat(f, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
      (*bytes != 0 && static_cast<size_t>(st.st_size) != *bytes)) {
    close(f);
    return absl::UnavailableError(path + " is not the pipeline's shared memory");
  }
  *bytes = static_cast<size_t>(st.st_size);
  void* base = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, f, 0);
  close(f);
  if (base == MAP_FAILED) return absl::UnavailableError(errno_text("mmap " + path));
  return base;
}

}  // namespace

struct Inbox::Bell {
  uint64_t magic;
  int64_t token;
  alignas(64) std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;  // waiters in futex_wait: a sender wakes them only when there are some
};
constexpr size_t kBellBytes = 4096;
static_assert(sizeof(Inbox::Bell) <= kBellBytes);

struct RingHeader {
  uint64_t magic;
  int64_t token;
  uint64_t capacity;  // bytes of data after the header
  alignas(64) std::atomic<uint64_t> tail;  // written up to (the sender's)
  alignas(64) std::atomic<uint64_t> head;  // read up to (the receiver's)
};
constexpr size_t kRingHeaderBytes = 256;
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);

struct Inbox::Ring {
  int from = -1;
  int fd = -1;
  void* base = nullptr;
  size_t bytes = 0;
  RingHeader* header() const { return static_cast<RingHeader*>(base); }
  uint8_t* data() const { return static_cast<uint8_t*>(base) + kRingHeaderBytes; }
  ~Ring() {
    if (base) munmap(base, bytes);
    if (fd >= 0) close(fd);
  }
};

Inbox::Inbox() {
  token_ = static_cast<int64_t>(std::random_device{}() | (uint64_t{std::random_device{}()} << 32));
  bell_ = static_cast<Bell*>(make_segment("tandem-pipeline-bell", kBellBytes, &bell_fd_));
  bell_->magic = kBellMagic;
  bell_->token = token_;
}

Inbox::~Inbox() {
  for (auto& r : rings_) r.reset();
  munmap(bell_, kBellBytes);
  close(bell_fd_);
}

RingEnds Inbox::ends_for(int from) {
  std::lock_guard<std::mutex> lock(add_mu_);
  const int n = n_rings_.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    if (rings_[i]->from == from) return RingEnds{getpid(), bell_fd_, rings_[i]->fd, token_};
  }
  if (n == kMaxRings) {
    throw RpcError(absl::ResourceExhaustedError(absl::StrCat("more than ", kMaxRings, " senders to one inbox")));
  }
  auto ring = std::make_unique<Ring>();
  ring->from = from;
  ring->bytes = kRingHeaderBytes + kRingBytes;
  ring->base = make_segment("tandem-pipeline-ring", ring->bytes, &ring->fd);
  RingHeader* h = ring->header();
  h->magic = kRingMagic;
  h->token = token_;
  h->capacity = kRingBytes;
  h->tail.store(0);
  h->head.store(0);
  const int fd = ring->fd;
  rings_[n] = std::move(ring);
  n_rings_.store(n + 1, std::memory_order_release);
  return RingEnds{getpid(), bell_fd_, fd, token_};
}

uint32_t Inbox::bell() const { return bell_->value.load(std::memory_order_seq_cst); }

void Inbox::ring() {
  bell_->value.fetch_add(1, std::memory_order_seq_cst);
  if (bell_->sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&bell_->value);
}

std::chrono::microseconds Inbox::spin_time() {
  static const int spin_us = [] {
    const char* v = std::getenv("TANDEM_PIPELINE_SPIN_US");
    return v ? std::max(0, std::atoi(v)) : 200;
  }();
  return std::chrono::microseconds(spin_us);
}

void Inbox::wait(uint32_t seen, Clock::time_point until, std::chrono::microseconds spin) {
  if (spin.count() > 0) {
    const auto end = std::min(until, Clock::now() + spin);
    for (int i = 0;; ++i) {
      if (bell_->value.load(std::memory_order_acquire) != seen) return;
      if ((i & 63) == 63 && Clock::now() >= end) break;
      __builtin_ia32_pause();
    }
  }
  bell_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  futex_wait(&bell_->value, seen, until - Clock::now());
  bell_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

absl::Status Inbox::drain(std::vector<std::tuple<MailKey, c10::IValue, int>>* out) {
  std::lock_guard<std::mutex> lock(drain_mu_);
  const int n = n_rings_.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    Ring& r = *rings_[i];
    RingHeader* h = r.header();
    const uint64_t cap = kRingBytes;
    uint64_t head = h->head.load(std::memory_order_relaxed);
    const uint64_t tail = h->tail.load(std::memory_order_acquire);
    try {
      if (tail < head || tail - head > cap) malformed(absl::StrCat("ring positions ", head, " and ", tail));
      while (head < tail) {
        const uint64_t at = head % cap;
        if (head % 8 != 0 || tail - head < kRecordHeader) malformed(absl::StrCat("ring position ", head));
        uint32_t len = 0, kind = 0;
        std::memcpy(&len, r.data() + at, 4);
        std::memcpy(&kind, r.data() + at + 4, 4);
        if (len < kRecordHeader || len % 8 != 0 || len > cap - at || len > tail - head ||
            (kind == kRecord && len > cap / 2)) {
          malformed(absl::StrCat("a record of ", len, " bytes at ", at));
        }
        if (kind == kRecord) {
          if (len < kValueAt) malformed(absl::StrCat("a record of ", len, " bytes"));
          WireKey k;
          std::memcpy(&k, r.data() + at + kRecordHeader, sizeof k);
          const MailKey key{k.pipe, k.step, k.stage, k.microbatch, k.gradient != 0};
          if (key.stage < 0 && key.stage != finished_key(r.from) && key.stage != kGoStage) {
            malformed("another worker's end of a run");
          }
          Reader reader(r.data() + at + kValueAt, len - kValueAt);
          c10::IValue v = reader.value();
          out->emplace_back(key, std::move(v), r.from);
        } else if (kind != kPad) {
          malformed(absl::StrCat("a record of kind ", kind));
        }
        head += len;
        h->head.store(head, std::memory_order_release);
      }
    } catch (const std::exception& e) {
      h->head.store(tail, std::memory_order_release);  // what is left of this ring is not read
      auto who = rpc::find_worker_info(r.from);
      return absl::InvalidArgumentError(absl::StrCat("from worker '", who ? who->name : absl::StrCat(r.from), "': ",
                                                     e.what()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Outlet>> Outlet::open(const RingEnds& ends) {
  std::unique_ptr<Outlet> o(new Outlet);
  size_t bell_bytes = kBellBytes, ring_bytes = kRingHeaderBytes + Inbox::kRingBytes;
  auto bell = open_segment(ends.pid, ends.bell_fd, &bell_bytes);
  if (!bell.ok()) return bell.status();
  o->bell_map_ = *bell;
  auto ring = open_segment(ends.pid, ends.ring_fd, &ring_bytes);
  if (!ring.ok()) return ring.status();
  o->ring_map_ = *ring;
  o->ring_bytes_ = ring_bytes;
  o->pid_ = ends.pid;
  const auto* b = static_cast<const Inbox::Bell*>(o->bell_map_);
  const auto* h = static_cast<const RingHeader*>(o->ring_map_);
  if (b->magic != kBellMagic || b->token != ends.token || h->magic != kRingMagic || h->token != ends.token ||
      h->capacity != Inbox::kRingBytes) {
    return absl::UnavailableError("the shared memory opened is not the receiver's inbox");
  }
  return o;
}

Outlet::~Outlet() {
  if (bell_map_) munmap(bell_map_, kBellBytes);
  if (ring_map_) munmap(ring_map_, ring_bytes_);
}

bool Outlet::send(const MailKey& key, const c10::IValue& value, bool ring_bell) {
  Writer sizer(nullptr);
  if (!sizer.value(value)) return false;
  const uint64_t cap = Inbox::kRingBytes;
  const uint64_t len = align_up(kValueAt + sizer.size(), kAlign);
  if (len > cap / 2) return false;
  std::lock_guard<std::mutex> lock(send_mu_);
  auto* h = static_cast<RingHeader*>(ring_map_);
  uint8_t* data = static_cast<uint8_t*>(ring_map_) + kRingHeaderBytes;
  uint64_t tail = h->tail.load(std::memory_order_relaxed);
  const uint64_t head = h->head.load(std::memory_order_acquire);
  const uint64_t at = tail % cap, to_end = cap - at;
  const uint64_t need = len + (to_end < len ? to_end : 0);
  if (tail - head + need > cap) return false;
  if (to_end < len) {  // the record does not fit before the end: skip to the start
    const uint32_t pad_len = static_cast<uint32_t>(to_end), kind = kPad;
    std::memcpy(data + at, &pad_len, 4);
    std::memcpy(data + at + 4, &kind, 4);
    tail += to_end;
  }
  uint8_t* rec = data + tail % cap;
  const uint32_t len32 = static_cast<uint32_t>(len), kind = kRecord;
  std::memcpy(rec, &len32, 4);
  std::memcpy(rec + 4, &kind, 4);
  WireKey k{key.pipe, key.step, key.stage, key.microbatch, static_cast<uint8_t>(key.gradient), {}};
  std::memcpy(rec + kRecordHeader, &k, sizeof k);
  Writer writer(rec + kValueAt);
  writer.value(value);
  h->tail.store(tail + len, std::memory_order_release);
  if (ring_bell) ring();
  return true;
}

void Outlet::ring() {
  auto* b = static_cast<Inbox::Bell*>(bell_map_);
  b->value.fetch_add(1, std::memory_order_seq_cst);
  if (b->sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&b->value);
}

size_t encoded_size(const c10::IValue& value) {
  Writer w(nullptr);
  return w.value(value) ? w.size() : 0;
}

void encode(const c10::IValue& value, uint8_t* out, size_t bytes) {
  Writer w(out);
  if (!w.value(value) || w.size() != bytes) malformed("encode: not the size given");
}

c10::IValue decode(const uint8_t* in, size_t bytes) {
  Reader r(in, bytes);
  return r.value();
}

}  // namespace tandem::pipeline::detail
