// libFuzzer target: every control message's decoder — the rendezvous record, the direct channel's hello and welcome,
// an RRef descriptor, a distributed autograd attachment, and the store's requests. The first byte picks the decoder.
#include <cstdint>
#include <string>

#include "dist_autograd/detail/trace.h"
#include "proto/tandem_rpc.pb.h"
#include "rpc/detail/agent.h"
#include "rpc/detail/direct.h"
#include "rref/detail/descriptor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer buffer(&slice, 1);
  const std::string token(64, 'a');
  switch (data[0] % 8) {
    case 0:
      (void)tandem::rpc::detail::parse_record(bytes, 1, 4);
      break;
    case 1:
      (void)tandem::rpc::direct::parse_hello(buffer, token);
      break;
    case 2:
      (void)tandem::rpc::direct::parse_welcome(buffer);
      break;
    case 3:
      (void)tandem::rref::detail::parse_descriptor(bytes);
      break;
    case 4:
      (void)tandem::dist_autograd::parse_trace(bytes, size % 17);
      break;
    case 5: {
      tandem::wire::StoreSetRequest m;
      (void)m.ParseFromString(bytes);
      break;
    }
    case 6: {
      tandem::wire::StoreAddRequest m;
      (void)m.ParseFromString(bytes);
      break;
    }
    default: {
      tandem::wire::StoreWaitRequest m;
      (void)m.ParseFromString(bytes);
      break;
    }
  }
  return 0;
}
