// The launcher's own standard output and error, relayed by threads of their own, so that a reader that stops (a paused
// pager, a full pipe, a stalled terminal or log collector) never stops the launcher: it keeps reaping, heartbeating
// and stopping its workers, and the job goes on.
//
// Descriptors 1 and 2 become pipes. For each, one thread reads the pipe into memory (up to `cap` bytes waiting; beyond
// that, output is dropped and counted) and another writes what waits to the original descriptor; once the output
// moves again, a line on the same stream says how many bytes were dropped. At exit (std::exit or main's return), what
// waits is written within 5 s, else left unwritten. Lines keep their order within a stream, not across the two.
#pragma once

#include <cstddef>

namespace tandem::tools {

// Call once, early in main, before any thread or child is started. Returns false (and changes nothing) when a pipe
// cannot be made: the output is then written directly, as before. Throws std::system_error when a thread cannot be.
bool relay_own_output(size_t cap = size_t{64} << 20);

}  // namespace tandem::tools
