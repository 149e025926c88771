#include "tandem/rpc/detail/wire.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <sys/uio.h>
#include <torch/csrc/jit/frontend/script_type_parser.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "tandem/rpc/detail/buffer_pool.h"
#include "tandem/rpc/extension.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc::wire {
namespace {

using tandem::wire::Payload;
using tandem::wire::TensorMeta;
using tandem::wire::Value;

bool supported_dtype(int dtype) {
  switch (static_cast<c10::ScalarType>(dtype)) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
      return true;
    default:
      return false;
  }
}

// Parsing TorchScript type annotations is not free; messages repeat the same few, so cache them.
c10::TypePtr parse_type(const std::string& annotation) {
  if (annotation.empty() || annotation.size() > 1024) return c10::AnyType::get();
  static Mutex mu(absl::kConstInit);
  static auto* cache ABSL_PT_GUARDED_BY(mu) = new std::map<std::string, c10::TypePtr>;
  MutexLock lock(&mu);
  auto it = cache->find(annotation);
  if (it != cache->end()) return it->second;
  c10::TypePtr type;
  try {  // LibTorch's parser reports an unknown annotation only by throwing
    // TorchScript's own parser gives the static types ("int" is IntType): a List[int] arrives as an IntList, which
    // typed consumers (TorchScript functions, IValue::isIntList) take. (The mobile parser gave DynamicType.)
    type = torch::jit::ScriptTypeParser().parseType(annotation);
  } catch (const std::exception&) {
    type = nullptr;  // unknown annotation: fall back to Any below
  }
  if (!type) type = c10::AnyType::get();
  if (cache->size() < 4096) cache->emplace(annotation, type);
  return type;
}

absl::Status type_mismatch(const c10::IValue& item, const c10::TypePtr& declared) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed message: element of type ", item.type()->str(), " in a container of ", declared->str()));
}

bool is_valid_key(const c10::IValue& k) {
  return k.isString() || k.isInt() || k.isDouble() || k.isBool() || k.isTensor();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Encoding

absl::Status Encoder::encode(const std::vector<c10::IValue>& values, Payload* payload) {
  for (const auto& v : values) {
    if (auto s = encode_value(v, payload->add_values(), payload, 0); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Encoder::encode_tensor(const at::Tensor& t, Payload* payload, uint32_t* index) {
  if (!t.defined()) return absl::InvalidArgumentError("cannot send an undefined tensor");
  if (!t.device().is_cpu()) {
    return absl::UnimplementedError(absl::StrCat("cannot send a tensor on ", t.device().str(), ": only CPU tensors"));
  }
  if (t.layout() != c10::kStrided) return absl::UnimplementedError("cannot send a sparse or non-strided tensor");
  if (!supported_dtype(static_cast<int>(t.scalar_type()))) {
    return absl::UnimplementedError(absl::StrCat("cannot send a tensor of dtype ", c10::toString(t.scalar_type())));
  }
  for (const auto& [impl, i] : seen_) {
    if (impl == t.unsafeGetTensorImpl()) {
      *index = i;
      return absl::OkStatus();
    }
  }
  // A view sends only the bytes it views; a non-contiguous one is packed first (one copy on the sender). A lazily
  // conjugated or negated view (t.conj(), t._neg_view()) sends its values, not the bytes under its bit.
  at::Tensor c = t.is_conj() || t.is_neg() ? t.resolve_conj().resolve_neg() : t;
  if (!c.is_contiguous()) c = c.contiguous();
  TensorMeta* meta = payload->add_tensors();
  meta->set_dtype(static_cast<int>(c.scalar_type()));
  for (int64_t s : c.sizes()) meta->add_sizes(s);
  meta->set_nbytes(c.nbytes());
  meta->set_requires_grad(t.requires_grad());
  *index = static_cast<uint32_t>(payload->tensors_size() - 1);
  seen_.emplace_back(t.unsafeGetTensorImpl(), *index);
  sent_.push_back(t);
  if (by_reference_min_bytes_ > 0 && c.nbytes() >= by_reference_min_bytes_) {
    meta->set_by_reference(true);
    meta->set_remote_addr(reinterpret_cast<uintptr_t>(c.data_ptr()));
    referenced_.push_back(c.detach());
    return absl::OkStatus();
  }
  meta->set_offset(payload_bytes_);
  payload_bytes_ = align_up(payload_bytes_ + c.nbytes());
  // Its storage keeps the bytes alive until they are written: no tensor made for it (a detach() was 7% of a small
  // call's CPU on the serving side).
  if (c.nbytes() > 0) tensors_.push_back({c.storage(), c.data_ptr(), c.nbytes()});
  return absl::OkStatus();
}

absl::Status Encoder::encode_value(const c10::IValue& v, Value* out, Payload* payload, int depth) {
  if (depth > kMaxNesting) return absl::InvalidArgumentError("value nested too deeply to send");
  if (v.isNone()) {
    out->set_none(true);
  } else if (v.isBool()) {
    out->set_b(v.toBool());
  } else if (v.isInt()) {
    out->set_i(v.toInt());
  } else if (v.isDouble()) {
    out->set_d(v.toDouble());
  } else if (v.isComplexDouble()) {
    auto c = v.toComplexDouble();
    out->mutable_c()->set_re(c.real());
    out->mutable_c()->set_im(c.imag());
  } else if (v.isString()) {
    out->set_s(v.toStringRef());
  } else if (v.isTensor()) {
    uint32_t index = 0;
    if (auto s = encode_tensor(v.toTensor(), payload, &index); !s.ok()) return s;
    out->set_tensor(index);
  } else if (v.isList()) {
    auto* list = out->mutable_list();
    list->set_elem_type(v.type()->expectRef<c10::ListType>().getElementType()->annotation_str());
    for (const auto& item : v.toListRef()) {
      if (auto s = encode_value(item, list->add_items(), payload, depth + 1); !s.ok()) return s;
    }
  } else if (v.isTuple()) {
    auto* tuple = out->mutable_tuple();
    for (const auto& item : v.toTupleRef().elements()) {
      if (auto s = encode_value(item, tuple->add_items(), payload, depth + 1); !s.ok()) return s;
    }
  } else if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    auto* d = out->mutable_dict();
    d->set_key_type(dict.keyType()->annotation_str());
    d->set_value_type(dict.valueType()->annotation_str());
    for (const auto& entry : dict) {
      if (auto s = encode_value(entry.key(), d->add_keys(), payload, depth + 1); !s.ok()) return s;
      if (auto s = encode_value(entry.value(), d->add_values(), payload, depth + 1); !s.ok()) return s;
    }
  } else if (const ValueCodec* codec = detail::find_codec(v)) {
    if (to_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("a value of kind '", codec->kind, "' cannot be sent to a client outside the job"));
    }
    auto data = codec->encode(v, to_);
    if (!data.ok()) return data.status();
    out->mutable_ext()->set_kind(codec->kind);
    out->mutable_ext()->set_data(std::move(*data));
  } else {
    return absl::UnimplementedError(absl::StrCat("cannot send a value of kind ", v.tagKind()));
  }
  return absl::OkStatus();
}

grpc::ByteBuffer Encoder::frame(const google::protobuf::MessageLite& header) {
  const size_t header_len = header.ByteSizeLong();
  // Written in place into the slice that is sent (a string first cost an allocation and a copy into the slice).
  const size_t head_len = align_up(4 + header_len);
  grpc::Slice head(head_len);
  auto* h = const_cast<uint8_t*>(head.begin());
  const uint32_t len32 = static_cast<uint32_t>(header_len);
  for (int i = 0; i < 4; ++i) h[i] = static_cast<uint8_t>((len32 >> (8 * i)) & 0xff);
  header.SerializeWithCachedSizesToArray(h + 4);
  std::memset(h + 4 + header_len, 0, head_len - 4 - header_len);  // zero padding up to the payload area

  std::vector<grpc::Slice> slices;
  slices.reserve(1 + 2 * tensors_.size());
  slices.push_back(std::move(head));
  static const char kZeros[kAlign] = {};
  for (auto& t : tensors_) {
    auto* keep = new c10::Storage(std::move(t.storage));
    const size_t n = t.nbytes;
    slices.emplace_back(
        const_cast<void*>(t.data), n, [](void* p) { delete static_cast<c10::Storage*>(p); }, keep);
    if (const size_t pad = align_up(n) - n) slices.emplace_back(kZeros, pad, grpc::Slice::STATIC_SLICE);
  }
  tensors_.clear();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// ---------------------------------------------------------------------------------------------------------------------
// Decoding

absl::StatusOr<Frame> Frame::parse(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* header) {
  Frame f;
  if (!buffer.Dump(&f.slices_).ok()) return absl::InvalidArgumentError("malformed message: unreadable buffer");
  f.starts_.reserve(f.slices_.size());
  for (const auto& s : f.slices_) {
    f.starts_.push_back(f.total_);
    f.total_ += s.size();
  }
  if (f.total_ < 4) return absl::InvalidArgumentError("malformed message: shorter than its frame header");
  uint8_t len_bytes[4];
  f.copy_out(0, 4, len_bytes);
  const uint32_t header_len =
      len_bytes[0] | (len_bytes[1] << 8) | (len_bytes[2] << 16) | (uint32_t{len_bytes[3]} << 24);
  if (header_len > kMaxHeaderBytes || header_len > f.total_ - 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed message: header length ", header_len, " exceeds the message (", f.total_, " bytes)"));
  }
  bool parsed;
  // The sender puts the header in the first slice; unless the receiving transport split it (gRPC may), it is parsed
  // there, without a copy.
  if (f.slices_[0].size() >= 4 + header_len) {
    parsed = header->ParseFromArray(f.slices_[0].begin() + 4, static_cast<int>(header_len));
  } else {
    std::string head(header_len, '\0');
    f.copy_out(4, header_len, head.data());
    parsed = header->ParseFromString(head);
  }
  if (!parsed) return absl::InvalidArgumentError("malformed message: header does not parse");
  f.payload_start_ = std::min<uint64_t>(align_up(4 + header_len), f.total_);
  return f;
}

void Frame::copy_out(uint64_t offset, uint64_t len, void* dst) const {
  auto* out = static_cast<uint8_t*>(dst);
  // First slice that contains `offset` (starts_ is sorted).
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin() - 1;
  while (len > 0) {
    const uint64_t in_slice = offset - starts_[i];
    const uint64_t n = std::min<uint64_t>(len, slices_[i].size() - in_slice);
    std::memcpy(out, slices_[i].begin() + in_slice, n);
    out += n;
    offset += n;
    len -= n;
    ++i;
  }
}

namespace {

// Reads `nbytes` at `remote` in process `pid` into a pooled tensor (one copy, by the kernel).
absl::StatusOr<at::Tensor> read_remote(pid_t pid, uint64_t remote, uint64_t nbytes, std::vector<int64_t>& sizes,
                                       c10::ScalarType dtype) {
  at::Tensor t;
  try {
    t = detail::pooled_empty(sizes, dtype);
  } catch (const std::exception&) {  // std::bad_alloc: a size no process here can hold
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", nbytes, " bytes for a tensor sent by reference"));
  }
  auto* dst = static_cast<uint8_t*>(t.data_ptr());
  uint64_t done = 0;
  while (done < nbytes) {
    iovec local{dst + done, static_cast<size_t>(nbytes - done)};
    iovec far{reinterpret_cast<void*>(remote + done), static_cast<size_t>(nbytes - done)};
    const ssize_t n = process_vm_readv(pid, &local, 1, &far, 1, 0);
    if (n <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("cross-memory read of ", nbytes, " bytes from process ", pid,
                                                     " failed: ", std::strerror(n < 0 ? errno : EFAULT)));
    }
    done += static_cast<uint64_t>(n);
  }
  return t;
}

}  // namespace

absl::StatusOr<at::Tensor> Frame::decode_tensor(const TensorMeta& meta, pid_t cma_pid,
                                                uint64_t max_referenced_bytes) const {
  if (!supported_dtype(meta.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("malformed message: unsupported dtype ", meta.dtype()));
  }
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype());
  if (meta.sizes_size() > kMaxDims) return absl::InvalidArgumentError("malformed message: too many dimensions");
  const uint64_t item = c10::elementSize(dtype);
  uint64_t numel = 1;
  std::vector<int64_t> sizes(meta.sizes().begin(), meta.sizes().end());
  for (int64_t s : sizes) {
    if (s < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel)) {
      return absl::InvalidArgumentError("malformed message: invalid tensor size");
    }
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, item, &nbytes) || nbytes != meta.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("malformed message: tensor claims ", meta.nbytes(), " bytes for ",
                                                   numel, " elements of ", item, " bytes"));
  }
  if (meta.by_reference()) {
    if (cma_pid <= 0) {
      return absl::InvalidArgumentError(
          "malformed message: a tensor sent by reference on a channel without cross-memory access");
    }
    if (nbytes == 0) return at::empty(sizes, at::TensorOptions().dtype(dtype));
    if (max_referenced_bytes > 0 && nbytes > max_referenced_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("a tensor of ", nbytes, " bytes sent by reference exceeds the ",
                                                       "message limit of ", max_referenced_bytes));
    }
    return read_remote(cma_pid, meta.remote_addr(), nbytes, sizes, dtype);
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(meta.offset(), nbytes, &end) || end > payload_size()) {
    return absl::InvalidArgumentError(absl::StrCat("malformed message: tensor bytes [", meta.offset(), ", +", nbytes,
                                                   ") exceed the payload of ", payload_size(), " bytes"));
  }
  const auto options = at::TensorOptions().dtype(dtype);
  if (nbytes == 0) return at::empty(sizes, options);

  const uint64_t begin = payload_start_ + meta.offset();
  const size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
  const uint64_t in_slice = begin - starts_[i];
  const uint8_t* ptr = slices_[i].begin() + in_slice;
  if (in_slice + nbytes <= slices_[i].size() && reinterpret_cast<uintptr_t>(ptr) % item == 0) {
    // Zero copy: the tensor lives in the received slice, which it keeps alive.
    auto* keep = new grpc::Slice(slices_[i]);
    return at::from_blob(
        const_cast<uint8_t*>(ptr), sizes, [keep](void*) { delete keep; }, options);
  }
  at::Tensor t = detail::pooled_empty(sizes, dtype);
  copy_out(begin, nbytes, t.data_ptr());
  return t;
}

absl::StatusOr<c10::IValue> Frame::decode_value(const Value& v, const Payload& payload,
                                                std::vector<c10::IValue>& tensors, int depth,
                                                const Origin& origin) const {
  const pid_t cma_pid = origin.cma_pid;
  if (depth > kMaxNesting) return absl::InvalidArgumentError("malformed message: value nested too deeply");
  switch (v.kind_case()) {
    case Value::kNone:
      return c10::IValue();
    case Value::kB:
      return c10::IValue(v.b());
    case Value::kI:
      return c10::IValue(static_cast<int64_t>(v.i()));
    case Value::kD:
      return c10::IValue(v.d());
    case Value::kC:
      return c10::IValue(c10::complex<double>(v.c().re(), v.c().im()));
    case Value::kS:
      return c10::IValue(v.s());
    case Value::kTensor: {
      if (v.tensor() >= tensors.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed message: tensor index ", v.tensor(), " out of range"));
      }
      if (tensors[v.tensor()].isNone()) {
        const auto& meta = payload.tensors(v.tensor());
        auto t = decode_tensor(meta, cma_pid, origin.max_referenced_bytes);
        if (!t.ok()) return t.status();
        if (meta.requires_grad() && !origin.tensors && at::isFloatingType(t->scalar_type())) {
          t->set_requires_grad(true);
        }
        tensors[v.tensor()] = std::move(*t);
      }
      return tensors[v.tensor()];  // a tensor sent twice arrives as one tensor, as it was sent
    }
    case Value::kList: {
      const c10::TypePtr elem = parse_type(v.list().elem_type());
      c10::impl::GenericList list(elem);
      list.reserve(v.list().items_size());
      for (const auto& item : v.list().items()) {
        auto d = decode_value(item, payload, tensors, depth + 1, origin);
        if (!d.ok()) return d.status();
        if (!d->type()->isSubtypeOf(*elem)) return type_mismatch(*d, elem);
        list.push_back(std::move(*d));
      }
      return c10::IValue(std::move(list));
    }
    case Value::kTuple: {
      std::vector<c10::IValue> items;
      items.reserve(v.tuple().items_size());
      for (const auto& item : v.tuple().items()) {
        auto d = decode_value(item, payload, tensors, depth + 1, origin);
        if (!d.ok()) return d.status();
        items.push_back(std::move(*d));
      }
      return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
    }
    case Value::kDict: {
      const auto& d = v.dict();
      if (d.keys_size() != d.values_size()) return absl::InvalidArgumentError("malformed message: dict keys/values");
      const c10::TypePtr kt = parse_type(d.key_type());
      const c10::TypePtr vt = parse_type(d.value_type());
      c10::impl::GenericDict dict(kt, vt);
      for (int i = 0; i < d.keys_size(); ++i) {
        auto k = decode_value(d.keys(i), payload, tensors, depth + 1, origin);
        if (!k.ok()) return k.status();
        auto val = decode_value(d.values(i), payload, tensors, depth + 1, origin);
        if (!val.ok()) return val.status();
        if (!is_valid_key(*k)) return absl::InvalidArgumentError("malformed message: unhashable dict key");
        if (!k->type()->isSubtypeOf(*kt)) return type_mismatch(*k, kt);
        if (!val->type()->isSubtypeOf(*vt)) return type_mismatch(*val, vt);
        dict.insert_or_assign(std::move(*k), std::move(*val));
      }
      return c10::IValue(std::move(dict));
    }
    case Value::kExt: {
      if (origin.from_client) {
        return absl::InvalidArgumentError(
            absl::StrCat("a value of kind '", v.ext().kind(), "' cannot come from a client outside the job"));
      }
      const ValueCodec* codec = detail::find_codec(v.ext().kind());
      if (!codec) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed message: no codec for values of kind '", v.ext().kind(), "'"));
      }
      std::vector<Future> ignored;
      return codec->decode(v.ext().data(), origin.from, origin.wait ? origin.wait : &ignored);
    }
    case Value::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("malformed message: value of unknown kind");
}

absl::StatusOr<std::vector<c10::IValue>> Frame::decode(const Payload& payload, const Origin& origin) const {
  // The bound holds for the message's tensors read by reference together, as for a frame that carries them: else one
  // message could claim any number of them (each under it, or one address many times) and exhaust this worker's
  // memory.
  if (origin.max_referenced_bytes > 0) {
    uint64_t total = 0;
    for (const auto& meta : payload.tensors()) {
      if (meta.by_reference() &&
          (__builtin_add_overflow(total, meta.nbytes(), &total) || total > origin.max_referenced_bytes)) {
        return absl::ResourceExhaustedError(absl::StrCat("the message's tensors sent by reference exceed the message ",
                                                         "limit of ", origin.max_referenced_bytes, " bytes together"));
      }
    }
  }
  std::vector<c10::IValue> tensors(payload.tensors_size());  // None until first referenced
  std::vector<c10::IValue> values;
  values.reserve(payload.values_size());
  for (const auto& v : payload.values()) {
    auto d = decode_value(v, payload, tensors, 0, origin);
    if (!d.ok()) return d.status();
    values.push_back(std::move(*d));
  }
  bool read_by_reference = false;
  for (int i = 0; i < payload.tensors_size(); ++i) {
    read_by_reference |= payload.tensors(i).by_reference() && payload.tensors(i).nbytes() > 0 && !tensors[i].isNone();
  }
  if (read_by_reference) {
    if (origin.lease_id == 0) {
      return absl::InvalidArgumentError("malformed message: tensors sent by reference without the caller's lease");
    }
    // After the tensors: the caller ends the lease before it lets them go, so a word still holding the id means
    // they were alive when read.
    uint64_t word = 0;
    iovec local{&word, sizeof word};
    iovec far{reinterpret_cast<void*>(origin.lease_address), sizeof word};
    if (process_vm_readv(origin.cma_pid, &local, 1, &far, 1, 0) != static_cast<ssize_t>(sizeof word) ||
        word != origin.lease_id) {
      if (origin.leases_lapsed) ++*origin.leases_lapsed;
      return absl::AbortedError(
          "the caller let go of the tensors it sent by reference before they were read (its call had ended: timed "
          "out or cancelled); the call is not run");
    }
  }
  if (origin.tensors) {
    origin.tensors->assign(tensors.size(), at::Tensor());
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].isTensor()) (*origin.tensors)[i] = tensors[i].toTensor();
    }
  }
  return values;
}

}  // namespace tandem::rpc::wire
