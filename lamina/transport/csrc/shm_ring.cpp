// The shared-memory ring's fast path (lamina/transport/shm_fast.py): a whole wire message
// written into (Writer), or read out of (Reader), one direction's byte ring in one call by an
// object that holds the ring's state, and a wait on a control word without the GIL.
//
// Ring (lamina/transport/ring_memory.py): a control block of u64 words and `cap` data bytes;
// HEAD/TAIL count bytes since creation, position = count % cap. The writer owns HEAD, the
// reader TAIL. Stores of a count are releases, loads of the other side's count acquires (x86:
// plain moves, ordered by the compiler barrier of the atomic builtins); the waiting flags are
// read after a full fence.
//
// Wire format (lamina/transport/wire.py, the source of truth): a 48-byte header "<4sHHqqqIIQ",
// 80-byte descriptors "<BB6xQ8q", meta, padding to 64, then each tensor's bytes padded to 64.
// This file accepts only messages that are whole and well formed under the given limits;
// anything else is left in the ring for the Python decoder, which raises the precise error.
//
// The layout constants, the wire structs and the status codes are in ring_layout.h, which
// the module exports (layout(), SENT, ...) for shm_fast.load() to check against Python's.
#include <torch/extension.h>

#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "exchange.h"
#include "ring_io.h"

namespace py = pybind11;

namespace {

using namespace lamina_ring;

constexpr int64_t kMaxDescs = 64;  // most tensors of a fast-path message (more: the Python path)

// Messages up to this many bytes are copied with the GIL held: releasing and re-taking it
// costs more than the copy (a 4 KB message is ~100 ns of memcpy).
constexpr int64_t kNoGilBytes = 64 << 10;

// Spins without the GIL until ready() or timeout_ns passed (lamina_ring::spin).
template <typename Ready>
bool spin_until(Ready ready, int64_t timeout_ns, int64_t yield_every) {
  if (ready()) return true;
  if (timeout_ns <= 0) return false;
  return without_gil([&] { return spin(ready, timeout_ns, yield_every); });
}

// One end's writer of one direction: the ring, the limits and HEAD (this end's count, which it
// alone moves) live here, so a message costs one call that converts only its own fields.
class Writer {
 public:
  // kinds: the wire codes of the message kinds (others: kIneligible, the Python encoder refuses).
  Writer(int64_t ctl, int64_t data, int64_t cap, int64_t head, const std::vector<int64_t>& limits,
         const std::vector<int64_t>& kinds)
      : ring_(ctl, data, cap), head(head), lim_(limits), kinds_(kinds) {}

  void set_limits(const std::vector<int64_t>& limits) { lim_ = Limits(limits); }

  // send() on Python objects: an argument that does not convert (a wrong type, an integer out
  // of range) or a tensor torch will not describe is kIneligible (the Python encoder's business).
  int64_t send_any(py::handle kind, py::handle step_id, py::handle layer, py::handle reply_to,
                   py::handle meta, py::handle tensors) {
    try {
      return send(kind.cast<int64_t>(), step_id.cast<int64_t>(), layer.cast<int64_t>(),
                  reply_to.cast<int64_t>(), meta.cast<std::string>(),
                  tensors.cast<std::vector<at::Tensor>>());
    } catch (const py::cast_error&) {
      return kIneligible;
    } catch (const c10::Error&) {
      return kIneligible;
    }
  }

  // Writes the whole message at `head` when it fits in the free space and stores HEAD: kSent,
  // or kSentWake (the reader sleeps: ring its bell); else nothing written: kPeerClosed (the
  // reader closed), kNoRoom (not now), kIneligible (the Python encoder's business).
  int64_t send(int64_t kind, int64_t step_id, int64_t layer, int64_t reply_to,
               const std::string& meta, const std::vector<at::Tensor>& tensors) {
    const int64_t n = static_cast<int64_t>(tensors.size());
    if (ring_.load(kReaderClosed)) return kPeerClosed;
    if (n > lim_.tensors || static_cast<int64_t>(meta.size()) > lim_.meta_bytes ||
        std::find(kinds_.begin(), kinds_.end(), kind) == kinds_.end())
      return kIneligible;
    const int64_t pre = kHeaderBytes + n * kDescBytes + static_cast<int64_t>(meta.size());
    int64_t total = align(pre);
    Desc descs[kMaxDescs];
    if (n > kMaxDescs) return kIneligible;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& t = tensors[i];
      const DType* dt = by_type(t.scalar_type());
      if (!dt || t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous() ||
          t.is_conj() || t.is_neg() || t.dim() > lim_.ndim || t.dim() > kMaxNdim)
        return kIneligible;
      const int64_t nbytes = t.numel() * dt->size;
      if (nbytes > lim_.tensor_bytes) return kIneligible;
      Desc& d = descs[i];
      std::memset(&d, 0, sizeof(d));
      d.code = static_cast<uint8_t>(dt->code);
      d.ndim = static_cast<uint8_t>(t.dim());
      d.nbytes = static_cast<uint64_t>(nbytes);
      for (int64_t k = 0; k < t.dim(); ++k) d.shape[k] = t.size(k);
      total += align(nbytes);
    }
    if (total > lim_.message_bytes) return kIneligible;
    const uint64_t h = static_cast<uint64_t>(head);
    if (total > ring_.cap - static_cast<int64_t>(h - ring_.load(kTail))) return kNoRoom;
    Header hd;
    std::memcpy(hd.magic, kMagic, 4);
    hd.version = kVersion;
    hd.kind = static_cast<uint16_t>(kind);
    hd.step_id = step_id, hd.layer = layer, hd.reply_to = reply_to;
    hd.num_tensors = static_cast<uint32_t>(n);
    hd.meta_len = static_cast<uint32_t>(meta.size());
    hd.total = static_cast<uint64_t>(total);
    const void* src[kMaxDescs];  // taken with the GIL: data_ptr() may throw, the copy must not
    for (int64_t i = 0; i < n; ++i) src[i] = tensors[i].data_ptr();
    auto copy = [&] {  // no exception may leave it: without_gil restores no GIL on one
      uint64_t at = h;
      ring_.put(at, &hd, kHeaderBytes), at += kHeaderBytes;
      if (n) ring_.put(at, descs, n * kDescBytes), at += n * kDescBytes;
      if (!meta.empty()) ring_.put(at, meta.data(), static_cast<int64_t>(meta.size()));
      at = h + align(pre);
      for (int64_t i = 0; i < n; ++i) {  // padding bytes are left as they are (never read)
        const int64_t nbytes = static_cast<int64_t>(descs[i].nbytes);
        if (nbytes) ring_.put(at, src[i], nbytes);
        at += align(nbytes);
      }
      ring_.store(kHead, h + total);
      return true;
    };
    if (total > kNoGilBytes) {
      without_gil(copy);  // large copies let other threads run
    } else {
      copy();
    }
    head += total;
    return ring_.flag_after_fence(kReaderWaits) ? kSentWake : kSent;
  }

  int64_t head;  // bytes written since creation (the Python path moves it too)

 private:
  Ring ring_;
  Limits lim_;
  std::vector<int64_t> kinds_;
};

// One end's reader of one direction; holds TAIL (this end's count) like Writer holds HEAD, and
// builds the Message of a message without meta itself (one call per message).
class Reader {
 public:
  // kinds: wire code -> the kind object a Message holds (codes not in it: the slow path);
  // message: the Message class, called as message(kind, step_id, layer, reply_to, {}, tensors).
  Reader(int64_t ctl, int64_t data, int64_t cap, int64_t tail, const std::vector<int64_t>& limits,
         const py::dict& kinds, py::object message)
      : ring_(ctl, data, cap), tail(tail), lim_(limits), message_(std::move(message)),
        empty_(py::make_tuple(kEmpty, py::none())),
        stream_(py::make_tuple(kStream, py::none())) {
    for (auto item : kinds) {
      const int64_t code = item.first.cast<int64_t>();
      TORCH_CHECK(code >= 0 && code <= 0xFFFF, "kind codes are u16");
      if (code >= static_cast<int64_t>(kinds_.size())) kinds_.resize(code + 1);
      kinds_[code] = py::reinterpret_borrow<py::object>(item.second);
    }
  }

  // With nothing there yet, first spins (without the GIL) up to spin_ns for a byte to arrive
  // (yield_every > 0: sched_yield every that many rounds of 64 polls), then, with a data
  // doorbell fd (bell >= 0), sleeps on it up to sleep_ns (without the GIL, as
  // ring_memory.wait_for sleeps). Returns (status, payload):
  // (kEmpty, None); (kStream, None): not whole yet, malformed, unknown kind, over the limits:
  // the Python decoder's business; (kTaken, Message): a message without meta, committed (TAIL
  // stored past it), kTakenWake: the same and the writer sleeps waiting for space (ring its
  // bell); (kHeld, (kind, step_id, layer, reply_to, meta, tensors)): a message with meta, NOT
  // committed: commit() once its meta parsed, so a refused message stays in the ring.
  // Tensors are fresh (each owns its memory).
  py::object recv(int64_t spin_ns, int64_t yield_every, int bell, int64_t sleep_ns) {
    if (!arrive(spin_ns, yield_every, bell, sleep_ns)) return empty_;
    Header hd;
    Desc descs[kMaxDescs];
    const int64_t found = peek(hd, descs);
    if (found != kTaken) return found == kEmpty ? empty_ : stream_;
    std::string meta;
    std::vector<at::Tensor> out = read(hd, descs, meta);
    py::list tensors(out.size());
    for (size_t i = 0; i < out.size(); ++i) tensors[i] = py::cast(std::move(out[i]));
    if (hd.meta_len)
      return py::make_tuple(kHeld, py::make_tuple(static_cast<int64_t>(hd.kind), hd.step_id,
                                                  hd.layer, hd.reply_to, py::bytes(meta),
                                                  std::move(tensors)));
    py::object msg = message_(kinds_[hd.kind], hd.step_id, hd.layer, hd.reply_to, py::dict(),
                              std::move(tensors));
    const int64_t status = commit();  // only once the Message exists
    return py::make_tuple(status, std::move(msg));
  }

  // Whether a byte is there to read, waiting as recv() does when none is.
  bool arrive(int64_t spin_ns, int64_t yield_every, int bell, int64_t sleep_ns) {
    const uint64_t t = static_cast<uint64_t>(tail);
    if (spin_until([&] { return ring_.load(kHead) != t; }, spin_ns, yield_every)) return true;
    if (bell < 0 || sleep_ns <= 0) return false;
    return without_gil([&] { return sleep_until_data(ring_, tail, bell, sleep_ns); });
  }

  // The message at the tail, as this reader takes it: kTaken (whole, well formed, a known kind;
  // hd and descs filled), kEmpty (not a byte there) or kStream (the Python decoder's business).
  int64_t peek(Header& hd, Desc* descs) const {
    const uint64_t t = static_cast<uint64_t>(tail);
    const int64_t avail = static_cast<int64_t>(ring_.load(kHead) - t);
    if (avail <= 0) return kEmpty;
    // A message from the fast path appears whole (one HEAD store): a part of one was streamed
    // by the Python path (too big for the free space) and is decoded by it as it arrives.
    if (avail < kHeaderBytes) return kStream;
    ring_.get(t, &hd, kHeaderBytes);
    const int64_t total = static_cast<int64_t>(hd.total);
    if (std::memcmp(hd.magic, kMagic, 4) != 0 || hd.version != kVersion ||
        hd.num_tensors > lim_.tensors || hd.num_tensors > kMaxDescs ||
        hd.meta_len > lim_.meta_bytes || total > lim_.message_bytes || total < 0 ||
        total < align(kHeaderBytes + hd.num_tensors * kDescBytes + hd.meta_len) ||
        total > ring_.cap || avail < total || hd.kind >= kinds_.size() || !kinds_[hd.kind])
      return kStream;
    if (hd.num_tensors) ring_.get(t + kHeaderBytes, descs, hd.num_tensors * kDescBytes);
    return well_formed(hd, descs, lim_) ? kTaken : kStream;
  }

  // The peeked message's meta and tensors (fresh, one copy each); commit() then frees it.
  std::vector<at::Tensor> read(const Header& hd, const Desc* descs, std::string& meta) {
    const uint64_t t = static_cast<uint64_t>(tail);
    const int64_t total = static_cast<int64_t>(hd.total);
    meta.assign(hd.meta_len, '\0');
    std::vector<at::Tensor> out;
    out.reserve(hd.num_tensors);
    for (uint32_t i = 0; i < hd.num_tensors; ++i)  // allocated with the GIL (they may throw)
      out.push_back(at::empty(c10::IntArrayRef(descs[i].shape, descs[i].ndim),
                              at::TensorOptions().dtype(by_code(descs[i].code)->type)));
    auto copy = [&] {  // no exception may leave it: without_gil restores no GIL on one
      if (hd.meta_len) ring_.get(t + kHeaderBytes + hd.num_tensors * kDescBytes, meta.data(),
                                 hd.meta_len);
      uint64_t at = t + align(kHeaderBytes + hd.num_tensors * kDescBytes + hd.meta_len);
      for (uint32_t i = 0; i < hd.num_tensors; ++i) {
        const int64_t nbytes = static_cast<int64_t>(descs[i].nbytes);
        if (nbytes) ring_.get(at, out[i].data_ptr(), nbytes);
        at += align(nbytes);
      }
      return true;
    };
    if (total > kNoGilBytes) {
      without_gil(copy);
    } else {
      copy();
    }
    pending_ = tail + total;
    return out;
  }

  // The peeked message's tensors i with dst[i] != nullptr copied there (each dst[i] holds
  // descs[i].nbytes; the others skipped), without the GIL; commit() then frees it.
  void read_into(const Header& hd, const Desc* descs, void* const* dst) {
    const uint64_t t = static_cast<uint64_t>(tail);
    uint64_t at = t + align(kHeaderBytes + hd.num_tensors * kDescBytes + hd.meta_len);
    for (uint32_t i = 0; i < hd.num_tensors; ++i) {
      const int64_t nbytes = static_cast<int64_t>(descs[i].nbytes);
      if (dst[i] != nullptr && nbytes) ring_.get(at, dst[i], nbytes);
      at += align(nbytes);
    }
    pending_ = tail + static_cast<int64_t>(hd.total);
  }

  // Frees the last message read (stores TAIL past it): kTaken, or kTakenWake when the writer
  // sleeps waiting for space (the caller rings its doorbell).
  int64_t commit() {
    tail = pending_;
    ring_.store(kTail, static_cast<uint64_t>(tail));
    return ring_.flag_after_fence(kWriterWaits) ? kTakenWake : kTaken;
  }

  int64_t tail;  // bytes consumed since creation (the Python path moves it too)

 private:
  Ring ring_;
  Limits lim_;
  py::object message_;              // the Message class
  py::object empty_, stream_;       // the two results without a payload
  std::vector<py::object> kinds_;   // code -> kind object (empty: not a kind; the slow path)
  int64_t pending_ = 0;             // the tail past the last message read
};

// A request and its reply in one call (RingChannel.exchange, bound to one channel end with its
// doorbells up to sleep_ns): sends a message without meta as Writer::send does and, once it is
// out, waits as Reader::recv does (spin_ns, yield_every; then, with yield_every == 0, a sleep on
// rx_bell of at most sleep_ns) for the next message, which is taken only if it is the reply:
// kind reply_kind, the same step and layer, no meta. Doorbells are rung here: tx_bell when the
// peer sleeps on its data, space_bell when it waits for space. Returns (status, sent_ns,
// tensors or None): kNoRoom / kIneligible / kPeerClosed: nothing sent (the caller sends the
// Python way); kEmpty: sent, nothing arrived within the wait; kStream: sent, the next message
// is recv()'s; kTaken: sent, and the reply's tensors (fresh; its bytes freed). sent_ns: when
// the message was in the ring (time.perf_counter_ns's clock).
//
// In two halves, for callers that work between them (RingExchange): send_request, then
// await_reply, which leaves a reply peeked (kTaken) for the caller to read and commit().
int64_t send_request(Writer& w, int tx_bell, int64_t step_id, int64_t layer, int64_t reply_to,
                     const std::vector<at::Tensor>& tensors, int64_t kind, int64_t* sent_ns) {
  int64_t sent = kIneligible;
  try {
    sent = w.send(kind, step_id, layer, reply_to, std::string(), tensors);
  } catch (const c10::Error&) {
  }
  *sent_ns = 0;
  if (sent != kSent && sent != kSentWake) return sent;
  *sent_ns = now_ns();
  if (sent == kSentWake) ring_bell(tx_bell);
  return kSent;
}

int64_t await_reply(Reader& r, int rx_bell, int64_t sleep_ns, int space_bell, int64_t step_id,
                    int64_t layer, int64_t reply_kind, int64_t spin_ns, int64_t yield_every,
                    int64_t skip_kind, Header& hd, Desc* descs) {
  for (;;) {
    if (!r.arrive(spin_ns, yield_every, yield_every > 0 ? -1 : rx_bell, sleep_ns)) return kEmpty;
    if (r.peek(hd, descs) != kTaken) return kStream;
    if (hd.kind == skip_kind && hd.num_tensors == 0 && hd.meta_len == 0) {  // dropped
      std::string meta;
      r.read(hd, descs, meta);
      if (r.commit() == kTakenWake) ring_bell(space_bell);
      continue;
    }
    if (hd.kind != reply_kind || hd.step_id != step_id || hd.layer != layer || hd.meta_len)
      return kStream;
    return kTaken;
  }
}

int64_t exchange_core(Writer& w, Reader& r, int tx_bell, int rx_bell, int64_t sleep_ns,
                      int space_bell, int64_t step_id, int64_t layer, int64_t reply_to,
                      const std::vector<at::Tensor>& tensors, int64_t kind, int64_t reply_kind,
                      int64_t spin_ns, int64_t yield_every, int64_t* sent_ns,
                      std::vector<at::Tensor>* got) {
  const int64_t sent = send_request(w, tx_bell, step_id, layer, reply_to, tensors, kind, sent_ns);
  if (sent != kSent) return sent;
  Header hd;
  Desc descs[kMaxDescs];
  const int64_t status = await_reply(r, rx_bell, sleep_ns, space_bell, step_id, layer, reply_kind,
                                     spin_ns, yield_every, -1, hd, descs);
  if (status != kTaken) return status;
  std::string meta;
  *got = r.read(hd, descs, meta);
  if (r.commit() == kTakenWake) ring_bell(space_bell);
  return kTaken;
}

py::tuple exchange(Writer& w, Reader& r, int tx_bell, int rx_bell, int64_t sleep_ns,
                   int space_bell, int64_t step_id, int64_t layer, int64_t reply_to,
                   py::handle tensors, int64_t kind, int64_t reply_kind, int64_t spin_ns,
                   int64_t yield_every) {
  std::vector<at::Tensor> ts, out;
  try {
    ts = tensors.cast<std::vector<at::Tensor>>();
  } catch (const py::cast_error&) {
    return py::make_tuple(kIneligible, 0, py::none());
  }
  int64_t sent_ns;
  const int64_t status = exchange_core(w, r, tx_bell, rx_bell, sleep_ns, space_bell, step_id,
                                       layer, reply_to, ts, kind, reply_kind, spin_ns,
                                       yield_every, &sent_ns, &out);
  if (status != kTaken) return py::make_tuple(status, sent_ns, py::none());
  py::list got(out.size());
  for (size_t i = 0; i < out.size(); ++i) got[i] = py::cast(std::move(out[i]));
  return py::make_tuple(kTaken, sent_ns, std::move(got));
}

// exchange() of ATTENDs as an ExchangeFn (lamina/csrc/exchange.h) for a whole-step program in a
// replica process: one channel end's writer and reader (kept alive here), doorbells and
// waits as RingChannel.exchange binds them, the replica's reply_to; a message of skip_kind
// without tensors or meta that comes first is taken and dropped. The caller holds the
// channel's send and receive locks while a step uses it (RingChannel.native_exchange).
class RingExchange {
 public:
  RingExchange(py::object writer, py::object reader, int tx_bell, int rx_bell, int64_t sleep_ns,
               int space_bell, int64_t reply_to, int64_t kind, int64_t reply_kind,
               int64_t spin_ns, int64_t yield_every, int64_t skip_kind)
      : writer_(std::move(writer)), reader_(std::move(reader)),
        w_(writer_.cast<Writer*>()), r_(reader_.cast<Reader*>()), tx_bell_(tx_bell),
        rx_bell_(rx_bell), sleep_ns_(sleep_ns), space_bell_(space_bell), reply_to_(reply_to),
        kind_(kind), reply_kind_(reply_kind), spin_ns_(spin_ns), yield_every_(yield_every),
        skip_kind_(skip_kind) {}

  // The RESULT's tensors are o, lse and the node's (start, end) ns (memnode's write_result).
  // While the node attends, after the caller's idle work, o's memory is allocated: the reply
  // lands there and in stamps, without a fresh tensor per RESULT on the critical path.
  static int fn(void* self, int64_t step_id, int64_t layer, const at::Tensor& q,
                const at::Tensor& k, const at::Tensor& v, at::Tensor* o,
                const ExchangeExtra& extra) {
    auto* x = static_cast<RingExchange*>(self);
    int64_t* st = extra.stamps;
    int64_t sent_ns;
    if (send_request(*x->w_, x->tx_bell_, step_id, layer, x->reply_to_, {q, k, v}, x->kind_,
                     &sent_ns) != kSent)
      return kDeclined;
    if (st != nullptr) st[0] = sent_ns;
    if (extra.idle != nullptr) extra.idle(extra.idle_arg);
    at::Tensor out = at::empty(q.sizes(), q.options());
    Header hd;
    Desc descs[kMaxDescs];
    if (await_reply(*x->r_, x->rx_bell_, x->sleep_ns_, x->space_bell_, step_id, layer,
                    x->reply_kind_, x->spin_ns_, x->yield_every_, x->skip_kind_, hd,
                    descs) != kTaken)
      return kSentOnly;
    const Desc& d = descs[0];
    const int64_t span_code = by_type(at::kLong)->code;
    if (hd.num_tensors != 3 || by_code(d.code)->type != q.scalar_type() ||
        !std::equal(q.sizes().begin(), q.sizes().end(), d.shape, d.shape + d.ndim) ||
        descs[2].code != span_code ||
        descs[2].nbytes != 2 * sizeof(int64_t))
      return kSentOnly;  // not a RESULT of this ATTEND: recv()'s, which raises on it
    int64_t span[2];
    void* const dst[3] = {out.data_ptr(), nullptr, span};
    x->r_->read_into(hd, descs, dst);
    if (x->r_->commit() == kTakenWake) ring_bell(x->space_bell_);
    if (st != nullptr) st[1] = span[0], st[2] = span[1];
    *o = std::move(out);
    return kAnswered;
  }

 private:
  py::object writer_, reader_;
  Writer* w_;
  Reader* r_;
  int tx_bell_, rx_bell_;
  int64_t sleep_ns_;
  int space_bell_;
  int64_t reply_to_, kind_, reply_kind_, spin_ns_, yield_every_, skip_kind_;
};

// Spins (without the GIL) until ctl[word] - base >= need (signed), for at most timeout_ns;
// returns whether it came true. yield_every > 0: sched_yield every that many polls, so a
// runnable thread of this core gets its turn.
bool ring_wait(int64_t ctl_addr, int64_t word, int64_t base, int64_t need, int64_t timeout_ns,
               int64_t yield_every) {
  const Ring r(ctl_addr, 0, 1);
  return spin_until(
      [&] { return static_cast<int64_t>(r.load(word) - static_cast<uint64_t>(base)) >= need; },
      timeout_ns, yield_every);
}

// A wait set's two words (lamina/transport/waitset.py): kPosted counts messages other threads
// handed to the waiter, kSleeping says the waiter sleeps in poll() (and wants wake_fd written).
constexpr int kPosted = 0, kSleeping = 1;

// A producer thread handed the waiter something: count it, and wake the waiter if it sleeps.
void post(int64_t words_addr, int64_t wake_fd) {
  auto* w = reinterpret_cast<int64_t*>(words_addr);
  __atomic_add_fetch(w + kPosted, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(w + kSleeping, __ATOMIC_SEQ_CST)) {
    const uint64_t one = 1;
    (void)!write(static_cast<int>(wake_fd), &one, sizeof(one));
  }
}

// Waits without the GIL for the first of several rings to hold unread bytes (each ring: its
// ctl address, the address of its reader's tail, its data doorbell's fd or -1) or for the posted
// count to differ from `seen`: polls spin_ns (yield_every as spin), then, for at most
// timeout_ns, raises every ring's reader-waits flag and the sleeping word, looks again, and
// sleeps in poll() on the doorbells and wake_fd. Returns the index of a ring with data, -1 when
// something was posted, -2 when the time passed with neither (or a doorbell rang for nothing:
// the caller checks the peers then, as after a receive's wake interval).
int64_t wait_any(const std::vector<std::tuple<int64_t, int64_t, int64_t>>& rings,
                 int64_t words_addr, int64_t seen, int64_t wake_fd, int64_t spin_ns,
                 int64_t yield_every, int64_t timeout_ns) {
  std::vector<Ring> rs;
  std::vector<const int64_t*> tails;
  std::vector<pollfd> fds;
  for (const auto& [ctl, tail, bell] : rings) {
    rs.emplace_back(ctl, 0, 1);
    tails.push_back(reinterpret_cast<const int64_t*>(tail));
    if (bell >= 0) fds.push_back(pollfd{static_cast<int>(bell), POLLIN, 0});
  }
  auto* words = reinterpret_cast<int64_t*>(words_addr);
  int64_t found = -2;
  auto ready = [&] {
    for (size_t i = 0; i < rs.size(); ++i) {
      if (rs[i].load(kHead) != static_cast<uint64_t>(*tails[i])) {
        found = static_cast<int64_t>(i);
        return true;
      }
    }
    if (__atomic_load_n(words + kPosted, __ATOMIC_ACQUIRE) != seen) {
      found = -1;
      return true;
    }
    return false;
  };
  if (ready()) return found;
  return without_gil([&]() -> int64_t {
    if (spin(ready, spin_ns, yield_every) || timeout_ns <= 0) return found;
    for (const Ring& r : rs) r.store(kReaderWaits, 1);
    __atomic_store_n(words + kSleeping, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!ready()) {
      fds.push_back(pollfd{static_cast<int>(wake_fd), POLLIN, 0});
      const int ms = static_cast<int>(std::min<int64_t>(timeout_ns / 1000000 + 1, 1000));
      if (poll(fds.data(), fds.size(), ms) > 0)
        for (const pollfd& p : fds)
          if (p.revents & POLLIN) drain(p.fd);
      ready();
    }
    __atomic_store_n(words + kSleeping, 0, __ATOMIC_SEQ_CST);
    for (const Ring& r : rs) r.store(kReaderWaits, 0);
    return found;
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lamina shared-memory ring fast path (see lamina/transport/shm_fast.py)";
  py::class_<Writer>(m, "Writer")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, const std::vector<int64_t>&,
                    const std::vector<int64_t>&>(),
           py::arg("ctl"), py::arg("data"), py::arg("cap"), py::arg("head"), py::arg("limits"),
           py::arg("kinds"))
      .def("send", &Writer::send_any,
           "send(kind, step_id, layer, reply_to, meta, tensors) -> SENT | SENT_WAKE (the reader "
           "sleeps) | NO_ROOM | INELIGIBLE | PEER_CLOSED")
      .def("set_limits", &Writer::set_limits)
      .def_readwrite("head", &Writer::head)
      .def_property_readonly(
          "head_addr", [](Writer& w) { return reinterpret_cast<int64_t>(&w.head); },
          "address of head, for a native writer that holds the channel's send lock");
  py::class_<Reader>(m, "Reader")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, const std::vector<int64_t>&,
                    const py::dict&, py::object>(),
           py::arg("ctl"), py::arg("data"), py::arg("cap"), py::arg("tail"), py::arg("limits"),
           py::arg("kinds"), py::arg("message"))
      .def("recv", &Reader::recv, py::arg("spin_ns"), py::arg("yield_every"),
           py::arg("bell") = -1, py::arg("sleep_ns") = 0,
           "recv(spin_ns, yield_every, bell=-1, sleep_ns=0) -> (status, payload): (EMPTY, None) | "
           "(STREAM, None) | "
           "(TAKEN, Message) | (TAKEN_WAKE, Message): the writer sleeps | (HELD, (kind, "
           "step_id, layer, reply_to, meta, tensors)): commit() pending")
      .def("commit", &Reader::commit, "commit() -> TAKEN | TAKEN_WAKE (the writer sleeps)")
      .def_readwrite("tail", &Reader::tail)
      .def_property_readonly(
          "tail_addr", [](Reader& r) { return reinterpret_cast<int64_t>(&r.tail); },
          "address of tail, for a native reader that holds the channel's receive lock");
  m.def("exchange", &exchange,
        "exchange(writer, reader, tx_bell, rx_bell, sleep_ns, space_bell, step_id, layer, "
        "reply_to, tensors, kind, reply_kind, spin_ns, yield_every) -> (status, sent_ns, "
        "tensors | None): NO_ROOM | INELIGIBLE | PEER_CLOSED (nothing sent) | EMPTY | STREAM | "
        "TAKEN");
  py::class_<RingExchange>(m, "RingExchange")
      .def(py::init<py::object, py::object, int, int, int64_t, int, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t>(),
           py::arg("writer"), py::arg("reader"), py::arg("tx_bell"), py::arg("rx_bell"),
           py::arg("sleep_ns"), py::arg("space_bell"), py::arg("reply_to"), py::arg("kind"),
           py::arg("reply_kind"), py::arg("spin_ns"), py::arg("yield_every"),
           py::arg("skip_kind") = -1)
      .def("handle",
           [](RingExchange& x) { return py::capsule(static_cast<void*>(&x), "lamina.ring"); },
           "handle() -> this object as exchange_fn's self (valid while it lives)");
  m.attr("exchange_fn") = py::capsule(reinterpret_cast<void*>(&RingExchange::fn),
                                      kExchangeCapsule);
  m.def("ring_wait", &ring_wait,
        "ring_wait(ctl, word, base, need, timeout_ns, yield_every) -> ctl[word] - base >= need");
  m.def("post", &post, "post(words_addr, wake_fd): count one posted item; wake a sleeping waiter");
  m.def("wait_any", &wait_any,
        "wait_any([(ctl, tail_addr, bell_fd)], words_addr, seen, wake_fd, spin_ns, yield_every, "
        "timeout_ns) -> index of a ring with data | -1 (posted) | -2 (time passed)");
  m.def("layout", &lamina_ring::layout, "layout() -> dict: the layout this module assumes");
  for (size_t s = 0; s < std::size(kStatusNames); ++s) m.attr(kStatusNames[s]) = int64_t(s);
}
