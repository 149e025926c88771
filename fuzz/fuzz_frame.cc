// libFuzzer target: a received RPC frame (rpc/detail/wire.h) — the frame header, the protobuf Request or Response,
// every value and tensor's metadata, tensors sent by reference (read from this process), and a re-encode of what
// decoded.
//
// Input: [selector byte][slice size byte][frame bytes]. The selector picks Request or Response, whether by-reference
// tensors may be read, whether the message is traced, and whether it comes from a client outside the job; the slice
// size splits the frame into slices as a network would (so that copies across slices and unaligned tensors are
// reached).
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/detail/wire.h"

namespace {

using tandem::rpc::wire::Encoder;
using tandem::rpc::wire::Frame;

grpc::ByteBuffer sliced(const uint8_t* data, size_t size, size_t slice) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < size; at += slice) {
    slices.emplace_back(data + at, std::min(slice, size - at));
  }
  if (slices.empty()) slices.emplace_back("", 0);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void decode_and_reencode(const Frame& frame, const tandem::wire::Payload& payload, const Frame::Origin& origin) {
  auto values = frame.decode(payload, origin);
  if (!values.ok()) return;
  // What decoded must encode again and decode to as many values.
  tandem::wire::Request again;
  Encoder encoder;
  if (!encoder.encode(*values, again.mutable_args()).ok()) return;  // e.g. a value kind only an extension encodes
  grpc::ByteBuffer bytes = encoder.frame(again);
  tandem::wire::Request parsed;
  auto frame2 = Frame::parse(bytes, &parsed);
  if (!frame2.ok()) __builtin_trap();
  auto values2 = frame2->decode(parsed.args());
  if (!values2.ok() || values2->size() != values->size()) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t selector = data[0];
  const size_t slice = 1 + data[1] * 16;
  const grpc::ByteBuffer buffer = sliced(data + 2, size - 2, slice);
  std::vector<tandem::rpc::Future> wait;
  std::vector<at::Tensor> traced;
  Frame::Origin origin;
  origin.from = 1;
  origin.wait = &wait;
  if (selector & 2) origin.cma_pid = getpid();  // by-reference tensors are read from this very process
  if (selector & 4) origin.tensors = &traced;
  if (selector & 8) origin.from_client = true;  // a client outside the job: extension values refused
  origin.max_referenced_bytes = uint64_t{1} << 24;
  if (selector & 1) {
    tandem::wire::Response response;
    auto frame = Frame::parse(buffer, &response);
    if (frame.ok()) decode_and_reencode(*frame, response.result(), origin);
  } else {
    tandem::wire::Request request;
    auto frame = Frame::parse(buffer, &request);
    if (frame.ok()) decode_and_reencode(*frame, request.args(), origin);
  }
  return 0;
}
