// Reading and writing one direction's byte ring by address (lamina/transport/ring_memory.py),
// shared by the ring's fast path (shm_ring.cpp) and the memory node's native ATTEND loop
// (memnode/csrc/attend_plane.cpp).
//
// HEAD/TAIL count bytes since creation, position = count % cap. The writer owns HEAD, the
// reader TAIL. Stores of a count are releases, loads of the other side's count acquires (x86:
// plain moves, ordered by the compiler barrier of the atomic builtins); the waiting flags are
// read after a full fence.
#pragma once

#include <Python.h>
#include <immintrin.h>
#include <poll.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "exchange.h"
#include "ring_layout.h"

namespace lamina_ring {

struct Ring {
  uint64_t* ctl;
  uint8_t* data;
  int64_t cap;
  Ring(int64_t ctl_addr, int64_t data_addr, int64_t capacity)
      : ctl(reinterpret_cast<uint64_t*>(ctl_addr)),
        data(reinterpret_cast<uint8_t*>(data_addr)),
        cap(capacity) {}
  uint64_t load(int64_t word) const { return __atomic_load_n(ctl + word, __ATOMIC_ACQUIRE); }
  void store(int64_t word, uint64_t v) const { __atomic_store_n(ctl + word, v, __ATOMIC_RELEASE); }
  // Copy n bytes between `count` (a stream position) and p, wrapping at the ring's end.
  void put(uint64_t count, const void* p, int64_t n) const {
    const int64_t pos = static_cast<int64_t>(count % cap), first = std::min(n, cap - pos);
    std::memcpy(data + pos, p, first);
    if (n > first) std::memcpy(data, static_cast<const uint8_t*>(p) + first, n - first);
  }
  void get(uint64_t count, void* p, int64_t n) const {
    const int64_t pos = static_cast<int64_t>(count % cap), first = std::min(n, cap - pos);
    std::memcpy(p, data + pos, first);
    if (n > first) std::memcpy(static_cast<uint8_t*>(p) + first, data, n - first);
  }
  bool flag_after_fence(int64_t word) const {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(ctl + word, __ATOMIC_ACQUIRE) != 0;
  }
};

// Checks the header and descriptors at `tail` (already copied to hd / descs) as
// wire.unpack_header / unpack_preamble do; false: leave the message to the Python decoder.
inline bool well_formed(const Header& hd, const Desc* descs, const Limits& lim) {
  if (std::memcmp(hd.magic, kMagic, 4) != 0 || hd.version != kVersion) return false;
  int64_t off = align(kHeaderBytes + hd.num_tensors * kDescBytes + hd.meta_len);
  for (uint32_t i = 0; i < hd.num_tensors; ++i) {
    const Desc& d = descs[i];
    const DType* dt = by_code(d.code);
    if (!dt || d.ndim > lim.ndim || d.ndim > kMaxNdim) return false;
    if (static_cast<int64_t>(d.nbytes) < 0 || static_cast<int64_t>(d.nbytes) > lim.tensor_bytes)
      return false;
    int64_t numel = 1;
    for (int k = 0; k < kMaxNdim; ++k) {
      if (k >= d.ndim) {
        if (d.shape[k] != 0) return false;
        continue;
      }
      if (d.shape[k] < 0) return false;
      if (d.shape[k] && numel > lim.tensor_bytes / d.shape[k]) return false;  // overflow
      numel *= d.shape[k];
    }
    if (numel * dt->size != static_cast<int64_t>(d.nbytes)) return false;
    off += align(static_cast<int64_t>(d.nbytes));
  }
  return off == static_cast<int64_t>(hd.total);
}

// Runs fn() (which must not throw) without the GIL. Not an RAII guard: a daemon thread that
// wakes after the interpreter finalized is ended by PyEval_RestoreThread's forced unwind, which
// must not cross a noexcept destructor (std::terminate, "terminate called without an active
// exception" on the role's stderr at exit).
template <typename Fn>
auto without_gil(Fn fn) {
  if (!PyGILState_Check()) return fn();  // a native caller that holds no GIL (a step program)
  PyThreadState* state = PyEval_SaveThread();
  auto out = fn();
  PyEval_RestoreThread(state);
  return out;
}

// Polls ready() until it is true or timeout_ns passed (the caller holds no GIL); whether it came
// true. yield_every > 0: sched_yield every that many rounds of 64 polls, so a runnable thread of
// this core gets its turn.
template <typename Ready>
bool spin(Ready ready, int64_t timeout_ns, int64_t yield_every) {
  if (ready()) return true;
  if (timeout_ns <= 0) return false;
  const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  for (int64_t polls = 1;; ++polls) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      _mm_pause();
    }
    if (yield_every > 0 && polls % yield_every == 0) sched_yield();
    if (std::chrono::steady_clock::now() >= end) return ready();
  }
}

inline int64_t now_ns() { return exchange_clock_ns(); }  // time.perf_counter_ns's clock

inline void ring_bell(int fd) {  // a doorbell's wake-up (-1: no doorbell)
  if (fd < 0) return;
  const char one = 1;
  ssize_t n = write(fd, &one, 1);  // EAGAIN: a wake-up is pending anyway
  (void)n;
}

inline void drain(int fd) {  // a doorbell's (non-blocking FIFO or eventfd) pending wake-ups
  char buf[64];
  while (read(fd, buf, sizeof(buf)) > 0) {
  }
}

// ring_memory.wait_for's sleep, for a reader at `tail`: raise the reader's waiting flag, look
// again, sleep on the data doorbell (a FIFO's fd) until it rings or timeout_ns passed; whether
// data arrived (false after a ring without data too: the caller checks why, as wait_for does).
// The caller has released the GIL.
inline bool sleep_until_data(const Ring& rx, int64_t tail, int bell, int64_t timeout_ns) {
  const uint64_t t = static_cast<uint64_t>(tail);
  rx.store(kReaderWaits, 1);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (rx.load(kHead) == t && timeout_ns > 0) {
    pollfd p{bell, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(timeout_ns / 1000000 + 1, 1000))) > 0)
      drain(bell);
  }
  rx.store(kReaderWaits, 0);
  return rx.load(kHead) != t;
}

}  // namespace lamina_ring
