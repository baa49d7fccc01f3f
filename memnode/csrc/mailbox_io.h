// A memory node's side of a step mailbox (lamina/transport/mailbox.py) in native code: the poll
// that memnode/mailbox_loop.py runs without the GIL when the node has a native plane
// (attend_plane.cpp AttendPlane::serve_mailbox). Python's MailboxServer is the reference: for a
// SEND past the slot's last answered one, gather the node's q rows and appended k/v rows, attend,
// scatter o and lse into the node's landing rows, then REPLY = SEND after a release fence. A SEND
// whose attend the native path declines (a step not prepared yet, any check Python must make)
// is Python's: the poll returns its slot untouched.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstdint>
#include <utility>

namespace lamina_mailbox {

// Word indices of mailbox.py (slot words; a node's words).
constexpr int kSend = 0, kBase = 1, kStep = 2;
constexpr int kReply = 0, kNq = 2, kNa = 3;

// One slot as addresses in this process (MailboxLoop's layout row, in this order).
struct Slot {
  int64_t *words, *node_words, *q_rows, *kv_rows;
  void *q, *k, *v, *o;
  float* lse;
};
constexpr int kSlotFields = 9;

struct Dims {  // MailboxShape: rows per slot, heads, kv heads, head dim, q/k/v/o's dtype
  int64_t tokens, heads, kv_heads, dim;
  at::ScalarType dtype;
};

inline int64_t load(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store(int64_t* p, int64_t x) { __atomic_store_n(p, x, __ATOMIC_RELEASE); }

inline bool in_range(const int64_t* rows, int64_t n, int64_t tokens) {
  for (int64_t i = 0; i < n; ++i)
    if (rows[i] < 0 || rows[i] >= tokens) return false;
  return true;
}

// Answers slot s's pending SEND through attend(step, layer, q, k, v, &o, &lse) (false: Python
// answers it); whether it did.
template <typename Attend>
bool answer(const Slot& s, const Dims& d, int64_t send, Attend&& attend) {
  const int64_t nq = load(s.node_words + kNq), na = load(s.node_words + kNa);
  if (nq || na) {
    if (nq < 0 || na < 0 || nq > d.tokens || na > d.tokens || !in_range(s.q_rows, nq, d.tokens) ||
        !in_range(s.kv_rows, na, d.tokens))
      return false;
    const auto rows = at::TensorOptions().dtype(at::kLong);
    const auto vals = at::TensorOptions().dtype(d.dtype);
    at::Tensor qr = at::from_blob(s.q_rows, {nq}, rows), kr = at::from_blob(s.kv_rows, {na}, rows);
    const at::Tensor q = at::from_blob(s.q, {d.tokens, d.heads, d.dim}, vals).index_select(0, qr);
    const at::Tensor k =
        at::from_blob(s.k, {d.tokens, d.kv_heads, d.dim}, vals).index_select(0, kr);
    const at::Tensor v =
        at::from_blob(s.v, {d.tokens, d.kv_heads, d.dim}, vals).index_select(0, kr);
    at::Tensor o, lse;
    const int64_t step = load(s.words + kStep), layer = send - load(s.words + kBase) - 1;
    if (!attend(step, layer, q, k, v, &o, &lse)) return false;
    at::from_blob(s.o, {d.tokens, d.heads, d.dim}, vals).index_copy_(0, qr, o.to(d.dtype));
    at::from_blob(s.lse, {d.tokens, d.heads}, at::TensorOptions().dtype(at::kFloat))
        .index_copy_(0, qr, lse.to(at::kFloat));
  }
  store(s.node_words + kReply, send);  // the answer's bytes before REPLY (release)
  return true;
}

// Polls every slot, answering each SEND past seen[s] (updated), for up to spin_ns once nothing
// is left (yield_every > 0: sched_yield every that many rounds of 64 polls). Returns (SENDs
// answered, the slot whose SEND is Python's or -1).
template <typename Attend>
std::pair<int64_t, int64_t> poll(const Slot* slots, int64_t n, int64_t* seen, const Dims& d,
                                 int64_t spin_ns, int64_t yield_every, Attend&& attend) {
  int64_t answered = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  for (int64_t rounds = 1;; ++rounds) {
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t send = load(slots[i].words + kSend);
      if (send <= seen[i]) continue;
      if (!answer(slots[i], d, send, attend)) return {answered, i};
      seen[i] = send;
      ++answered, any = true;
    }
    if (any) continue;
    if (answered || std::chrono::steady_clock::now() >= end) return {answered, -1};
    for (int j = 0; j < 64; ++j) _mm_pause();
    if (yield_every > 0 && rounds % yield_every == 0) sched_yield();
  }
}

}  // namespace lamina_mailbox
