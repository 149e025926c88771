// The launcher's own standard output and error, relayed by threads of their own, so that a reader that stops (a paused
// pager, a full pipe, a stalled terminal or log collector) never stops the launcher: it keeps reaping, heartbeating
// and stopping its workers, and the job goes on.
//
// Descriptors 1 and 2 become pipes. For each, one thread reads the pipe into memory (at most `cap` bytes waiting or
// being written; beyond that, output is dropped, all of it until what waited before is written, and counted) and
// another writes what waits to the original descriptor, whole lines only (a line longer than 64 KiB in pieces), so
// that where both streams reach one terminal a line of one never cuts a line of the other; once the output moves
// again, a line on the same stream, where the output went missing, says how many bytes were dropped. At exit
// (std::exit or main's return), what waits is written within 5 s, else left unwritten. On a crash (a fatal signal,
// std::terminate) descriptors 1 and 2 are the original ones again for its message, and what waited is lost. Lines keep
// their order within a stream, not across the two.
#pragma once

#include <cstddef>

namespace tandem::tools {

// Call once, early in main, before any thread or child is started. Descriptors 0-2 that are closed get /dev/null.
// Returns false (and changes nothing else) when a pipe or a thread cannot be made: the output is then written
// directly, as before.
bool relay_own_output(size_t cap = size_t{64} << 20);

}  // namespace tandem::tools
