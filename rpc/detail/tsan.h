// Orderings that ThreadSanitizer cannot see, stated where the code relies on them. Outside a -fsanitize=thread build
// the macros are nothing.
//
// The direct channel hands a connection from one loop thread to the next through the kernel: it is re-armed with
// EPOLLONESHOT after one thread is done with it, and only then can epoll_wait give it to another. TANDEM_HAPPENS_BEFORE
// marks the hand-over (before re-arming), TANDEM_HAPPENS_AFTER the taking over (after epoll_wait returned it).
#pragma once

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define TANDEM_HAPPENS_BEFORE(addr) __tsan_release(static_cast<void*>(addr))
#define TANDEM_HAPPENS_AFTER(addr) __tsan_acquire(static_cast<void*>(addr))
#else
#define TANDEM_HAPPENS_BEFORE(addr) ((void)0)
#define TANDEM_HAPPENS_AFTER(addr) ((void)0)
#endif
