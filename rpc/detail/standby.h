// Warm standby workers (tandem-run restarts, docs/elastic.md): a launcher may start a Tandem program before it is
// needed, with TANDEM_STANDBY_FD naming a socket. The program then loads (LibTorch's start-up, a third of a second,
// is the cost a restart saves) and, before main, waits on that socket for the environment of the worker it becomes
// (RANK, MASTER_PORT, ...: "KEY=VALUE" entries, each ended by '\0', the block by an empty entry). Each value is
// written over the placeholder the launcher gave that variable when it fits, so /proc/<pid>/environ shows it too;
// otherwise it is set with setenv. The launcher closing the socket without a block ends the process (exit 0).
//
// A launcher recognises programs that can wait so by kStandbyMarker in their executable.
#pragma once

namespace tandem::rpc::detail {

constexpr char kStandbyMarker[] = "tandem-standby-protocol-1";

// Runs before main (rpc.cc): returns at once unless TANDEM_STANDBY_FD is set.
void wait_for_activation();

}  // namespace tandem::rpc::detail
