// The frame format of RPC messages and the codec between c10::IValue and it.
//
// A message is one grpc::ByteBuffer:
//   [u32 little-endian header length][header: a serialized tandem.wire.Request or Response][pad][tensor bytes, pad ...]
// The header describes every value; a tensor is a TensorMeta whose bytes lie in the payload area at `offset`. The
// payload area starts at the first multiple of kAlign after the header and every tensor's offset is a multiple of
// kAlign, so a receiver that gets the frame in one slice can use every tensor in place. On send each tensor's bytes are
// their own grpc::Slice over the tensor's storage (no copy; the slice holds a reference to the tensor until gRPC is
// done with it). On receive a tensor whose bytes arrived in one slice, suitably aligned, is built over that slice
// without a copy; otherwise it is copied once into a fresh tensor.
//
// Every size in a received header is validated against the frame before use: a frame that lies gets INVALID_ARGUMENT.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Storage.h>
#include <grpcpp/support/byte_buffer.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/future.h"

namespace tandem::rpc::wire {

using tandem::rpc::Future;

// Collects tensors while values are encoded into a Payload.
class Encoder {
 public:
  // Tensors of at least `by_reference_min_bytes` bytes (0: none) are sent by reference (TensorMeta.by_reference): the
  // caller must keep referenced() alive until the receiver has read them, i.e. until the call completes.
  // `to`: the rank the message goes to, for value codecs (rpc/extension.h); -1 (kClientRank) for a client outside the
  // job or a message without values: a value that needs a codec is refused.
  explicit Encoder(uint64_t by_reference_min_bytes = 0, int to = -1)
      : by_reference_min_bytes_(by_reference_min_bytes), to_(to) {}
  std::vector<at::Tensor>& referenced() { return referenced_; }
  // The tensors encoded so far, as given (before any contiguous copy), indexed as in Payload.tensors.
  const std::vector<at::Tensor>& sent() const { return sent_; }

  // Encodes `values` into `payload`; tensors are queued for the frame. Fails for values Tandem cannot send
  // (objects, quantized/sparse/non-CPU tensors).
  absl::Status encode(const std::vector<c10::IValue>& values, tandem::wire::Payload* payload);
  // Frames `header` (which holds the payload encoded above) and the queued tensors.
  grpc::ByteBuffer frame(const google::protobuf::MessageLite& header);

 private:
  absl::Status encode_value(const c10::IValue& v, tandem::wire::Value* out, tandem::wire::Payload* payload, int depth);
  absl::Status encode_tensor(const at::Tensor& t, tandem::wire::Payload* payload, uint32_t* index);
  const uint64_t by_reference_min_bytes_;
  const int to_;
  struct Queued {  // a tensor's bytes queued for the frame, and the storage that holds them
    c10::Storage storage;
    const void* data;
    size_t nbytes;
  };
  std::vector<Queued> tensors_;
  std::vector<at::Tensor> referenced_;
  std::vector<at::Tensor> sent_;
  std::vector<std::pair<const void*, uint32_t>> seen_;  // TensorImpl -> index: a tensor sent twice is sent once
  uint64_t payload_bytes_ = 0;
};

// A received frame: parses the header and hands out tensors over the payload area.
class Frame {
 public:
  // Parses `buffer` (taking references to its slices) and its header into `header`.
  static absl::StatusOr<Frame> parse(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* header);
  // What decoding needs to know about the message's origin.
  struct Origin {
    pid_t cma_pid = 0;                    // tensors sent by reference are read from this process; 0: they are refused
    int from = -1;                        // the sender's rank, for value codecs
    std::vector<Future>* wait = nullptr;  // codecs' futures that must complete before the values are used
    // When set, the message is traced (rpc/extension.h): receives the decoded tensors indexed as in Payload.tensors
    // (undefined for one no value refers to), and no tensor is made to require grad (the tracer decides).
    std::vector<at::Tensor>* tensors = nullptr;
    uint64_t max_referenced_bytes = 0;  // bound on a tensor read by reference (the message limit); 0: none
    bool from_client = false;           // a client outside the job sent it: extension values are refused
    // The caller's lease on its tensors sent by reference (Request.lease_address/lease_id, lease.h): read after them
    // from cma_pid; a message with such tensors is refused unless it holds lease_id then.
    uint64_t lease_address = 0, lease_id = 0;
    // When set, counts a message refused here because its lease had lapsed (TransportStats::leases_lapsed).
    std::atomic<int64_t>* leases_lapsed = nullptr;
  };
  // Decodes the values of `payload`, validating every tensor against the frame.
  absl::StatusOr<std::vector<c10::IValue>> decode(const tandem::wire::Payload& payload, const Origin& origin) const;
  absl::StatusOr<std::vector<c10::IValue>> decode(const tandem::wire::Payload& payload) const {
    return decode(payload, Origin{});
  }

  uint64_t payload_size() const { return total_ - payload_start_; }

 private:
  absl::StatusOr<c10::IValue> decode_value(const tandem::wire::Value& v, const tandem::wire::Payload& payload,
                                           std::vector<c10::IValue>& tensors, int depth, const Origin& origin) const;
  absl::StatusOr<at::Tensor> decode_tensor(const tandem::wire::TensorMeta& meta, pid_t cma_pid,
                                           uint64_t max_referenced_bytes) const;
  void copy_out(uint64_t offset, uint64_t len, void* dst) const;

  std::vector<grpc::Slice> slices_;
  std::vector<uint64_t> starts_;  // byte offset of each slice within the frame
  uint64_t total_ = 0;
  uint64_t payload_start_ = 0;
};

// Upper bounds on what a header may claim (protects the decoder from absurd allocations).
constexpr int kMaxDims = 64;
// Containers in containers: below protobuf's own bound on a header's nesting (100 messages, two per level), so that a
// value nested too deeply gets this error, not "the header does not parse".
constexpr int kMaxNesting = 32;
constexpr uint32_t kMaxHeaderBytes = 64u << 20;
constexpr uint64_t kAlign = 64;
constexpr uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace tandem::rpc::wire
