// libFuzzer target: the direct channel's framing (rpc/detail/direct.h) — headers and bodies as they arrive on a socket,
// cut anywhere. The bytes are written into one end of a socket pair, which is then closed; the other end reads messages
// until it gets an error (a lie in a header, or the end of the stream).
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

#include "tandem/rpc/detail/direct.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) != 0) return 0;
  const size_t n = std::min<size_t>(size, 64 * 1024);  // fits the socket buffer: the write never blocks
  (void)!::write(fds[1], data, n);
  ::close(fds[1]);
  tandem::rpc::direct::Conn conn(fds[0]);  // closes fds[0]
  for (int i = 0; i < 64; ++i) {
    auto msg = conn.read(/*max_body=*/1 << 20, absl::Now() + absl::Milliseconds(100));
    if (!msg.ok()) break;
  }
  return 0;
}
