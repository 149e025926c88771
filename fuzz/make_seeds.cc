// Writes the seed corpus of every fuzz target into fuzz/corpus/<target>/seed-*: well-formed inputs the fuzzer mutates.
//   build/fuzz_make_seeds fuzz/corpus
// The seeds are committed; run this again when a format changes (and bump kWireVersion, rpc/detail/version.h).
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/detail/direct.h"
#include "tandem/rpc/detail/version.h"
#include "tandem/rpc/detail/wire.h"

namespace {

std::string dump(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  (void)b.Dump(&slices);
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

void write(const std::filesystem::path& dir, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / ("seed-" + name), std::ios::binary) << bytes;
}

std::string request_frame(const std::vector<c10::IValue>& args) {
  tandem::wire::Request r;
  r.set_function("echo");
  r.set_caller_name("worker1");
  r.set_caller_rank(1);
  tandem::rpc::wire::Encoder e;
  if (!e.encode(args, r.mutable_args()).ok()) std::abort();
  return dump(e.frame(r));
}

std::string direct_message(uint32_t kind, uint64_t call_id, const std::string& body) {
  std::string out(24, '\0');
  const uint32_t magic = 0x4d444e54;
  const uint64_t len = body.size();
  std::memcpy(&out[0], &magic, 4);
  std::memcpy(&out[4], &kind, 4);
  std::memcpy(&out[8], &call_id, 8);
  std::memcpy(&out[16], &len, 8);
  return out + body;
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path root = argc > 1 ? argv[1] : "fuzz/corpus";
  // fuzz_frame: [selector][slice size][frame]
  const std::vector<std::pair<std::string, std::vector<c10::IValue>>> frames = {
      {"tensors", {at::arange(12, at::kFloat).reshape({3, 4}), at::ones({5}, at::kLong), at::zeros({0})}},
      {"scalars",
       {c10::IValue(int64_t{7}), c10::IValue(2.5), c10::IValue(true), c10::IValue(std::string("s")), c10::IValue()}},
      {"containers",
       {c10::IValue(std::vector<int64_t>{1, 2, 3}),
        c10::IValue(c10::ivalue::Tuple::create({c10::IValue(int64_t{1}), c10::IValue(at::ones({2}))})),
        c10::IValue(c10::impl::GenericDict(c10::StringType::get(), c10::IntType::get()))}},
      {"grad", {at::ones({4}, at::kDouble).requires_grad_()}},
  };
  for (const auto& [name, args] : frames) {
    const std::string f = request_frame(args);
    for (uint8_t selector : {0, 2, 4})
      write(root / "fuzz_frame", name + "-" + std::to_string(selector),
            std::string{static_cast<char>(selector), 0} + f);
    write(root / "fuzz_frame", name + "-sliced", std::string{0, 3} + f);
  }
  {
    tandem::wire::Response r;
    r.mutable_error()->set_code(2);
    r.mutable_error()->set_message("boom");
    write(root / "fuzz_frame", "error-response", std::string{1, 0} + dump(tandem::rpc::wire::Encoder().frame(r)));
  }
  // fuzz_control: [decoder][message]
  {
    tandem::wire::RendezvousRecord rec;
    rec.set_wire_version(tandem::rpc::kWireVersion);
    auto* w = rec.mutable_worker();
    w->set_name("worker1");
    w->set_rank(1);
    w->set_world_size(4);
    w->set_grpc_address("127.0.0.1:5000");
    w->set_boot_id("b");
    w->set_direct_address("tandem-1-x");
    w->set_pid(42);
    write(root / "fuzz_control", "record", std::string(1, 0) + rec.SerializeAsString());
    const std::string hello = dump(
        tandem::rpc::direct::encode_hello(std::string(64, 'a'), 1, std::string(64, 'c'), std::string(32, 'n'), 0x1000));
    write(root / "fuzz_control", "hello", std::string(1, 1) + hello);
    tandem::wire::DirectWelcome welcome;
    welcome.set_wire_version(tandem::rpc::kWireVersion);
    welcome.set_cma_ok(true);
    write(root / "fuzz_control", "welcome", std::string(1, 2) + welcome.SerializeAsString());
    tandem::wire::RRefDescriptor d;
    d.set_rref_id(5);
    d.set_fork_id(6);
    d.set_owner(1);
    d.set_kind(tandem::wire::RRefDescriptor::USER_FORK);
    write(root / "fuzz_control", "rref", std::string(1, 3) + d.SerializeAsString());
    tandem::wire::AutogradTrace t;
    t.set_context_id(9);
    t.set_has_send(true);
    t.set_send_id(10);
    t.add_tensor_indices(0);
    t.add_tensor_indices(2);
    write(root / "fuzz_control", "trace", std::string(1, 4) + t.SerializeAsString());
    tandem::wire::StoreAddRequest add;
    add.set_key("name/worker1");
    add.set_delta(1);
    write(root / "fuzz_control", "store-add", std::string(1, 6) + add.SerializeAsString());
    tandem::wire::ElasticNode node;
    node.set_wire_version(tandem::rpc::kWireVersion);
    node.set_host("10.0.0.2");
    node.set_nproc(8);
    node.set_master_port(29500);
    node.set_pid(4242);
    write(root / "fuzz_control", "elastic-node", std::string(1, 8) + node.SerializeAsString());
    tandem::wire::ElasticRound round;
    round.set_wire_version(tandem::rpc::kWireVersion);
    round.set_nodes(2);
    round.set_restarts(1);
    write(root / "fuzz_control", "elastic-round", std::string(1, 9) + round.SerializeAsString());
    tandem::wire::ElasticEnd end;
    end.set_wire_version(tandem::rpc::kWireVersion);
    end.set_reason("rank 1 on node 1 (10.0.0.3) (pid 77) failed with exit code 1");
    end.set_failure(true);
    write(root / "fuzz_control", "elastic-end", std::string(1, 10) + end.SerializeAsString());
    // fuzz_direct: a stream of framed messages
    write(root / "fuzz_direct", "hello-request",
          direct_message(1, 0, hello) + direct_message(3, 7, request_frame({at::ones({3})})));
    write(root / "fuzz_direct", "welcome-response", direct_message(2, 0, welcome.SerializeAsString()));
  }
  // fuzz_store: [op][key bytes][value bytes]...
  write(root / "fuzz_store", "ops",
        std::string("\x10"
                    "a"
                    "12345678"
                    "\x12"
                    "a"
                    "\x00\x00\x00\x00\x00\x00\x00\x01"
                    "\x11"
                    "a"
                    "\x13"
                    "a"
                    "\x14"
                    "a",
                    1 + 1 + 8 + 1 + 1 + 8 + 1 + 1 + 1 + 1 + 1 + 1));
  return 0;
}
