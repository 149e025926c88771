#include "tandem/rpc/transport.h"

#include "tandem/rpc/detail/wait_slice.h"
#include "tandem/sync/sync.h"

namespace tandem::rpc {

absl::StatusOr<grpc::ByteBuffer> Transport::call_sync(int peer, const std::string& function,
                                                      const grpc::ByteBuffer& request, absl::Time deadline,
                                                      std::chrono::microseconds) {
  struct Waiter {
    Notification done;
    absl::StatusOr<grpc::ByteBuffer> reply = absl::UnknownError("no reply");
  };
  auto w = std::make_shared<Waiter>();
  call(peer, function, request, deadline, [w](absl::StatusOr<grpc::ByteBuffer> reply) {
    w->reply = std::move(reply);
    w->done.Notify();
  });
  // Every transport completes a call by its deadline; the extra second only covers the callback's own scheduling.
  if (!w->done.HasBeenNotified()) detail::prefer_prompt_wake();  // woken at once by the reply (detail/wait_slice.h)
  if (!w->done.WaitForNotificationWithDeadline(deadline + absl::Seconds(1))) {
    return absl::DeadlineExceededError(kNoReplyByDeadline);
  }
  return std::move(w->reply);
}

void Transport::send(int peer, const std::string& function, grpc::ByteBuffer request, absl::Time deadline,
                     DoneFn done) {
  call(peer, function, std::move(request), deadline, std::move(done));
}

}  // namespace tandem::rpc
