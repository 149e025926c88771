// The wire schema's version and its control messages (proto/tandem_rpc.proto): two builds that cannot talk fail where
// they first meet, with an error naming both versions; malformed control messages are refused, never misread.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.grpc.pb.h"
#include "tandem/rpc/detail/agent.h"
#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/direct.h"
#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/detail/version.h"
#include "tandem/rpc/store.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {
namespace {

std::string record(uint32_t version, int rank = 1, const std::string& name = "worker1", int world = 4) {
  tandem::wire::RendezvousRecord r;
  r.set_wire_version(version);
  auto* w = r.mutable_worker();
  w->set_name(name);
  w->set_rank(rank);
  w->set_world_size(world);
  w->set_grpc_address("127.0.0.1:5000");
  w->set_pid(42);
  return r.SerializeAsString();
}

grpc::ByteBuffer buffer(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

TEST(UnitWireSchema, RendezvousRecordOfAnotherVersionIsNamedNotMisread) {
  EXPECT_TRUE(detail::parse_record(record(kWireVersion), 1, 4).ok());
  auto other = detail::parse_record(record(kWireVersion + 1), 1, 4);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find(absl::StrCat("rank 1 speaks Tandem wire version ", kWireVersion + 1,
                                                       ", this worker version ", kWireVersion)),
            std::string::npos)
      << other.status();
  // The text record of builds from before versioning: name, address, world size, boot id, direct address, pid.
  auto old = detail::parse_record("worker1\n127.0.0.1:5000\n4\nboot\ntandem-1-x\n42", 1, 4);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(old.status().message().find("before wire versioning"), std::string::npos) << old.status();
}

TEST(UnitWireSchema, RendezvousRecordIsChecked) {
  EXPECT_EQ(detail::parse_record(record(kWireVersion, 2), 1, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(detail::parse_record(record(kWireVersion, 1, "bad name!"), 1, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto world = detail::parse_record(record(kWireVersion, 1, "worker1", 3), 1, 4);
  EXPECT_EQ(world.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(world.status().message().find("has world size 3, this worker 4"), std::string::npos);
  tandem::wire::RendezvousRecord failed;
  failed.set_wire_version(kWireVersion);
  failed.mutable_failed()->set_message("worker name 'x' is used by another rank");
  auto f = detail::parse_record(failed.SerializeAsString(), 1, 4);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(f.status().message().find("rank 1 failed to join: worker name 'x'"), std::string::npos);
}

// The hello of builds up to wire version 7 on a Unix socket: the job token in clear, no proof.
grpc::ByteBuffer token_in_clear_hello(const std::string& token) {
  tandem::wire::DirectHello hello;
  hello.set_wire_version(kWireVersion);
  hello.set_token(token);
  hello.set_rank(1);
  hello.set_pid(42);
  return buffer(hello.SerializeAsString());
}

TEST(UnitWireSchema, DirectHandshakeChecksTokenAndVersion) {
  const std::string token(64, 'a'), challenge = auth::random_secret(), nonce = auth::random_secret();
  EXPECT_TRUE(direct::parse_hello(direct::encode_hello(token, 1, challenge, nonce, 0x1000), token, challenge).ok());
  EXPECT_EQ(direct::parse_hello(direct::encode_hello(std::string(64, 'b'), 1, challenge, nonce, 0), token, challenge)
                .status()
                .code(),
            absl::StatusCode::kUnauthenticated);
  tandem::wire::DirectHello other;
  grpc::Slice flat;
  ASSERT_TRUE(direct::encode_hello(token, 1, challenge, nonce, 0).DumpToSingleSlice(&flat).ok());
  ASSERT_TRUE(other.ParseFromArray(flat.begin(), static_cast<int>(flat.size())));
  other.set_wire_version(kWireVersion + 1);
  auto s = direct::parse_hello(buffer(other.SerializeAsString()), token, challenge);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find(absl::StrCat("wire version ", kWireVersion + 1)), std::string::npos)
      << s.status();
  // The 80-byte binary hello of builds from before versioning: token, rank, pid, probe address.
  std::string old = token + std::string(16, '\x01');
  EXPECT_FALSE(direct::parse_hello(buffer(old), token, challenge).ok());
  // The token in clear, as Unix-socket hellos carried it up to version 7: no proof, refused.
  EXPECT_FALSE(direct::parse_hello(token_in_clear_hello(token), token, challenge).ok());

  tandem::wire::DirectWelcome refused;
  refused.set_wire_version(kWireVersion);
  refused.mutable_refused()->set_code(static_cast<int>(absl::StatusCode::kUnauthenticated));
  refused.mutable_refused()->set_message("direct channel: wrong job token");
  auto w = direct::parse_welcome(buffer(refused.SerializeAsString()));
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(UnitWireSchema, TheHandshakeProvesTheTokenWithoutSendingIt) {
  const std::string token(64, 'a');
  const std::string challenge = auth::random_secret(), nonce = auth::random_secret();
  auto parsed_challenge = direct::parse_challenge(direct::encode_challenge(challenge));
  ASSERT_TRUE(parsed_challenge.ok()) << parsed_challenge.status();
  EXPECT_EQ(*parsed_challenge, challenge);
  const grpc::ByteBuffer hello = direct::encode_hello(token, 3, challenge, nonce, 0x1000);
  grpc::Slice flat;
  ASSERT_TRUE(hello.DumpToSingleSlice(&flat).ok());
  const std::string bytes(reinterpret_cast<const char*>(flat.begin()), flat.size());
  EXPECT_EQ(bytes.find(token), std::string::npos) << "the token itself is on the wire";
  auto ok = direct::parse_hello(hello, token, challenge);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->rank(), 3);
  // Another secret, a replay against a new challenge, a changed rank, no proof: refused.
  EXPECT_EQ(direct::parse_hello(direct::encode_hello(std::string(64, 'b'), 3, challenge, nonce, 0), token, challenge)
                .status()
                .code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(direct::parse_hello(hello, token, auth::random_secret()).status().code(),
            absl::StatusCode::kUnauthenticated);
  tandem::wire::DirectHello forged;
  ASSERT_TRUE(forged.ParseFromString(bytes));
  forged.set_rank(0);
  EXPECT_EQ(direct::parse_hello(buffer(forged.SerializeAsString()), token, challenge).status().code(),
            absl::StatusCode::kUnauthenticated);
  forged.set_rank(3);
  forged.clear_proof();
  EXPECT_EQ(direct::parse_hello(buffer(forged.SerializeAsString()), token, challenge).status().code(),
            absl::StatusCode::kUnauthenticated);
  // The token in clear is no proof; malformed bytes and another version are named.
  EXPECT_FALSE(direct::parse_hello(token_in_clear_hello(token), token, challenge).ok());
  EXPECT_EQ(direct::parse_hello(buffer("\xff\xff"), token, challenge).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(direct::parse_challenge(buffer("")).status().code(), absl::StatusCode::kInvalidArgument);
  tandem::wire::DirectChallenge newer;
  newer.set_wire_version(kWireVersion + 1);
  newer.set_nonce(challenge);
  EXPECT_EQ(direct::parse_challenge(buffer(newer.SerializeAsString())).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(UnitWireSchema, StoreRefusesAnotherWireVersion) {
  const std::string token = auth::derive_token("s");
  auto service = make_store_service(token);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service.get());
  auto server = builder.BuildAndStart();
  auto channel = net::make_channel("127.0.0.1:" + std::to_string(port), nullptr, -1);
  tandem::wire::Store::Stub stub(channel);
  const std::string newer = std::to_string(kWireVersion + 1);
  for (const char* version : {"1", newer.c_str(), ""}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ctx.AddMetadata(auth::kAuthMetadataKey, token);
    if (*version) ctx.AddMetadata(auth::kWireVersionMetadataKey, version);
    tandem::wire::StoreAddRequest req;
    req.set_key("k");
    req.set_delta(1);
    tandem::wire::StoreCount resp;
    grpc::Status s = stub.Add(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << version;
    EXPECT_NE(s.error_message().find(absl::StrCat("this worker version ", kWireVersion)), std::string::npos)
        << s.error_message();
  }
  auto store = connect_store(channel, token, false);
  EXPECT_EQ(*store->add("k", 1), 1);  // this build's own version is served
  EXPECT_EQ(store->add("k", INT64_MAX).status().code(), absl::StatusCode::kOutOfRange);  // never overflows
  server->Shutdown(std::chrono::system_clock::now());
}

}  // namespace
}  // namespace tandem::rpc
