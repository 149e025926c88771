#include "examples/data/allocator.h"

#include <malloc.h>

#include <cstdio>

namespace tandem::examples {

void keep_freed_memory() {
  constexpr int kGiB = 1 << 30;
  const struct {
    int param;
    int value;
    const char* name;
  } settings[] = {{M_ARENA_MAX, 1, "M_ARENA_MAX"},
                  {M_MMAP_THRESHOLD, kGiB, "M_MMAP_THRESHOLD"},
                  {M_TRIM_THRESHOLD, kGiB, "M_TRIM_THRESHOLD"}};
  for (const auto& s : settings) {
    if (mallopt(s.param, s.value) != 1) {
      std::fprintf(stderr,
                   "keep_freed_memory: glibc refused mallopt(%s, %d); large tensors may be slower to allocate\n",
                   s.name, s.value);
    }
  }
}

}  // namespace tandem::examples
