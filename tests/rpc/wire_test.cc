// The frame codec in one process: every dtype bit-exact, views, containers, fragmented frames, and frames that lie.
#include "tandem/rpc/detail/wire.h"

#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>

#include "tandem/rpc/detail/lease.h"
#include "tests/common/test_env.h"

namespace tandem::rpc::wire {
namespace {

namespace pb = tandem::wire;
using test::bit_equal;

std::vector<c10::IValue> round_trip(const std::vector<c10::IValue>& values, size_t piece = 0) {
  Encoder encoder;
  pb::Request request;
  auto s = encoder.encode(values, request.mutable_args());
  EXPECT_TRUE(s.ok()) << s;
  grpc::ByteBuffer buffer = encoder.frame(request);
  if (piece) buffer = test::refragment(buffer, piece);
  pb::Request got;
  auto frame = Frame::parse(buffer, &got);
  EXPECT_TRUE(frame.ok()) << frame.status();
  auto decoded = frame->decode(got.args());
  EXPECT_TRUE(decoded.ok()) << decoded.status();
  return decoded.ok() ? *decoded : std::vector<c10::IValue>{};
}

absl::Status decode_status(const grpc::ByteBuffer& buffer) {
  pb::Request got;
  auto frame = Frame::parse(buffer, &got);
  if (!frame.ok()) return frame.status();
  return frame->decode(got.args()).status();
}

TEST(UnitWire, EveryDtypeRoundTripsBitExact) {
  for (auto dtype : test::all_dtypes()) {
    for (size_t piece : {size_t{0}, size_t{7}}) {  // one slice (zero-copy path) and many odd slices (copy path)
      at::Tensor t = test::random_tensor(dtype, {3, 5});
      auto out = round_trip({t}, piece);
      ASSERT_EQ(out.size(), 1u);
      EXPECT_TRUE(bit_equal(out[0].toTensor(), t)) << c10::toString(dtype) << " piece " << piece;
    }
  }
}

// A conjugate or negative view (a bit on the tensor, its bytes unchanged) arrives as the values it stands for; a list
// typed "int" on the wire arrives as an IntList (a static type, not LibTorch's DynamicType).
TEST(UnitWire, LazyConjugateAndNegativeViewsSendTheirValuesAndListsKeepTheirType) {
  at::Tensor z = at::complex(at::arange(4, at::kFloat), at::ones({4}));
  at::Tensor x = at::arange(4, at::kDouble);
  ASSERT_TRUE(z.conj().is_conj());
  ASSERT_TRUE(x._neg_view().is_neg());
  auto out = round_trip({z.conj(), x._neg_view(), c10::IValue(std::vector<int64_t>{1, 2})});
  EXPECT_TRUE(bit_equal(out[0].toTensor(), z.conj().resolve_conj()));
  EXPECT_TRUE(out[0].toTensor().equal(at::complex(at::arange(4, at::kFloat), -at::ones({4}))));
  EXPECT_TRUE(out[1].toTensor().equal(-x));
  EXPECT_TRUE(out[2].isIntList()) << out[2].type()->str();
}

TEST(UnitWire, ViewsSendOnlyTheirBytes) {
  at::Tensor base = at::arange(1000, at::kFloat).reshape({10, 100});
  at::Tensor strided = base.t().slice(0, 0, 50, 3);  // non-contiguous
  at::Tensor narrow = base.narrow(0, 4, 2);          // contiguous, with a storage offset
  Encoder encoder;
  pb::Request request;
  ASSERT_TRUE(encoder.encode({strided, narrow}, request.mutable_args()).ok());
  EXPECT_EQ(request.args().tensors(0).nbytes(), static_cast<uint64_t>(strided.numel() * 4));
  EXPECT_EQ(request.args().tensors(1).nbytes(), 200u * 4);
  auto out = round_trip({strided, narrow});
  EXPECT_TRUE(bit_equal(out[0].toTensor(), strided));
  EXPECT_TRUE(bit_equal(out[1].toTensor(), narrow));
}

TEST(UnitWire, TensorSentTwiceArrivesOnce) {
  at::Tensor t = at::ones({4});
  Encoder encoder;
  pb::Request request;
  ASSERT_TRUE(encoder.encode({t, t}, request.mutable_args()).ok());
  EXPECT_EQ(request.args().tensors_size(), 1);
  auto out = round_trip({t, t});
  EXPECT_TRUE(out[0].toTensor().is_same(out[1].toTensor()));
}

TEST(UnitWire, ContainersAndScalarsRoundTrip) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("w", at::ones({2}));
  std::vector<c10::IValue> values = {
      c10::IValue(),
      c10::IValue(true),
      c10::IValue(int64_t{-7}),
      c10::IValue(2.5),
      c10::IValue(c10::complex<double>(1, -2)),
      c10::IValue(std::string("héllo")),
      c10::IValue(std::vector<int64_t>{1, 2, 3}),
      c10::IValue(c10::List<int64_t>()),
      c10::IValue(dict),
      c10::IValue(c10::ivalue::Tuple::create({c10::IValue(1), c10::IValue("x")})),
  };
  auto out = round_trip(values);
  ASSERT_EQ(out.size(), values.size());
  EXPECT_TRUE(out[0].isNone());
  EXPECT_EQ(out[1].toBool(), true);
  EXPECT_EQ(out[2].toInt(), -7);
  EXPECT_EQ(out[3].toDouble(), 2.5);
  EXPECT_EQ(out[4].toComplexDouble(), c10::complex<double>(1, -2));
  EXPECT_EQ(out[5].toStringRef(), "héllo");
  EXPECT_EQ(out[6].toIntVector(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(*out[6].type(), *c10::ListType::ofInts());  // typed on arrival, so TorchScript accepts it
  EXPECT_EQ(*out[7].type(), *c10::ListType::ofInts());  // even when empty
  EXPECT_TRUE(out[8].toGenericDict().at("w").toTensor().equal(at::ones({2})));
  EXPECT_EQ(out[9].toTupleRef().elements()[1].toStringRef(), "x");
}

TEST(UnitWire, UnsupportedValuesAreRefusedBySender) {
  Encoder encoder;
  pb::Request request;
  at::Tensor q = at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8);
  EXPECT_EQ(encoder.encode({q}, request.mutable_args()).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(encoder.encode({at::ones({2}).to_sparse()}, request.mutable_args()).code(),
            absl::StatusCode::kUnimplemented);
}

TEST(UnitWire, MalformedFramesAreRejected) {
  EXPECT_EQ(decode_status(test::raw_buffer("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_status(test::raw_buffer("ab")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_status(test::raw_buffer(std::string("\xff\xff\xff\x0f", 4) + "xyz")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_status(test::raw_buffer(std::string("\x05\x00\x00\x00", 4) + "\xff\xff\xff\xff\xff")).code(),
            absl::StatusCode::kInvalidArgument);
}

// A header whose single tensor is described by `meta`, followed by `payload` bytes.
absl::Status decode_tensor_frame(const pb::TensorMeta& meta, const std::string& payload) {
  pb::Request request;
  request.mutable_args()->add_values()->set_tensor(0);
  *request.mutable_args()->add_tensors() = meta;
  return decode_status(test::make_frame(request, payload));
}

pb::TensorMeta float_meta(std::vector<int64_t> sizes, uint64_t nbytes, uint64_t offset = 0) {
  pb::TensorMeta m;
  m.set_dtype(static_cast<int>(at::kFloat));
  for (auto s : sizes) m.add_sizes(s);
  m.set_nbytes(nbytes);
  m.set_offset(offset);
  return m;
}

TEST(UnitWire, LyingTensorMetadataIsRejected) {
  const std::string payload(64, 'x');
  EXPECT_TRUE(decode_tensor_frame(float_meta({16}, 64), payload).ok());
  EXPECT_EQ(decode_tensor_frame(float_meta({32}, 128), payload).code(),
            absl::StatusCode::kInvalidArgument);                                                             // too long
  EXPECT_EQ(decode_tensor_frame(float_meta({16}, 60), payload).code(), absl::StatusCode::kInvalidArgument);  // mismatch
  EXPECT_EQ(decode_tensor_frame(float_meta({16}, 64, 8), payload).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_tensor_frame(float_meta({-1}, 4), payload).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_tensor_frame(float_meta({1LL << 62, 1LL << 62}, 0), payload).code(),
            absl::StatusCode::kInvalidArgument);  // numel overflows
  EXPECT_EQ(decode_tensor_frame(float_meta({16}, 64, ~uint64_t{0} - 10), payload).code(),
            absl::StatusCode::kInvalidArgument);  // offset + nbytes overflows
  auto bad_dtype = float_meta({16}, 64);
  bad_dtype.set_dtype(12345);
  EXPECT_EQ(decode_tensor_frame(bad_dtype, payload).code(), absl::StatusCode::kInvalidArgument);
  auto quantized = float_meta({16}, 16);
  quantized.set_dtype(static_cast<int>(at::kQInt8));
  EXPECT_EQ(decode_tensor_frame(quantized, payload).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> many_dims(100, 1);
  EXPECT_EQ(decode_tensor_frame(float_meta(many_dims, 4), payload).code(), absl::StatusCode::kInvalidArgument);
}

TEST(UnitWire, BadReferencesAndTypesAreRejected) {
  pb::Request request;
  request.mutable_args()->add_values()->set_tensor(3);  // no such tensor
  EXPECT_EQ(decode_status(test::make_frame(request, "")).code(), absl::StatusCode::kInvalidArgument);

  pb::Request typed;
  auto* list = typed.mutable_args()->add_values()->mutable_list();
  list->set_elem_type("int");
  list->add_items()->set_s("not an int");
  EXPECT_EQ(decode_status(test::make_frame(typed, "")).code(), absl::StatusCode::kInvalidArgument);

  pb::Request empty_value;
  empty_value.mutable_args()->add_values();
  EXPECT_EQ(decode_status(test::make_frame(empty_value, "")).code(), absl::StatusCode::kInvalidArgument);

  // 40 tuples deep: a header protobuf parses (its bound is about 48), refused by the decoder's own bound.
  pb::Request deep;
  auto* v = deep.mutable_args()->add_values();
  for (int i = 0; i < 40; ++i) v = v->mutable_tuple()->add_items();
  v->set_i(1);
  const absl::Status too_deep = decode_status(test::make_frame(deep, ""));
  EXPECT_EQ(too_deep.code(), absl::StatusCode::kInvalidArgument) << too_deep;
  EXPECT_NE(too_deep.message().find("nested too deeply"), std::string::npos) << too_deep;
  // The sender refuses it first.
  c10::IValue nested(int64_t{1});
  for (int i = 0; i < 40; ++i) nested = c10::ivalue::Tuple::create({nested});
  Encoder encoder;
  pb::Request sent;
  EXPECT_EQ(encoder.encode({nested}, sent.mutable_args()).code(), absl::StatusCode::kInvalidArgument);
}

// A tensor sent by reference is read only while the caller's lease on it holds (rpc/detail/lease.h): once the caller
// ended it (its call timed out, and the tensor may be freed), the message is refused, and it is read as before. Each
// refusal for a lapsed lease is counted where it is detected (TransportStats::leases_lapsed), no other refusal.
TEST(UnitWire, TensorsByReferenceAreReadOnlyWhileTheCallersLeaseHolds) {
  const at::Tensor t = at::arange(1024, at::kFloat);
  std::atomic<int64_t> lapsed{0};
  auto frame_of = [&](const detail::Lease& lease, pb::Request* got) {
    Encoder encoder(/*by_reference_min_bytes=*/1);
    pb::Request request;
    EXPECT_TRUE(encoder.encode({t}, request.mutable_args()).ok());
    EXPECT_EQ(encoder.referenced().size(), 1u);
    request.set_lease_address(lease.address());
    request.set_lease_id(lease.id());
    return Frame::parse(encoder.frame(request), got);
  };
  auto origin = [&lapsed](const pb::Request& got) {
    Frame::Origin o;
    o.cma_pid = getpid();
    o.lease_address = got.lease_address();
    o.lease_id = got.lease_id();
    o.leases_lapsed = &lapsed;
    return o;
  };
  detail::Lease lease = detail::Lease::take();
  pb::Request got;
  auto frame = frame_of(lease, &got);
  ASSERT_TRUE(frame.ok()) << frame.status();
  auto read = frame->decode(got.args(), origin(got));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(at::equal((*read)[0].toTensor(), t));
  EXPECT_EQ(lapsed.load(), 0);

  lease.end();  // the call ended at the caller: the callee must not use what it reads now
  auto late = frame->decode(got.args(), origin(got));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << late.status();
  EXPECT_EQ(lapsed.load(), 1);
  // The word reused by another call holds another id: still refused.
  detail::Lease next = detail::Lease::take();
  EXPECT_EQ(frame->decode(got.args(), origin(got)).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(lapsed.load(), 2);
  // Without a lease at all: malformed, and no lease lapsed.
  pb::Request none;
  auto unleased = frame_of(detail::Lease(), &none);
  ASSERT_TRUE(unleased.ok());
  EXPECT_EQ(unleased->decode(none.args(), origin(none)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lapsed.load(), 2);
}

// The bound on tensors read by reference holds for a message's together, not for each alone.
TEST(UnitWire, TensorsByReferenceOverTheLimitTogetherAreRefused) {
  pb::Request request;
  for (int i = 0; i < 3; ++i) {
    pb::TensorMeta* m = request.mutable_args()->add_tensors();
    *m = float_meta({256}, 1024);
    m->set_by_reference(true);
    m->set_remote_addr(4096);
    request.mutable_args()->add_values()->set_tensor(i);
  }
  pb::Request got;
  auto frame = Frame::parse(test::make_frame(request, ""), &got);
  ASSERT_TRUE(frame.ok()) << frame.status();
  Frame::Origin origin;
  origin.cma_pid = getpid();
  origin.max_referenced_bytes = 2048;  // each of the three is under it, their 3072 bytes are not
  const absl::Status s = frame->decode(got.args(), origin).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("together"), std::string::npos) << s;
}

TEST(UnitWire, ZeroCopyReceiveAliasesTheBuffer) {
  at::Tensor t = at::arange(256, at::kFloat);
  Encoder encoder;
  pb::Request request;
  ASSERT_TRUE(encoder.encode({t}, request.mutable_args()).ok());
  grpc::ByteBuffer buffer = test::refragment(encoder.frame(request), 1 << 20);  // one slice owned by the buffer
  grpc::Slice single;
  ASSERT_TRUE(buffer.TrySingleSlice(&single).ok());
  pb::Request got;
  auto frame = Frame::parse(buffer, &got);
  ASSERT_TRUE(frame.ok());
  auto out = frame->decode(got.args());
  ASSERT_TRUE(out.ok());
  const auto* data = static_cast<const uint8_t*>((*out)[0].toTensor().data_ptr());
  EXPECT_TRUE(data >= single.begin() && data < single.end()) << "a one-slice frame must be used in place";
  EXPECT_TRUE(bit_equal((*out)[0].toTensor(), t));
}

}  // namespace
}  // namespace tandem::rpc::wire
