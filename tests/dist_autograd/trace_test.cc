// The distributed autograd attachment (proto/tandem_rpc.proto: AutogradTrace) is validated before anything is recorded.
#include <gtest/gtest.h>

#include "tandem/dist_autograd/detail/trace.h"

namespace tandem::dist_autograd {
namespace {

TEST(UnitAutogradWire, TraceIsValidated) {
  tandem::wire::AutogradTrace t;
  t.set_context_id(3);
  EXPECT_TRUE(parse_trace(t.SerializeAsString(), 0).ok());
  t.set_has_send(true);
  t.set_send_id(4);
  EXPECT_FALSE(parse_trace(t.SerializeAsString(), 2).ok());  // a send without tensors
  t.add_tensor_indices(1);
  EXPECT_TRUE(parse_trace(t.SerializeAsString(), 2).ok());
  EXPECT_FALSE(parse_trace(t.SerializeAsString(), 1).ok());  // index out of range
  t.add_tensor_indices(1);
  EXPECT_FALSE(parse_trace(t.SerializeAsString(), 2).ok());  // twice
  t.clear_tensor_indices();
  t.add_tensor_indices(0);
  t.set_send_id(-4);
  auto neg = parse_trace(t.SerializeAsString(), 2);
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);  // was silently dropped before
  EXPECT_FALSE(parse_trace("3 4 0", 2).ok());                          // the old space-separated text
}

}  // namespace
}  // namespace tandem::dist_autograd
