#include "tandem/rpc/detail/fault_transport.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {

absl::StatusOr<std::vector<FaultRule>> parse_faults(const std::string& text) {
  static const std::map<std::string, FaultRule::Action> kActions = {
      {"drop", FaultRule::Action::kDrop},           {"delay", FaultRule::Action::kDelay},
      {"duplicate", FaultRule::Action::kDuplicate}, {"reorder", FaultRule::Action::kReorder},
      {"corrupt", FaultRule::Action::kCorrupt},     {"cut", FaultRule::Action::kCut}};
  std::vector<FaultRule> rules;
  for (absl::string_view spec : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("fault rule '", absl::StripAsciiWhitespace(spec), "': ", why));
    };
    std::vector<std::string> words = absl::StrSplit(spec, ' ', absl::SkipWhitespace());
    if (words.size() < 2) return bad("expected '<action> <from>-><to> [options]'");
    FaultRule rule;
    auto action = kActions.find(words[0]);
    if (action == kActions.end()) return bad("unknown action (drop delay duplicate reorder corrupt cut)");
    rule.action = action->second;
    std::vector<std::string> ends = absl::StrSplit(words[1], "->");
    if (ends.size() != 2 || ends[0].empty() || ends[1].empty()) return bad("expected <from>-><to> (a name or *)");
    rule.from = ends[0];
    rule.to = ends[1];
    for (size_t i = 2; i < words.size(); ++i) {
      const std::string& w = words[i];
      int n = 0;
      if (w == "request") {
        rule.kind = FaultRule::Kind::kRequest;
      } else if (w == "reply") {
        rule.kind = FaultRule::Kind::kReply;
      } else if (absl::StartsWith(w, "fn=")) {
        rule.function = w.substr(3);
      } else if (absl::StartsWith(w, "nth=") && absl::SimpleAtoi(w.substr(4), &n) && n >= 1) {
        rule.nth = n;
      } else if (absl::StartsWith(w, "count=") && absl::SimpleAtoi(w.substr(6), &n) && n >= 0) {
        rule.count = n;
      } else if (absl::StartsWith(w, "ms=") && absl::SimpleAtoi(w.substr(3), &n) && n >= 0) {
        rule.delay = std::chrono::milliseconds(n);
      } else {
        return bad(absl::StrCat("unknown option '", w, "'"));
      }
    }
    if (rule.action == FaultRule::Action::kDuplicate && rule.kind == FaultRule::Kind::kReply) {
      return bad("only requests can be duplicated");
    }
    rules.push_back(std::move(rule));
  }
  return rules;
}

namespace detail {

grpc::ByteBuffer corrupt_frame(const grpc::ByteBuffer& frame) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (frame.Valid() && frame.Dump(&slices).ok()) {
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  const uint32_t lie = static_cast<uint32_t>(bytes.size());  // a header as long as the whole frame cannot fit
  if (bytes.size() < 4) bytes.resize(4);
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((lie >> (8 * i)) & 0xff);
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

FaultInjector::FaultInjector(std::vector<FaultRule> rules, std::string self)
    : rules_(std::move(rules)), self_(std::move(self)), seen_(rules_.size(), 0) {
  thread_ = std::thread([this] { run_timer(); });
}

FaultInjector::~FaultInjector() { stop(); }

void FaultInjector::set_peers(std::vector<std::string> names) {
  MutexLock lock(&mu_);
  names_ = std::move(names);
}

std::string FaultInjector::name_of(int rank) const {
  auto* self = const_cast<FaultInjector*>(this);
  MutexLock lock(&self->mu_);
  return rank >= 0 && rank < static_cast<int>(names_.size()) ? names_[rank] : std::string();
}

const FaultRule* FaultInjector::match(const std::string& to, FaultRule::Kind kind, const std::string& function) {
  MutexLock lock(&mu_);
  if (stopped_) return nullptr;
  for (size_t i = 0; i < rules_.size(); ++i) {
    const FaultRule& r = rules_[i];
    if ((r.from != "*" && r.from != self_) || (r.to != "*" && r.to != to)) continue;
    if (r.kind != FaultRule::Kind::kAny && r.kind != kind) continue;
    if (!r.function.empty() && r.function != function) continue;
    const int n = ++seen_[i];
    if (n >= r.nth && (r.count == 0 || n < r.nth + r.count)) return &r;
  }
  return nullptr;
}

void FaultInjector::schedule(absl::Time at, Task task) {
  {
    MutexLock lock(&mu_);
    if (!stopped_) {
      timer_.emplace(at, std::move(task));
      return;
    }
  }
  task(/*stopping=*/true);
}

void FaultInjector::hold(const std::string& to, absl::Duration at_most, Task send) {
  auto held = std::make_shared<Task>(std::move(send));
  {
    MutexLock lock(&mu_);
    if (!stopped_) held_.emplace(to, held);
  }
  // Whichever comes first sends it: the next message to `to` (release) or this timer; the other finds it gone.
  schedule(absl::Now() + at_most, [this, to, held](bool stopping) {
    bool mine = false;
    {
      MutexLock lock(&mu_);
      for (auto it = held_.begin(); it != held_.end(); ++it) {
        if (it->second == held) {
          held_.erase(it);
          mine = true;
          break;
        }
      }
    }
    if (mine) (*held)(stopping);
  });
}

void FaultInjector::release(const std::string& to) {
  std::vector<std::shared_ptr<Task>> out;
  {
    MutexLock lock(&mu_);
    auto [first, last] = held_.equal_range(to);
    for (auto it = first; it != last; ++it) out.push_back(it->second);
    held_.erase(first, last);
  }
  for (auto& t : out) (*t)(false);
}

void FaultInjector::run_timer() {
  MutexLock lock(&mu_);
  for (;;) {
    if (stopped_) return;
    const absl::Time next = timer_.empty() ? absl::InfiniteFuture() : timer_.begin()->first;
    auto wake = [this, next]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || (!timer_.empty() && timer_.begin()->first < next);
    };
    mu_.AwaitWithDeadline(Condition(&wake), next);
    std::vector<Task> due;
    const absl::Time now = absl::Now();
    while (!timer_.empty() && timer_.begin()->first <= now && !stopped_) {
      due.push_back(std::move(timer_.begin()->second));
      timer_.erase(timer_.begin());
    }
    if (due.empty()) continue;
    mu_.Unlock();
    for (auto& t : due) t(false);
    mu_.Lock();
  }
}

void FaultInjector::stop() {
  std::multimap<absl::Time, Task> left;
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    left.swap(timer_);
    held_.clear();  // each held message also has a timer task, which sends it
  }
  if (thread_.joinable()) thread_.join();
  for (auto& [at, task] : left) task(/*stopping=*/true);
}

// ---------------------------------------------------------------------------------------------------------------------

class FaultTransport final : public Transport {
 public:
  FaultTransport(FaultInjector* faults, Transport* inner) : faults_(faults), inner_(inner) {}
  const char* kind() const override { return inner_->kind(); }
  const char* kind_for(int peer) const override { return inner_->kind_for(peer); }
  absl::Status add_peer(const PeerAddress& peer, absl::Time deadline) override {
    return inner_->add_peer(peer, deadline);
  }
  bool by_reference(int peer) const override { return inner_->by_reference(peer); }
  void cut(int peer, const grpc::ByteBuffer* partial) override { inner_->cut(peer, partial); }
  bool stop(std::chrono::milliseconds grace) override {
    faults_->stop();
    return inner_->stop(grace);
  }

  void call(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline,
            DoneFn done) override {
    carry(peer, function, std::move(request), std::move(done), /*oneway=*/false, deadline);
  }

  // One-way frames get the request rules: a dropped one completes as written (the sender cannot tell a message lost
  // after it left), and nothing answers them, so reply rules never see them (wrap_incoming).
  void send(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline,
            DoneFn done) override {
    carry(peer, function, std::move(request), std::move(done), /*oneway=*/true, deadline);
  }

  absl::StatusOr<grpc::ByteBuffer> call_sync(int peer, const std::string& function, const grpc::ByteBuffer& frame,
                                             absl::Time deadline, std::chrono::microseconds spin) override {
    const std::string to = faults_->name_of(peer);
    const FaultRule* rule = faults_->match(to, FaultRule::Kind::kRequest, function);
    if (!rule) {
      auto reply = inner_->call_sync(peer, function, frame, deadline, spin);
      faults_->release(to);  // what was held for `to` goes after this message
      return reply;
    }
    grpc::ByteBuffer request = frame;  // a rule may corrupt it
    switch (rule->action) {
      case FaultRule::Action::kDrop:
        absl::SleepFor(deadline - absl::Now());
        return absl::DeadlineExceededError(absl::StrCat(kNoReplyByDeadline, " (request dropped)"));
      case FaultRule::Action::kDelay:
        absl::SleepFor(std::min(absl::FromChrono(rule->delay), deadline - absl::Now()));
        break;
      case FaultRule::Action::kDuplicate:
        inner_->call(peer, function, request, deadline, [](absl::StatusOr<grpc::ByteBuffer>) {});
        break;
      case FaultRule::Action::kReorder: {
        auto go = std::make_shared<Notification>();
        faults_->hold(to, absl::FromChrono(rule->delay), [go](bool) { go->Notify(); });
        go->WaitForNotificationWithDeadline(deadline);
        break;
      }
      case FaultRule::Action::kCorrupt:
        request = corrupt_frame(request);
        break;
      case FaultRule::Action::kCut:
        inner_->cut(peer, &request);
        return absl::UnavailableError("the connection was cut");
    }
    return inner_->call_sync(peer, function, request, deadline, spin);
  }

 private:
  // Sends `request` (as a call, or one-way) with the rule that matches it applied.
  void carry(int peer, const std::string& function, grpc::ByteBuffer request, DoneFn done, bool oneway,
             absl::Time deadline) {
    const std::string to = faults_->name_of(peer);
    const FaultRule* rule = faults_->match(to, FaultRule::Kind::kRequest, function);
    auto send = [this, peer, function, deadline, oneway](grpc::ByteBuffer frame, DoneFn d) {
      if (oneway) return inner_->send(peer, function, std::move(frame), deadline, std::move(d));
      inner_->call(peer, function, std::move(frame), deadline, std::move(d));
    };
    if (!rule) {
      send(std::move(request), std::move(done));
      return faults_->release(to);
    }
    auto shared_done = std::make_shared<DoneFn>(std::move(done));
    switch (rule->action) {
      case FaultRule::Action::kDrop:
        if (oneway) return (*shared_done)(grpc::ByteBuffer());
        return faults_->schedule(deadline, [shared_done](bool stopping) {
          (*shared_done)(stopping
                             ? absl::CancelledError("RPC was shut down on this worker")
                             : absl::DeadlineExceededError(absl::StrCat(kNoReplyByDeadline, " (request dropped)")));
        });
      case FaultRule::Action::kDelay:
        return faults_->schedule(absl::Now() + absl::FromChrono(rule->delay),
                                 [send, request, shared_done](bool) { send(request, std::move(*shared_done)); });
      case FaultRule::Action::kDuplicate:
        send(request, [](absl::StatusOr<grpc::ByteBuffer>) {});
        send(std::move(request), std::move(*shared_done));
        return faults_->release(to);
      case FaultRule::Action::kReorder:
        return faults_->hold(to, absl::FromChrono(rule->delay),
                             [send, request, shared_done](bool) { send(request, std::move(*shared_done)); });
      case FaultRule::Action::kCorrupt:
        send(corrupt_frame(request), std::move(*shared_done));
        return faults_->release(to);
      case FaultRule::Action::kCut:
        inner_->cut(peer, &request);
        return (*shared_done)(absl::UnavailableError("the connection was cut"));
    }
  }

  FaultInjector* faults_;
  Transport* inner_;
};

std::unique_ptr<Transport> FaultInjector::wrap(Transport* inner) {
  return std::make_unique<FaultTransport>(this, inner);
}

IncomingFn FaultInjector::wrap_incoming(IncomingFn handler) {
  return [this, handler](Incoming in) {
    tandem::wire::Request header;
    if (!wire::Frame::parse(in.request, &header).ok()) return handler(std::move(in));  // the agent answers it
    if (in.oneway || header.oneway()) return handler(std::move(in));  // no reply, or only the transport's receipt
    const std::string to = header.caller_name();
    const FaultRule* rule = match(to, FaultRule::Kind::kReply, header.function());
    if (!rule) {
      ReplyFn inner = std::move(in.reply);
      in.reply = [this, to, inner](grpc::ByteBuffer* reply, const absl::Status& status) {
        inner(reply, status);
        release(to);
      };
      return handler(std::move(in));
    }
    ReplyFn inner = std::move(in.reply);
    auto cut = in.cut;
    const FaultRule r = *rule;
    in.reply = [this, r, to, inner, cut](grpc::ByteBuffer* reply, const absl::Status& status) {
      auto frame = std::make_shared<grpc::ByteBuffer>();
      if (reply) frame->Swap(reply);
      auto send = [inner, frame, status](bool) { inner(frame->Valid() ? frame.get() : nullptr, status); };
      switch (r.action) {
        case FaultRule::Action::kDuplicate:  // refused by parse_faults for replies; a kAny rule sends it once
          return send(false);
        case FaultRule::Action::kDrop:
          // Lost for the caller, whose deadline fails the call. The transport still gets it at stop(): a gRPC server
          // cannot shut down while a call it accepted is unanswered, as a real lost reply would have been sent.
          return schedule(absl::InfiniteFuture(), send);
        case FaultRule::Action::kDelay:
          return schedule(absl::Now() + absl::FromChrono(r.delay), send);
        case FaultRule::Action::kReorder:
          return hold(to, absl::FromChrono(r.delay), send);
        case FaultRule::Action::kCorrupt:
          if (frame->Valid()) *frame = corrupt_frame(*frame);
          return send(false);
        case FaultRule::Action::kCut:
          return cut(frame->Valid() ? frame.get() : nullptr);
      }
    };
    handler(std::move(in));
  };
}

}  // namespace detail
}  // namespace tandem::rpc
