// The wire form of a remote reference (proto/tandem_rpc.proto: RRefDescriptor) is validated before any protocol work.
#include <gtest/gtest.h>

#include "tandem/rref/detail/descriptor.h"

namespace tandem::rref {
namespace {

TEST(UnitRRefWire, DescriptorIsValidated) {
  tandem::wire::RRefDescriptor d;
  d.set_rref_id(1);
  d.set_fork_id(2);
  d.set_owner(0);
  d.set_kind(tandem::wire::RRefDescriptor::FROM_OWNER);
  EXPECT_TRUE(detail::parse_descriptor(d.SerializeAsString()).ok());
  d.set_kind(static_cast<tandem::wire::RRefDescriptor::Kind>(9));
  EXPECT_EQ(detail::parse_descriptor(d.SerializeAsString()).status().code(), absl::StatusCode::kInvalidArgument);
  d.set_kind(tandem::wire::RRefDescriptor::KIND_UNSPECIFIED);
  EXPECT_FALSE(detail::parse_descriptor(d.SerializeAsString()).ok());
  d.set_kind(tandem::wire::RRefDescriptor::SELF);
  d.set_owner(-1);
  EXPECT_FALSE(detail::parse_descriptor(d.SerializeAsString()).ok());
  EXPECT_FALSE(detail::parse_descriptor(std::string(24, '\xff')).ok());  // the old memcpy'd struct
}

}  // namespace
}  // namespace tandem::rref
