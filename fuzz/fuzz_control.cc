// libFuzzer target: every control message's decoder — the rendezvous record, the direct channel's hello and welcome
// (and over TCP its challenge and proved hello),
// an RRef descriptor, a distributed autograd attachment, the store's requests, and the launchers' rendezvous records.
// The first byte picks the decoder.
#include <cstdint>
#include <string>

#include "proto/tandem_rpc.pb.h"
#include "tandem/dist_autograd/detail/trace.h"
#include "tandem/elastic/detail/records.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/direct.h"
#include "tandem/rref/detail/descriptor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer buffer(&slice, 1);
  const std::string token(64, 'a');
  switch (data[0] % 12) {
    case 0:
      (void)tandem::rpc::detail::parse_record(bytes, 1, 4);
      break;
    case 1:
      (void)tandem::rpc::direct::parse_hello(buffer, token, std::string(64, 'c'));
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
    case 8:
      (void)tandem::elastic::detail::parse_node(bytes, "node");
      break;
    case 9:
      (void)tandem::elastic::detail::parse_round(bytes, "closed");
      break;
    case 10:
      (void)tandem::elastic::detail::parse_end(bytes, "ended");
      break;
    case 11:
      (void)tandem::rpc::direct::parse_challenge(buffer);
      break;
    default: {
      tandem::wire::StoreWaitRequest m;
      (void)m.ParseFromString(bytes);
      break;
    }
  }
  return 0;
}
