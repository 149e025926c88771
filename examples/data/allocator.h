// How the examples' processes keep the memory they free (glibc's malloc), and why.
#pragma once

namespace tandem::examples {

// Sets glibc's malloc so that freed memory stays in the process for the next tensor: one arena for all threads, no
// mmap for large blocks, no trimming. LibTorch allocates every tensor with posix_memalign and frees it when the last
// reference goes; by default glibc serves blocks above 128 KiB (and, in threads other than main, blocks larger than
// an arena's 64 MiB heap) with mmap and returns them at free, so every large activation is faulted in afresh. On this
// project's VMs a page fault costs about 10 us: scoring the 10,000 test images with the example CNN in chunks of
// 1,000 on an RPC thread took 23 s this way and 2.4 s with these settings (the equivalent environment variables,
// MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824, do the same for any
// program; docs/deploy.md). The price is that the process's resident size stays at its peak.
// Call first in main, before any thread starts (threads keep the arena they got). Writes one line to stderr if glibc
// refuses a setting, and carries on: the settings change speed, never results. Not thread-safe.
void keep_freed_memory();

}  // namespace tandem::examples
