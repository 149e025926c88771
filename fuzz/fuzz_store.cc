// libFuzzer target: the job's store (rpc/store.h) as rank 0 serves it, over a real gRPC connection on loopback. Each
// input is a sequence of operations (set, get with a short deadline, add, check, delete) on keys and values taken from
// the input; the server must answer every one (an error is fine) and keep serving.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/service_type.h>

#include <cstdint>
#include <memory>
#include <string>

#include "tandem/rpc/detail/net.h"
#include "tandem/rpc/store.h"

namespace {

struct Server {
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<tandem::rpc::Store> client;
};

Server& server() {
  static Server* s = [] {
    auto* out = new Server;
    out->service = tandem::rpc::make_store_service("token");
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(out->service.get());
    out->server = builder.BuildAndStart();
    auto channel = tandem::rpc::net::make_channel("127.0.0.1:" + std::to_string(port), nullptr, -1);
    out->client = tandem::rpc::connect_store(channel, "token", false, std::chrono::seconds(5));
    return out;
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::rpc::Store& store = *server().client;
  size_t at = 0;
  auto next = [&](size_t n) {
    std::string s(reinterpret_cast<const char*>(data + at), std::min(n, size - at));
    at += s.size();
    return s;
  };
  for (int op = 0; op < 16 && at < size; ++op) {
    const uint8_t code = data[at++];
    const std::string key = "k" + next(code >> 4);  // short keys collide: ops act on each other's keys
    switch (code % 5) {
      case 0:
        (void)store.set(key, next(8));
        break;
      case 1:
        (void)store.get(key, std::chrono::milliseconds(1));
        break;
      case 2: {
        int64_t delta = 0;
        const std::string d = next(8);
        for (char c : d) delta = (delta << 8) | static_cast<uint8_t>(c);
        (void)store.add(key, delta);
        break;
      }
      case 3:
        (void)store.check({key, key + "x"});
        break;
      default:
        (void)store.remove(key);
        break;
    }
  }
  return 0;
}
