// Same-host deliveries through shared memory (pipeline/detail/shm_p2p.h), in one process: the encoding, a receive
// woken by the bell, what does not fit, and malformed memory as an error.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tandem/pipeline/detail/p2p.h"
#include "tandem/pipeline/detail/shm_p2p.h"
#include "tests/common/files.h"
#include "tests/common/time_scale.h"
#include "tests/pipeline/fresh_pipe.h"

namespace tandem::pipeline::detail {
namespace {

using std::chrono::milliseconds;

Clock::time_point within(milliseconds ms) { return Clock::now() + test::scaled(ms); }

// Whether a receive of `key` on thread `tid` came to sleep on its inbox's bell within 5 s (scaled): waiting on it, and
// the thread asleep (it sleeps nowhere else on the bell's path: after reading the bell it drains the rings and spins
// before the futex). A send or an abort that comes then can only end the wait by ringing the bell.
bool await_asleep_on_bell(Mailbox& box, const MailKey& key, const std::atomic<pid_t>& tid) {
  return test::poll_until(test::scaled(milliseconds(5000)), [&] {
    if (tid.load() == 0 || box.waiting(key) != Mailbox::Waiting::kOnTheBell) return false;
    const std::string line = test::read_file("/proc/self/task/" + std::to_string(tid.load()) + "/stat");
    const size_t paren = line.rfind(')');  // "tid (comm) S ...": the state follows the name
    return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'S';
  });
}

// take() on a thread of its own, which says its id first.
std::future<absl::StatusOr<c10::IValue>> take_async(Mailbox& box, const MailKey& key, std::atomic<pid_t>& tid,
                                                    const std::string& what) {
  return std::async(std::launch::async, [&box, key, &tid, what] {
    tid = static_cast<pid_t>(syscall(SYS_gettid));
    return box.take(key, within(milliseconds(10000)), what);
  });
}

c10::IValue shm_sample() {
  at::Tensor transposed = at::arange(6, at::kFloat).reshape({2, 3}).t();  // not contiguous
  at::Tensor wants_grad = at::ones({4}, at::kDouble).requires_grad_();
  return c10::ivalue::Tuple::create(
      {c10::IValue(transposed), c10::IValue(int64_t{-7}), c10::IValue(2.5), c10::IValue(std::string("mask")),
       c10::IValue(true), c10::IValue(), c10::IValue(std::vector<int64_t>{3, 1, 4}),
       c10::IValue(std::vector<at::Tensor>{wants_grad, at::arange(2) < 1}),
       c10::ivalue::Tuple::create({c10::IValue(at::zeros({0, 5}, at::kLong)), c10::IValue(at::scalar_tensor(1.5))})});
}

void expect_sample(const c10::IValue& v) {
  ASSERT_TRUE(v.isTuple());
  const auto& e = v.toTupleRef().elements();
  ASSERT_EQ(e.size(), 9u);
  EXPECT_TRUE(at::equal(e[0].toTensor(), at::arange(6, at::kFloat).reshape({2, 3}).t()));
  EXPECT_EQ(e[1].toInt(), -7);
  EXPECT_EQ(e[2].toDouble(), 2.5);
  EXPECT_EQ(e[3].toStringRef(), "mask");
  EXPECT_TRUE(e[4].toBool());
  EXPECT_TRUE(e[5].isNone());
  EXPECT_EQ(e[6].toIntVector(), (std::vector<int64_t>{3, 1, 4}));
  const auto tensors = e[7].toTensorVector();
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_TRUE(tensors[0].requires_grad());
  EXPECT_TRUE(at::equal(tensors[0].detach(), at::ones({4}, at::kDouble)));
  EXPECT_TRUE(at::equal(tensors[1], at::arange(2) < 1));
  const auto& inner = e[8].toTupleRef().elements();
  EXPECT_EQ(inner[0].toTensor().sizes(), (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(inner[1].toTensor().dim(), 0);
  EXPECT_EQ(inner[1].toTensor().item<float>(), 1.5f);
}

TEST(UnitPipelineShm, TheEncodingCarriesTuplesListsScalarsAndTensorsOfAnyLayout) {
  const c10::IValue v = shm_sample();
  const size_t n = encoded_size(v);
  ASSERT_GT(n, 0u);
  std::vector<uint8_t> buf(n + 64);
  uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  encode(v, at, n);
  expect_sample(decode(at, n));
  // What it does not carry: the sender uses RPC instead.
  c10::Dict<std::string, int64_t> dict;
  dict.insert("a", 1);
  EXPECT_EQ(encoded_size(c10::IValue(dict)), 0u);
}

TEST(UnitPipelineShm, TruncatedOrCorruptedBytesAreAnErrorNeverACrash) {
  const c10::IValue v = shm_sample();
  const size_t n = encoded_size(v);
  std::vector<uint8_t> good(n);
  encode(v, good.data(), n);
  for (size_t cut = 0; cut < n; cut += 3) {
    EXPECT_THROW(decode(good.data(), cut), std::exception) << "cut at " << cut;
  }
  std::mt19937 gen(7);
  int errors = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> bad = good;
    for (int k = 0; k < 4; ++k) bad[gen() % n] = static_cast<uint8_t>(gen());
    try {
      (void)decode(bad.data(), n);
    } catch (const std::exception&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 0);
}

TEST(UnitPipelineShm, AReceiveWaitingBeforeTheInboxExistedIsWokenByTheBell) {
  const int64_t pipe = fresh_pipe();
  Mailbox& box = Mailbox::get();
  const MailKey k{pipe, 0, 1, 0, false};
  std::atomic<pid_t> tid{0};
  auto taken = take_async(box, k, tid, "m0");
  ASSERT_TRUE(await_waiting(box, k, Mailbox::Waiting::kAlone));
  auto inbox = std::make_shared<Inbox>();
  box.set_inbox(pipe, inbox);
  auto outlet = Outlet::open(inbox->ends_for(5));
  ASSERT_TRUE(outlet.ok()) << outlet.status();
  ASSERT_TRUE(await_asleep_on_bell(box, k, tid)) << "the inbox did not move the receive to sleep on its bell";
  ASSERT_TRUE((*outlet)->send(k, shm_sample()));
  ASSERT_EQ(taken.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  auto got = taken.get();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_sample(*got);
  // Another sender's ring, and a receive on the bell from the start.
  auto second = Outlet::open(inbox->ends_for(6));
  ASSERT_TRUE(second.ok()) << second.status();
  const MailKey g{pipe, 0, 0, 3, true};
  std::atomic<pid_t> tid2{0};
  auto taken2 = take_async(box, g, tid2, "g3");
  ASSERT_TRUE(await_asleep_on_bell(box, g, tid2));
  ASSERT_TRUE((*second)->send(g, c10::IValue(at::full({2}, 4.0))));
  auto got2 = taken2.get();
  ASSERT_TRUE(got2.ok()) << got2.status();
  EXPECT_TRUE(at::equal(got2->toTensor(), at::full({2}, 4.0)));
  box.release(pipe);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineShm, AnAbortWakesAReceiveSleepingOnTheBell) {
  const int64_t pipe = fresh_pipe();
  Mailbox& box = Mailbox::get();
  auto inbox = std::make_shared<Inbox>();
  box.set_inbox(pipe, inbox);
  std::atomic<pid_t> tid{0};
  auto taken = take_async(box, {pipe, 4, 1, 0, false}, tid, "m0");
  ASSERT_TRUE(await_asleep_on_bell(box, {pipe, 4, 1, 0, false}, tid));
  box.abort(pipe, 4, absl::AbortedError("stage 1 failed"));
  ASSERT_EQ(taken.wait_for(test::scaled(milliseconds(5000))), std::future_status::ready);
  auto got = taken.get();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(got.status().message().find("stage 1 failed"), std::string::npos) << got.status();
  // The deadline ends a wait on the bell too.
  auto late = box.take({pipe, 5, 1, 0, false}, Clock::now() + milliseconds(50), "m0");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  box.release(pipe);
  EXPECT_EQ(box.held(), 0u);
}

TEST(UnitPipelineShm, WhatDoesNotFitIsRefusedForRpcAndTheRingIsReusedOnceRead) {
  const int64_t pipe = fresh_pipe();
  Mailbox& box = Mailbox::get();
  auto inbox = std::make_shared<Inbox>();
  box.set_inbox(pipe, inbox);
  auto outlet = Outlet::open(inbox->ends_for(1));
  ASSERT_TRUE(outlet.ok()) << outlet.status();
  const int64_t half = static_cast<int64_t>(Inbox::kRingBytes / 2 / sizeof(float));
  EXPECT_FALSE((*outlet)->send({pipe, 0, 1, 0, false}, c10::IValue(at::zeros({half}))));  // larger than half a ring
  const at::Tensor mib = at::ones({int64_t{1} << 18});                                    // 1 MiB
  int sent = 0;
  while ((*outlet)->send({pipe, 0, 1, sent, false}, c10::IValue(mib))) ++sent;
  EXPECT_EQ(sent, 3);  // 4 MiB hold three records of 1 MiB and their headers
  for (int mb = 0; mb < sent; ++mb) {
    auto got = box.take({pipe, 0, 1, mb, false}, within(milliseconds(5000)), "m");
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(at::equal(got->toTensor(), mib));
  }
  for (int mb = sent; mb < sent + 8; ++mb) {  // around the ring's end and over its start again
    ASSERT_TRUE((*outlet)->send({pipe, 0, 1, mb, false}, c10::IValue(mib * mb))) << mb;
    auto got = box.take({pipe, 0, 1, mb, false}, within(milliseconds(5000)), "m");
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(at::equal(got->toTensor(), mib * mb));
  }
  box.release(pipe);
}

// Publishes, in the ring `ends` names, what a broken sender would: a record whose length is not a multiple of 8.
void publish_malformed_record(const RingEnds& ends) {
  const std::string path = absl::StrCat("/proc/self/fd/", ends.ring_fd);
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  EXPECT_NE(ftruncate(fd, 0), 0) << "the ring's size is sealed: a peer cannot shrink it under the receiver";
  const size_t bytes = 256 + Inbox::kRingBytes;
  auto* base = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  ASSERT_NE(base, MAP_FAILED);
  const uint32_t len = 12, kind = 1;
  std::memcpy(base + 256, &len, 4);
  std::memcpy(base + 256 + 4, &kind, 4);
  reinterpret_cast<std::atomic<uint64_t>*>(base + 64)->store(64);  // the tail (RingHeader: after a cache line)
  munmap(base, bytes);
}

// The error a malformed record from rank 2 (no worker of this process's RPC) gives.
void expect_malformed_from_rank_2(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("malformed"), std::string::npos) << status;
  EXPECT_NE(status.message().find("from worker '2'"), std::string::npos) << status;
}

TEST(UnitPipelineShm, MalformedMemoryFailsTheReceiveNamingTheSender) {
  const int64_t pipe = fresh_pipe();
  Mailbox& box = Mailbox::get();
  auto inbox = std::make_shared<Inbox>();
  box.set_inbox(pipe, inbox);
  ASSERT_NO_FATAL_FAILURE(publish_malformed_record(inbox->ends_for(2)));
  auto got = box.take({pipe, 0, 1, 0, false}, within(milliseconds(2000)), "m0");
  expect_malformed_from_rank_2(got.status());
  box.release(pipe);
}

// The idle executor's take_go meets the malformed record: the receive that comes next (its message may have been
// after the record, lost with it) fails at once with that error instead of waiting for its deadline.
TEST(UnitPipelineShm, AMalformedRecordTheIdleExecutorMeetsFailsTheNextReceiveAtOnce) {
  const int64_t pipe = fresh_pipe();
  Mailbox& box = Mailbox::get();
  auto inbox = std::make_shared<Inbox>();
  box.set_inbox(pipe, inbox);
  ASSERT_NO_FATAL_FAILURE(publish_malformed_record(inbox->ends_for(2)));
  auto go = box.take_go(pipe);
  expect_malformed_from_rank_2(go.status());
  const auto start = Clock::now();
  auto got = box.take({pipe, 0, 1, 0, false}, within(milliseconds(60000)), "m0");
  expect_malformed_from_rank_2(got.status());
  EXPECT_NE(got.status().message().find("waiting for m0"), std::string::npos) << got.status();
  EXPECT_LT(Clock::now() - start, milliseconds(30000)) << "the receive waited for its deadline";
  // Once: the receive after it waits as usual.
  auto later = box.take({pipe, 0, 1, 1, false}, within(milliseconds(50)), "m1");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kDeadlineExceeded) << later.status();
  box.release(pipe);
  EXPECT_EQ(box.held(), 0u);
}

}  // namespace
}  // namespace tandem::pipeline::detail
