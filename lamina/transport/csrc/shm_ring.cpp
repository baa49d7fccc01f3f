// The shared-memory ring's fast path (lamina/transport/shm_fast.py): a whole wire message
// written into, or read out of, one direction's byte ring in one call, and a wait on a
// control word without the GIL.
//
// Ring (lamina/transport/shm_ring.py): a control block of u64 words (HEAD at word 0, TAIL at
// word 8, R_WAIT at 16, W_WAIT at 24) and `cap` data bytes; HEAD/TAIL count bytes since
// creation, position = count % cap. The writer owns HEAD, the reader TAIL. Stores of a count
// are releases, loads of the other side's count acquires (x86: plain moves, ordered by the
// compiler barrier of the atomic builtins); the waiting flags are read after a full fence.
//
// Wire format (lamina/transport/wire.py, the source of truth): a 48-byte header "<4sHHqqqIIQ",
// 80-byte descriptors "<BB6xQ8q", meta, padding to 64, then each tensor's bytes padded to 64.
// This file accepts only messages that are whole and well formed under the given limits;
// anything else is left in the ring for the Python decoder, which raises the precise error.
#include <torch/extension.h>

#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kHead = 0, kTail = 8, kReaderWaits = 16, kWriterWaits = 24;
constexpr int64_t kHeaderBytes = 48, kDescBytes = 80, kAlign = 64, kMaxNdim = 8;
constexpr char kMagic[4] = {'L', 'M', 'N', 'A'};
constexpr uint16_t kVersion = 1;

// Wire dtype codes (wire._DTYPE_CODES).
struct DType {
  int code;
  at::ScalarType type;
  int64_t size;
};
constexpr DType kDTypes[] = {
    {1, at::kFloat, 4}, {2, at::kHalf, 2},  {3, at::kBFloat16, 2}, {4, at::kLong, 8},
    {5, at::kInt, 4},   {6, at::kByte, 1},  {7, at::kBool, 1},     {8, at::kDouble, 8},
    {9, at::kShort, 2}, {10, at::kChar, 1},
};

const DType* by_type(at::ScalarType t) {
  for (const DType& d : kDTypes)
    if (d.type == t) return &d;
  return nullptr;
}
const DType* by_code(int code) {
  for (const DType& d : kDTypes)
    if (d.code == code) return &d;
  return nullptr;
}

inline int64_t align(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// WireLimits as passed from Python: (max_tensors, max_ndim, max_tensor_bytes,
// max_message_bytes, max_meta_bytes).
struct Limits {
  int64_t tensors, ndim, tensor_bytes, message_bytes, meta_bytes;
  explicit Limits(const std::vector<int64_t>& v) {
    TORCH_CHECK(v.size() == 5, "limits: (max_tensors, max_ndim, max_tensor_bytes, "
                               "max_message_bytes, max_meta_bytes)");
    tensors = v[0], ndim = v[1], tensor_bytes = v[2], message_bytes = v[3], meta_bytes = v[4];
  }
};

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

#pragma pack(push, 1)
struct Header {
  char magic[4];
  uint16_t version, kind;
  int64_t step_id, layer, reply_to;
  uint32_t num_tensors, meta_len;
  uint64_t total;
};
struct Desc {
  uint8_t code, ndim;
  uint8_t pad[6];
  uint64_t nbytes;
  int64_t shape[kMaxNdim];
};
#pragma pack(pop)
static_assert(sizeof(Header) == kHeaderBytes && sizeof(Desc) == kDescBytes, "wire layout");

// Messages up to this many bytes are copied with the GIL held: releasing and re-taking it
// costs more than the copy (a 4 KB message is ~100 ns of memcpy).
constexpr int64_t kNoGilBytes = 64 << 10;

// Spins without the GIL until ready() or timeout_ns passed; yield_every > 0: sched_yield every
// that many rounds of 64 polls, so a runnable thread of this core gets its turn.
template <typename Ready>
bool spin_until(Ready ready, int64_t timeout_ns, int64_t yield_every) {
  if (ready()) return true;
  if (timeout_ns <= 0) return false;
  py::gil_scoped_release nogil;
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

// Status codes of send / recv (besides a new count).
constexpr int64_t kNoRoom = -1;      // send: the message does not fit in the free space now
constexpr int64_t kIneligible = -2;  // send: let the Python encoder handle (or refuse) it
constexpr int64_t kEmpty = 0;     // recv: no byte of a message yet
constexpr int64_t kSlowPath = 2;  // recv: not whole yet, malformed, over the limits, too big

// send(ctl, data, cap, head, kind, step_id, layer, reply_to, meta, tensors, limits)
//   -> (new_head | kNoRoom | kIneligible, reader_waits)
// Writes the whole message at `head` when it fits in the free space; stores HEAD; reports
// whether the reader sleeps (the caller rings its doorbell).
std::tuple<int64_t, bool> ring_send(int64_t ctl_addr, int64_t data_addr, int64_t cap,
                                    int64_t head, int64_t kind, int64_t step_id, int64_t layer,
                                    int64_t reply_to, const std::string& meta,
                                    const std::vector<at::Tensor>& tensors,
                                    const std::vector<int64_t>& limits_in) {
  const Limits lim(limits_in);
  const int64_t n = static_cast<int64_t>(tensors.size());
  if (n > lim.tensors || static_cast<int64_t>(meta.size()) > lim.meta_bytes || kind < 0 ||
      kind > 0xFFFF)
    return {kIneligible, false};
  const int64_t pre = kHeaderBytes + n * kDescBytes + static_cast<int64_t>(meta.size());
  int64_t total = align(pre);
  std::vector<Desc> descs(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    const DType* dt = by_type(t.scalar_type());
    if (!dt || !t.device().is_cpu() || !t.is_contiguous() || t.is_conj() || t.is_neg() ||
        t.dim() > lim.ndim || t.dim() > kMaxNdim || t.layout() != at::kStrided)
      return {kIneligible, false};
    const int64_t nbytes = t.numel() * dt->size;
    if (nbytes > lim.tensor_bytes) return {kIneligible, false};
    Desc& d = descs[i];
    std::memset(&d, 0, sizeof(d));
    d.code = static_cast<uint8_t>(dt->code);
    d.ndim = static_cast<uint8_t>(t.dim());
    d.nbytes = static_cast<uint64_t>(nbytes);
    for (int64_t k = 0; k < t.dim(); ++k) d.shape[k] = t.size(k);
    total += align(nbytes);
  }
  if (total > lim.message_bytes) return {kIneligible, false};
  const Ring r(ctl_addr, data_addr, cap);
  const uint64_t h = static_cast<uint64_t>(head);
  if (total > cap - static_cast<int64_t>(h - r.load(kTail))) return {kNoRoom, false};
  Header hd;
  std::memcpy(hd.magic, kMagic, 4);
  hd.version = kVersion;
  hd.kind = static_cast<uint16_t>(kind);
  hd.step_id = step_id, hd.layer = layer, hd.reply_to = reply_to;
  hd.num_tensors = static_cast<uint32_t>(n);
  hd.meta_len = static_cast<uint32_t>(meta.size());
  hd.total = static_cast<uint64_t>(total);
  {
    std::optional<py::gil_scoped_release> nogil;  // large copies let other threads run
    if (total > kNoGilBytes) nogil.emplace();
    uint64_t at = h;
    r.put(at, &hd, kHeaderBytes), at += kHeaderBytes;
    if (n) r.put(at, descs.data(), n * kDescBytes), at += n * kDescBytes;
    if (!meta.empty()) r.put(at, meta.data(), static_cast<int64_t>(meta.size()));
    at = h + align(pre);
    for (int64_t i = 0; i < n; ++i) {  // padding bytes are left as they are (never read)
      const int64_t nbytes = static_cast<int64_t>(descs[i].nbytes);
      if (nbytes) r.put(at, tensors[i].data_ptr(), nbytes);
      at += align(nbytes);
    }
    r.store(kHead, h + total);
  }
  return {head + total, r.flag_after_fence(kReaderWaits)};
}

// Checks the header and descriptors at `tail` (already copied to hd / descs) as
// wire.unpack_header / unpack_preamble do; false: leave the message to the Python decoder.
bool well_formed(const Header& hd, const std::vector<Desc>& descs, const Limits& lim) {
  if (std::memcmp(hd.magic, kMagic, 4) != 0 || hd.version != kVersion) return false;
  int64_t off = align(kHeaderBytes + hd.num_tensors * kDescBytes + hd.meta_len);
  for (const Desc& d : descs) {
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

// recv(ctl, data, cap, tail, limits, spin_ns, yield_every) -> (status | new_tail, total, kind,
// step_id, layer, reply_to, meta, tensors). With nothing there yet it first spins (without the
// GIL) up to spin_ns for a byte to arrive. status kEmpty / kSlowPath; otherwise the first field is the
// tail past the message (> kSlowPath), whose tensors are fresh
// (each owns its memory). TAIL is NOT stored: the caller commits with ring_commit once it
// accepted the message (its meta parses), so a refused message is still in the ring.
py::tuple ring_recv(int64_t ctl_addr, int64_t data_addr, int64_t cap, int64_t tail,
                    const std::vector<int64_t>& limits_in, int64_t spin_ns, int64_t yield_every) {
  const Limits lim(limits_in);
  const Ring r(ctl_addr, data_addr, cap);
  const uint64_t t = static_cast<uint64_t>(tail);
  // the two statuses, built once (never freed: they must outlive the interpreter's teardown)
  static const py::tuple* empty = new py::tuple(py::make_tuple(kEmpty, 0, 0, 0, 0, 0, py::bytes(), py::list()));
  static const py::tuple* slow = new py::tuple(py::make_tuple(kSlowPath, 0, 0, 0, 0, 0, py::bytes(), py::list()));
  if (!spin_until([&] { return r.load(kHead) != t; }, spin_ns, yield_every)) return *empty;
  const int64_t avail = static_cast<int64_t>(r.load(kHead) - t);
  if (avail <= 0) return *empty;
  // A message from the fast path appears whole (one HEAD store): a part of one was streamed
  // by the Python path (too big for the free space) and is decoded by it as it arrives.
  if (avail < kHeaderBytes) return *slow;
  Header hd;
  r.get(t, &hd, kHeaderBytes);
  if (std::memcmp(hd.magic, kMagic, 4) != 0 || hd.version != kVersion ||
      hd.num_tensors > lim.tensors || hd.meta_len > lim.meta_bytes ||
      static_cast<int64_t>(hd.total) > lim.message_bytes || static_cast<int64_t>(hd.total) < 0 ||
      static_cast<int64_t>(hd.total) < align(kHeaderBytes + hd.num_tensors * kDescBytes +
                                             hd.meta_len) ||
      static_cast<int64_t>(hd.total) > cap)
    return *slow;
  const int64_t total = static_cast<int64_t>(hd.total);
  if (avail < total) return *slow;
  std::vector<Desc> descs(hd.num_tensors);
  if (hd.num_tensors) r.get(t + kHeaderBytes, descs.data(), hd.num_tensors * kDescBytes);
  if (!well_formed(hd, descs, lim)) return *slow;
  std::string meta(hd.meta_len, '\0');
  std::vector<at::Tensor> out;
  out.reserve(descs.size());
  {
    std::optional<py::gil_scoped_release> nogil;
    if (total > kNoGilBytes) nogil.emplace();
    if (hd.meta_len) r.get(t + kHeaderBytes + hd.num_tensors * kDescBytes, meta.data(),
                           hd.meta_len);
    uint64_t at = t + align(kHeaderBytes + hd.num_tensors * kDescBytes + hd.meta_len);
    for (const Desc& d : descs) {
      std::vector<int64_t> shape(d.shape, d.shape + d.ndim);
      at::Tensor x = at::empty(shape, at::TensorOptions().dtype(by_code(d.code)->type));
      if (d.nbytes) r.get(at, x.data_ptr(), static_cast<int64_t>(d.nbytes));
      at += align(static_cast<int64_t>(d.nbytes));
      out.push_back(std::move(x));
    }
  }
  py::list tensors(out.size());
  for (size_t i = 0; i < out.size(); ++i) tensors[i] = py::cast(std::move(out[i]));
  return py::make_tuple(tail + total, total, static_cast<int64_t>(hd.kind), hd.step_id, hd.layer,
                        hd.reply_to, py::bytes(meta), tensors);
}

// Stores TAIL = tail (the reader consumed up to it); returns whether the writer sleeps
// waiting for space (the caller rings its doorbell).
bool ring_commit(int64_t ctl_addr, int64_t tail) {
  const Ring r(ctl_addr, 0, 1);
  r.store(kTail, static_cast<uint64_t>(tail));
  return r.flag_after_fence(kWriterWaits);
}

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lamina shared-memory ring fast path (see lamina/transport/shm_fast.py)";
  m.def("ring_send", &ring_send,
        "ring_send(ctl, data, cap, head, kind, step_id, layer, reply_to, meta, tensors, limits) "
        "-> (new_head | -1 no room | -2 ineligible, reader_waits)");
  m.def("ring_recv", &ring_recv,
        "ring_recv(ctl, data, cap, tail, limits, spin_ns, yield_every) -> (new_tail | 0 empty | "
        "2 slow path, total, kind, step_id, layer, reply_to, meta, tensors)",
        py::arg("ctl"), py::arg("data"), py::arg("cap"), py::arg("tail"), py::arg("limits"),
        py::arg("spin_ns") = 0, py::arg("yield_every") = 0);
  m.def("ring_commit", &ring_commit, "ring_commit(ctl, tail) -> writer_waits");
  m.def("ring_wait", &ring_wait,
        "ring_wait(ctl, word, base, need, timeout_ns, yield_every) -> ctl[word] - base >= need");
}
