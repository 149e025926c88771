#include "tandem/rpc/detail/direct_transport.h"

#include <functional>

#include "absl/strings/str_cat.h"
#include "proto/tandem_rpc.pb.h"
#include "tandem/log/log.h"
#include "tandem/rpc/detail/wire.h"
#include "tandem/rpc/errors.h"

namespace tandem::rpc::detail {

absl::StatusOr<std::unique_ptr<DirectTransport>> DirectTransport::start(std::string token, int my_rank, int threads,
                                                                        uint64_t max_message_bytes,
                                                                        std::chrono::milliseconds message_timeout,
                                                                        IncomingFn on_request,
                                                                        const std::string& tcp_host) {
  std::unique_ptr<DirectTransport> t(new DirectTransport(my_rank, max_message_bytes));
  t->message_timeout_ = absl::FromChrono(message_timeout);
  t->on_request_ = std::move(on_request);
  DirectTransport* raw = t.get();
  auto channel = direct::Channel::start(
      std::move(token), threads, max_message_bytes, absl::FromChrono(message_timeout),
      {[raw](const std::shared_ptr<direct::Conn>& c, direct::Message m) { raw->on_request(c, std::move(m)); },
       [raw](const std::shared_ptr<direct::Conn>&, direct::Message m) { raw->on_response(std::move(m)); },
       [raw](const std::shared_ptr<direct::Conn>& c, const absl::Status& why) { raw->on_lost(c.get(), why); }},
      tcp_host);
  if (!channel.ok()) return channel.status();
  t->channel_ = std::move(*channel);
  t->timer_ = std::thread([raw] { raw->run_timer(); });
  return t;
}

// Normally already stopped (with the shutdown's grace); here only running callbacks unwind, so a fixed second.
DirectTransport::~DirectTransport() { stop(std::chrono::milliseconds(1000)); }

DirectTransport::Peer* DirectTransport::peer(int rank) const {
  auto* self = const_cast<DirectTransport*>(this);
  MutexLock lock(&self->peers_mu_);
  auto it = self->peers_.find(rank);
  return it == self->peers_.end() ? nullptr : it->second.get();
}

absl::Status DirectTransport::add_peer(const PeerAddress& address, absl::Time deadline) {
  // The Unix socket for a peer of this host, else TCP when both sides listen on it. Connecting now tells whether the
  // route works (a same-host peer in another network namespace cannot reach the Unix socket).
  std::vector<std::string> routes;
  if (address.same_host && !address.direct_address.empty()) routes.push_back(address.direct_address);
  if (!address.tcp_address.empty() && !channel_->tcp_address().empty()) routes.push_back(address.tcp_address);
  absl::Status why = absl::UnavailableError("no direct channel to this worker (another host, and no TCP listener)");
  for (const auto& route : routes) {
    auto p = std::make_unique<Peer>();
    p->address = route;
    auto conn = async_conn(*p, deadline);
    if (!conn.ok()) {
      TANDEM_LOG(kDebug, "rpc") << "direct channel to " << address.name << " at " << route
                                << " not connected: " << conn.status().message();
      // A peer that refuses our token or speaks another version is not a route problem: say so at init.
      if (conn.status().code() == absl::StatusCode::kUnauthenticated ||
          conn.status().code() == absl::StatusCode::kFailedPrecondition) {
        return conn.status();
      }
      why = conn.status();
      continue;
    }
    p->cma_ok = (*conn)->cma_ok;
    TANDEM_LOG(kDebug, "rpc") << "direct channel to " << address.name << " connected at " << route
                              << ((*conn)->cma_ok ? " (bulk by cross-memory copy)" : "");
    MutexLock lock(&peers_mu_);
    peers_[address.rank] = std::move(p);
    return absl::OkStatus();
  }
  return why;
}

const char* DirectTransport::kind_for(int rank) const {
  Peer* p = peer(rank);
  return p && direct::is_tcp_address(p->address) ? "tcp" : "direct";
}

bool DirectTransport::by_reference(int rank) const {
  Peer* p = peer(rank);
  return p && p->cma_ok;
}

absl::StatusOr<std::shared_ptr<direct::Conn>> DirectTransport::async_conn(Peer& p, absl::Time deadline) {
  {
    MutexLock lock(&p.mu);
    auto idle = [&p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu) { return !p.connecting; };
    if (!p.mu.AwaitWithDeadline(Condition(&idle), deadline)) {
      return absl::DeadlineExceededError(
          "direct channel: another call was still connecting to this worker at this call's deadline");
    }
    if (p.async_conn && !p.async_conn->broken) return p.async_conn;
    p.connecting = true;  // connected outside the lock: rpc_sync's idle connections stay at hand meanwhile
  }
  absl::StatusOr<std::shared_ptr<direct::Conn>> conn = absl::UnknownError("direct channel: connect threw");
  try {
    conn = channel_->connect(p.address, my_rank_, /*for_responses=*/true, deadline);
  } catch (...) {  // connecting is cleared whatever happens, or every later call to the peer would wait for it
    conn = status_from_current_exception();
  }
  MutexLock lock(&p.mu);
  p.connecting = false;
  if (!conn.ok()) return conn.status();
  p.async_conn = *conn;
  return p.async_conn;
}

template <typename F>
bool DirectTransport::admit(DoneFn& done, F&& while_locked) {
  {
    MutexLock lock(&mu_);
    if (!stopped_) {
      while_locked();
      return true;
    }
  }
  // Outside mu_: `done` runs the caller's callbacks, which may block or call back into the transport.
  done(absl::CancelledError("RPC was shut down on this worker"));
  return false;
}

bool DirectTransport::admit(DoneFn& done) {
  return admit(done, [] {});
}

void DirectTransport::call(int rank, const std::string& function, grpc::ByteBuffer request, absl::Time deadline,
                           DoneFn done) {
  Peer* p = peer(rank);
  if (!p) return done(absl::UnavailableError("no direct channel to this worker"));
  auto conn = async_conn(*p, deadline);
  if (!conn.ok()) return done(conn.status());
  uint64_t id = 0;
  const bool admitted = admit(done, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    id = next_id_++;
    // run_timer waits on mu_ for the earliest of these.
    pending_.emplace(id, Pending{std::move(done), conn->get(), deadlines_.emplace(deadline, id)});
  });
  if (!admitted) return;
  if (auto s = (*conn)->write(direct::Kind::kRequest, id, request, deadline); !s.ok()) {
    if ((*conn)->broken) (*conn)->shut();  // a half-written message: the channel is done; its calls fail
    complete(id, s);
  }
}

void DirectTransport::send(int rank, const std::string& function, grpc::ByteBuffer request, absl::Time deadline,
                           DoneFn done) {
  Peer* p = peer(rank);
  if (!p) return done(absl::UnavailableError("no direct channel to this worker"));
  auto conn = async_conn(*p, deadline);  // after the calls and sends on it before this one
  if (!conn.ok()) return done(conn.status());
  if (!admit(done)) return;
  if (auto s = (*conn)->write(direct::Kind::kOneway, 0, request, deadline); !s.ok()) {
    if ((*conn)->broken) (*conn)->shut();  // a half-written message: the channel is done; its calls fail
    return done(s);
  }
  done(grpc::ByteBuffer());
}

absl::StatusOr<grpc::ByteBuffer> DirectTransport::call_sync(int rank, const std::string& function,
                                                            const grpc::ByteBuffer& request, absl::Time deadline,
                                                            std::chrono::microseconds spin) {
  Peer* p = peer(rank);
  if (!p) return absl::UnavailableError("no direct channel to this worker");
  std::shared_ptr<direct::Conn> conn;
  {
    MutexLock lock(&p->mu);
    if (!p->idle_sync.empty()) {
      conn = std::move(p->idle_sync.back());
      p->idle_sync.pop_back();
    }
  }
  if (!conn) {
    auto fresh = channel_->connect(p->address, my_rank_, /*for_responses=*/false, deadline);
    if (!fresh.ok()) return fresh.status();
    conn = *fresh;
  }
  uint64_t id = 0;
  {
    MutexLock lock(&mu_);
    if (stopped_) return absl::CancelledError("RPC was shut down on this worker");
    id = next_id_++;
    sync_calls_.insert(conn);
  }
  const absl::Status sent = conn->write(direct::Kind::kRequest, id, request, deadline);
  absl::StatusOr<direct::Message> msg = sent.ok() ? conn->read(max_bytes_, deadline, spin, /*prompt_wake=*/true) : sent;
  bool stopped = false;
  {
    MutexLock lock(&mu_);
    sync_calls_.erase(conn);
    stopped = stopped_;
  }
  if (!msg.ok() || msg->kind != direct::Kind::kResponse || msg->call_id != id) {
    // The connection's state is unknown (a reply may still come): it is not reused.
    if (stopped) return absl::CancelledError("RPC was shut down on this worker");
    return msg.ok() ? absl::InternalError("direct channel: unexpected message") : msg.status();
  }
  {
    MutexLock lock(&p->mu);
    p->idle_sync.push_back(std::move(conn));
  }
  absl::StatusOr<grpc::ByteBuffer> reply(absl::in_place);
  reply->Swap(&msg->body.buffer());
  return reply;
}

void DirectTransport::on_request(const std::shared_ptr<direct::Conn>& conn, direct::Message msg) {
  Incoming in;
  in.request = std::move(msg.body);  // FrameBuffer: swapped, not copied
  in.cma_pid = conn->cma_pid;
  in.on_io_thread = true;
  if (msg.kind == direct::Kind::kOneway) {
    if (msg.call_id != 0) {  // not a frame this build writes: the connection is not trusted further
      conn->broken = true;
      return conn->shut();
    }
    in.oneway = true;
    in.reply = [](grpc::ByteBuffer*, const absl::Status&) {};  // nobody waits for it
    in.cut = [conn](const grpc::ByteBuffer*) {
      conn->broken = true;
      conn->shut();
    };
    return on_request_(std::move(in));
  }
  const uint64_t call_id = msg.call_id;
  const uint64_t max_bytes = max_bytes_;
  const absl::Duration write_timeout = message_timeout_;
  in.reply = [conn, call_id, max_bytes, write_timeout, cap = reply_write_cap_ms_](grpc::ByteBuffer* reply,
                                                                                  const absl::Status& status) {
    grpc::ByteBuffer body;
    if (status.ok() && reply && reply->Length() <= max_bytes) {
      body.Swap(reply);  // taken, not copied (ReplyFn)
    } else {
      tandem::wire::Response response;
      const absl::Status error =
          !status.ok() ? status
                       : absl::ResourceExhaustedError(absl::StrCat("the reply of ", reply ? reply->Length() : 0,
                                                                   " bytes exceeds the message limit of ", max_bytes));
      response.mutable_error()->set_code(static_cast<int>(error.code()));
      response.mutable_error()->set_message(std::string(error.message()));
      body = wire::Encoder().frame(response);
    }
    // A caller that stopped reading holds this thread for message_timeout at most (once the worker stops, for its
    // grace); the connection is then dropped.
    const int64_t capped_ms = cap->load();
    const absl::Duration wait = capped_ms > 0 ? std::min(write_timeout, absl::Milliseconds(capped_ms)) : write_timeout;
    if (auto s = conn->write(direct::Kind::kResponse, call_id, body, absl::Now() + wait); !s.ok()) {
      // Said unless the caller is gone or its link broke (UNAVAILABLE: it learns that itself): a caller that stopped
      // reading is not told otherwise.
      if (s.code() != absl::StatusCode::kUnavailable) {
        TANDEM_LOG(kWarn, "rpc") << "direct channel: the reply to rank " << conn->peer_rank << " (call " << call_id
                                 << ") could not be written, so its connection is closed (calls in flight on it fail "
                                 << "with it): " << s.message();
      }
      conn->shut();
    }
  };
  in.cut = [conn, call_id](const grpc::ByteBuffer* partial) {
    if (partial) return conn->write_half_and_shut(direct::Kind::kResponse, call_id, *partial);
    conn->broken = true;
    conn->shut();
  };
  on_request_(std::move(in));
}

void DirectTransport::on_response(direct::Message msg) { complete(msg.call_id, std::move(msg.body)); }

void DirectTransport::complete(uint64_t id, absl::StatusOr<grpc::ByteBuffer> reply) {
  DoneFn done;
  {
    MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // timed out or cancelled already: a late reply is dropped
    done = std::move(it->second.done);
    // A call that completes leaves no deadline behind: at tens of thousands of calls a second with a 60 s timeout,
    // they would pile up by the million and keep waking the timer.
    if (it->second.deadline != deadlines_.end()) deadlines_.erase(it->second.deadline);
    pending_.erase(it);
  }
  done(std::move(reply));
}

void DirectTransport::on_lost(const direct::Conn* conn, const absl::Status& why) {
  std::vector<uint64_t> lost;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, p] : pending_) {
      if (p.conn == conn) lost.push_back(id);
    }
  }
  const absl::Status cause = why.code() == absl::StatusCode::kCancelled ? why : absl::UnavailableError(why.message());
  if (!lost.empty() || why.code() != absl::StatusCode::kCancelled) {
    TANDEM_LOG(kDebug, "rpc") << "direct connection lost (" << why.message() << "), failing " << lost.size()
                              << " calls on it";
  }
  for (uint64_t id : lost) complete(id, cause);
}

void DirectTransport::run_timer() {
  MutexLock lock(&mu_);
  for (;;) {
    if (stopped_ && pending_.empty()) return;
    const absl::Time next = deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first;
    // Wakes at the earliest deadline, or when a call with an earlier one arrives, or at stop.
    auto wake = [this, next]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || (!deadlines_.empty() && deadlines_.begin()->first < next);
    };
    mu_.AwaitWithDeadline(Condition(&wake), next);
    std::vector<uint64_t> expired;
    const bool stopping = stopped_;
    const absl::Time now = absl::Now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const uint64_t id = deadlines_.begin()->second;
      expired.push_back(id);
      if (auto p = pending_.find(id); p != pending_.end()) p->second.deadline = deadlines_.end();
      deadlines_.erase(deadlines_.begin());
    }
    if (stopping) {
      for (const auto& [id, p] : pending_) expired.push_back(id);
    }
    if (expired.empty()) continue;
    mu_.Unlock();
    if (stopping) {
      for (uint64_t id : expired) complete(id, absl::CancelledError("RPC was shut down on this worker"));
    } else {
      // Their callbacks run on a thread of their own: one that blocks (a note batch sent again, writing to a peer
      // that stopped reading, until that call's deadline) must not hold back the deadlines of every other call. At
      // most kMaxExpiringThreads (8) such threads at once (and none when no thread can be made): beyond, the callbacks
      // run here, as they all did before.
      std::function<void()> fail = [this, expired = std::move(expired)] {
        for (uint64_t id : expired) complete(id, absl::DeadlineExceededError(kNoReplyByDeadline));
      };
      if (!expiring_.try_start(fail)) fail();
    }
    mu_.Lock();
  }
}

void DirectTransport::cut(int rank, const grpc::ByteBuffer* partial) {
  Peer* p = peer(rank);
  if (!p) return;
  std::shared_ptr<direct::Conn> async;
  std::vector<std::shared_ptr<direct::Conn>> idle;
  {
    MutexLock lock(&p->mu);
    // A connection being made now is cut too: wait for it (bounded by that connect's deadline).
    auto idle_peer = [p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) { return !p->connecting; };
    p->mu.Await(Condition(&idle_peer));
    async = std::move(p->async_conn);
    idle.swap(p->idle_sync);
  }
  for (auto& c : idle) c->shut();
  if (!async) return;
  if (partial) {
    async->write_half_and_shut(direct::Kind::kRequest, 0, *partial);
  } else {
    async->broken = true;
    async->shut();  // the epoll thread sees it closed and fails the calls on it (on_lost)
  }
}

bool DirectTransport::stop(std::chrono::milliseconds grace) {
  {
    MutexLock lock(&mu_);
    if (stopped_) return !timer_.joinable();
    stopped_ = true;
    for (auto& conn : sync_calls_) conn->shut();  // their callers see the channel closed
  }
  const bool done = channel_->stop(grace);  // fails async calls with CANCELLED (on_lost)
  if (timer_.joinable()) timer_.join();     // fails what is left of them
  expiring_.join_all();
  return done;
}

}  // namespace tandem::rpc::detail
