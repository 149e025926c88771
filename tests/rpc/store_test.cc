// The rendezvous store in one process: its server on an ephemeral loopback port, clients with and without the token.
#include "tandem/rpc/store.h"

#include <grpcpp/impl/codegen/service_type.h>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <thread>

#include "tandem/rpc/detail/auth.h"
#include "tandem/rpc/detail/net.h"

namespace tandem::rpc {
namespace {

using std::chrono::milliseconds;

class UnitStore : public ::testing::Test {
 protected:
  void SetUp() override {
    token_ = auth::derive_token("store-secret");
    service_ = make_store_service(token_);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port_, 0);
    channel_ = net::make_channel("127.0.0.1:" + std::to_string(port_), nullptr, 1 << 20);
    store_ = connect_store(channel_, token_, false);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + milliseconds(500)); }

  std::string token_;
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Store> store_;
  int port_ = 0;
};

TEST_F(UnitStore, SetGetAddCheckRemove) {
  ASSERT_TRUE(store_->set("k", std::string("v\0w", 3)).ok());
  EXPECT_EQ(*store_->get("k", milliseconds(100)), std::string("v\0w", 3));
  EXPECT_EQ(*store_->add("n", 5), 5);
  EXPECT_EQ(*store_->add("n", -2), 3);
  EXPECT_EQ(*store_->get("n", milliseconds(100)), "3");
  EXPECT_EQ(store_->add("k", 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*store_->check({"k", "missing"}), (std::vector<bool>{true, false}));
  ASSERT_TRUE(store_->remove("k").ok());
  EXPECT_EQ(*store_->check({"k"}), (std::vector<bool>{false}));
}

TEST_F(UnitStore, GetAndWaitBlockUntilSetOrDeadline) {
  EXPECT_EQ(store_->get("late", milliseconds(50)).status().code(), absl::StatusCode::kDeadlineExceeded);
  std::thread setter([this] {
    std::this_thread::sleep_for(milliseconds(50));
    (void)store_->set("late", "x");
    (void)store_->set("later", "y");
  });
  EXPECT_TRUE(store_->wait({"late", "later"}, milliseconds(10000)).ok());
  EXPECT_EQ(*store_->get("late", milliseconds(10000)), "x");
  setter.join();
}

TEST_F(UnitStore, BarrierNamesMissingRanks) {
  std::thread other([this] { (void)barrier(*store_, "b1", 1, 2, milliseconds(10000)); });
  EXPECT_TRUE(barrier(*store_, "b1", 0, 2, milliseconds(10000)).ok());
  other.join();
  auto s = barrier(*store_, "b2", 0, 3, milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("ranks 1, 2 did not arrive"), std::string::npos) << s;
}

TEST_F(UnitStore, CallersWithoutTheTokenAreRejected) {
  auto intruder = connect_store(channel_, auth::derive_token("wrong"), false);
  EXPECT_EQ(intruder->set("k", "v").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(intruder->get("k", milliseconds(100)).status().code(), absl::StatusCode::kUnauthenticated);
  auto anonymous = connect_store(channel_, "", false);
  EXPECT_EQ(anonymous->add("k", 1).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(*store_->check({"k"}), (std::vector<bool>{false}));
}

TEST_F(UnitStore, DeadStoreFailsFast) {
  server_->Shutdown(std::chrono::system_clock::now());
  auto s = store_->set("k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(UnitAuth, TokenIsDerivedNotTheSecret) {
  const std::string t = auth::derive_token("s3cret");
  EXPECT_EQ(t.size(), 64u);
  EXPECT_EQ(t.find("s3cret"), std::string::npos);
  EXPECT_EQ(t, auth::derive_token("s3cret"));
  EXPECT_NE(t, auth::derive_token("s3cret2"));
  EXPECT_NE(auth::random_secret(), auth::random_secret());
}

}  // namespace
}  // namespace tandem::rpc
