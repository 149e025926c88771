#include "tandem/rpc/detail/standby.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

extern char** environ;

namespace tandem::rpc::detail {
namespace {

// Kept in the executable (the launcher looks for it there).
__attribute__((used)) const char kMarkerInBinary[] = "tandem-standby-protocol-1";
static_assert(sizeof(kMarkerInBinary) == sizeof(kStandbyMarker), "the marker and its declaration must agree");

// Writes KEY=VALUE over the environment entry of KEY when it fits there (the launcher's placeholder), so that the
// process's initial environment block, which /proc/<pid>/environ shows, says it too; setenv otherwise.
void put(const std::string& entry) {
  const size_t eq = entry.find('=');
  if (eq == std::string::npos || eq == 0) return;
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, entry.data(), eq + 1) != 0) continue;
    const size_t room = std::strlen(*e);
    if (entry.size() <= room) {
      std::memcpy(*e, entry.data(), entry.size());
      std::memset(*e + entry.size(), 0, room - entry.size());
      return;
    }
    break;
  }
  ::setenv(entry.substr(0, eq).c_str(), entry.c_str() + eq + 1, 1);
}

}  // namespace

void wait_for_activation() {
  const char* fd_env = std::getenv("TANDEM_STANDBY_FD");
  if (!fd_env || !*fd_env) return;
  const int fd = std::atoi(fd_env);
  std::string block;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) ::_exit(0);  // the launcher did not need this standby
    if (n < 0) {             // not the launcher's word: said, and not a success
      std::fprintf(stderr, "tandem standby worker: cannot read its activation (fd %d): %s\n", fd, std::strerror(errno));
      ::_exit(1);
    }
    block.append(buf, static_cast<size_t>(n));
    if (block.size() >= 2 && block.compare(block.size() - 2, 2, std::string("\0\0", 2)) == 0) break;
  }
  ::close(fd);
  ::unsetenv("TANDEM_STANDBY_FD");
  for (size_t at = 0; at < block.size();) {
    const size_t end = block.find('\0', at);
    if (end == at || end == std::string::npos) break;
    put(block.substr(at, end - at));
    at = end + 1;
  }
}

}  // namespace tandem::rpc::detail
