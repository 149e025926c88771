// A Store (rpc/store.h) on etcd's v3 KV API (proto/etcd_kv.proto), for the rendezvous's etcd backend.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/etcd_kv.grpc.pb.h"
#include "tandem/elastic/rendezvous.h"
#include "tandem/rpc/store.h"

namespace tandem::elastic {
namespace {

namespace pb = etcdserverpb;
using Clock = std::chrono::steady_clock;

// How often get() and wait() look again for keys that do not exist yet (etcd's watch would save the polls; the
// rendezvous reads a handful of keys per round, so polling costs a few calls per second).
constexpr std::chrono::milliseconds kPoll(10);

class EtcdStore final : public rpc::Store {
 public:
  EtcdStore(std::string endpoint, std::chrono::milliseconds op_timeout)
      : endpoint_(std::move(endpoint)),
        stub_(pb::KV::NewStub(grpc::CreateChannel(endpoint_, grpc::InsecureChannelCredentials()))),
        op_timeout_(op_timeout) {}

  absl::Status set(const std::string& key, const std::string& value) override {
    pb::PutRequest req;
    req.set_key(kPrefix + key);
    req.set_value(value);
    pb::PutResponse resp;
    auto ctx = context(Clock::now() + op_timeout_);
    return annotate(stub_->Put(ctx.get(), req, &resp), "set", key);
  }

  absl::StatusOr<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      auto kv = read(key, deadline);
      if (!kv.ok()) return kv.status();
      if (kv->has_value()) return (*kv)->value();
      if (Clock::now() + kPoll > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("store get('", key, "'): not set within ", timeout.count(), " ms (etcd at ", endpoint_, ")"));
      }
      std::this_thread::sleep_for(kPoll);
    }
  }

  // Read, then write if nobody wrote in between (a transaction on the key's modification revision); again otherwise.
  absl::StatusOr<int64_t> add(const std::string& key, int64_t delta) override {
    const auto deadline = Clock::now() + op_timeout_;
    for (;;) {
      auto kv = read(key, deadline);
      if (!kv.ok()) return kv.status();
      int64_t value = 0;
      if (kv->has_value() && !absl::SimpleAtoi((*kv)->value(), &value)) {
        return absl::InvalidArgumentError(absl::StrCat("store add('", key, "'): the value is not a counter"));
      }
      if (delta == 0) return value;
      pb::TxnRequest txn;
      pb::Compare* cmp = txn.add_compare();
      cmp->set_key(kPrefix + key);
      cmp->set_result(pb::Compare::EQUAL);
      if (kv->has_value()) {
        cmp->set_target(pb::Compare::MOD);
        cmp->set_mod_revision((*kv)->mod_revision());
      } else {
        cmp->set_target(pb::Compare::CREATE);
        cmp->set_create_revision(0);  // absent
      }
      pb::PutRequest* put = txn.add_success()->mutable_request_put();
      put->set_key(kPrefix + key);
      put->set_value(std::to_string(value + delta));
      pb::TxnResponse resp;
      auto ctx = context(deadline);
      if (auto s = annotate(stub_->Txn(ctx.get(), txn, &resp), "add", key); !s.ok()) return s;
      if (resp.succeeded()) return value + delta;
      if (Clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("store add('", key, "'): contended past the deadline"));
      }
    }
  }

  absl::Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      auto present = check_until(keys, std::min(deadline, Clock::now() + op_timeout_));
      if (!present.ok()) return present.status();
      if (std::all_of(present->begin(), present->end(), [](bool b) { return b; })) return absl::OkStatus();
      if (Clock::now() + kPoll > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("store wait('", absl::StrJoin(keys, ","),
                                                        "'): not all set within ", timeout.count(), " ms (etcd at ",
                                                        endpoint_, ")"));
      }
      std::this_thread::sleep_for(kPoll);
    }
  }

  absl::StatusOr<std::vector<bool>> check(const std::vector<std::string>& keys) override {
    return check_until(keys, Clock::now() + op_timeout_);
  }

  absl::Status remove(const std::string& key) override {
    pb::DeleteRangeRequest req;
    req.set_key(kPrefix + key);
    pb::DeleteRangeResponse resp;
    auto ctx = context(Clock::now() + op_timeout_);
    return annotate(stub_->DeleteRange(ctx.get(), req, &resp), "delete", key);
  }

 private:
  static constexpr char kPrefix[] = "/tandem/";

  std::unique_ptr<grpc::ClientContext> context(Clock::time_point deadline) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + (deadline - Clock::now()));
    ctx->set_wait_for_ready(true);  // within the deadline: a restarting etcd member is waited for
    return ctx;
  }

  absl::Status annotate(const grpc::Status& s, const char* op, const std::string& key) const {
    if (s.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("store ", op, "('", key, "'): etcd at ", endpoint_, ": ", s.error_message()));
  }

  absl::StatusOr<std::optional<pb::KeyValue>> read(const std::string& key, Clock::time_point deadline) {
    pb::RangeRequest req;
    req.set_key(kPrefix + key);
    pb::RangeResponse resp;
    auto ctx = context(std::min(deadline, Clock::now() + op_timeout_));
    if (auto s = annotate(stub_->Range(ctx.get(), req, &resp), "get", key); !s.ok()) return s;
    if (resp.kvs_size() == 0) return std::optional<pb::KeyValue>();
    return std::optional<pb::KeyValue>(resp.kvs(0));
  }

  // Transactions of ranges, 64 keys each (etcd refuses more than 128 operations in one by default): the keys of a
  // transaction looked up at one revision. A round's checks name one key per node, up to 32768.
  absl::StatusOr<std::vector<bool>> check_until(const std::vector<std::string>& keys, Clock::time_point deadline) {
    constexpr size_t kKeysPerTxn = 64;
    std::vector<bool> out;
    out.reserve(keys.size());
    for (size_t first = 0; first < keys.size(); first += kKeysPerTxn) {
      const size_t last = std::min(keys.size(), first + kKeysPerTxn);
      pb::TxnRequest txn;
      for (size_t i = first; i < last; ++i) {
        pb::RangeRequest* r = txn.add_success()->mutable_request_range();
        r->set_key(kPrefix + keys[i]);
        r->set_limit(1);
      }
      pb::TxnResponse resp;
      auto ctx = context(deadline);
      const std::vector<std::string> part(keys.begin() + static_cast<std::ptrdiff_t>(first),
                                          keys.begin() + static_cast<std::ptrdiff_t>(last));
      if (auto s = annotate(stub_->Txn(ctx.get(), txn, &resp), "check", absl::StrJoin(part, ",")); !s.ok()) return s;
      if (resp.responses_size() != static_cast<int>(last - first)) {
        return absl::DataLossError(absl::StrCat("store check: etcd at ", endpoint_, " answered ", resp.responses_size(),
                                                " ranges for ", last - first, " keys"));
      }
      for (const auto& r : resp.responses()) out.push_back(r.response_range().kvs_size() > 0);
    }
    return out;
  }

  const std::string endpoint_;
  std::unique_ptr<pb::KV::Stub> stub_;
  const std::chrono::milliseconds op_timeout_;
};

}  // namespace

std::unique_ptr<rpc::Store> connect_etcd_store(const std::string& endpoint, std::chrono::milliseconds op_timeout) {
  return std::make_unique<EtcdStore>(endpoint, op_timeout);
}

}  // namespace tandem::elastic
