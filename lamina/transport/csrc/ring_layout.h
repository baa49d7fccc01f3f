// The wire and ring layout the shared-memory fast path (shm_ring.cpp) assumes, its status
// codes, and layout(), which exports the layout as data.
//
// Python defines every value here: the control words in lamina/transport/ring_memory.py, the
// wire format in lamina/transport/wire.py, the status codes in lamina/transport/shm_fast.py.
// This file keeps its own copy, and shm_fast.load() compares layout() and the module's status
// attributes with Python's definitions: a module that differs in any field is refused.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

namespace lamina_ring {

namespace py = pybind11;

// Control words (u64 indices into the control block; ring_memory.HEAD, ...).
constexpr int64_t kHead = 0, kTail = 8, kReaderWaits = 16, kWriterWaits = 24, kWriterClosed = 32,
                  kReaderClosed = 40;
constexpr int64_t kHeaderBytes = 48, kDescBytes = 80, kAlign = 64, kMaxNdim = 8;
constexpr char kMagic[4] = {'L', 'M', 'N', 'A'};
constexpr uint16_t kVersion = 1;

// Wire dtype codes (wire.DTYPE_CODES).
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

inline const DType* by_type(at::ScalarType t) {
  for (const DType& d : kDTypes)
    if (d.type == t) return &d;
  return nullptr;
}
inline const DType* by_code(int code) {
  for (const DType& d : kDTypes)
    if (d.code == code) return &d;
  return nullptr;
}

inline int64_t align(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// WireLimits as passed from Python, in this order (wire.LIMIT_FIELDS).
constexpr const char* kLimitFields[] = {"max_tensors", "max_ndim", "max_tensor_bytes",
                                        "max_message_bytes", "max_meta_bytes"};
struct Limits {
  int64_t tensors, ndim, tensor_bytes, message_bytes, meta_bytes;
  explicit Limits(const std::vector<int64_t>& v) {
    TORCH_CHECK(v.size() == 5, "limits: (max_tensors, max_ndim, max_tensor_bytes, "
                               "max_message_bytes, max_meta_bytes)");
    tensors = v[0], ndim = v[1], tensor_bytes = v[2], message_bytes = v[3], meta_bytes = v[4];
  }
};

// The header (wire.HEADER_FORMAT) and a tensor descriptor (wire.DESC_FORMAT).
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

// Status codes, exported as module attributes named as in kStatusNames (shm_fast.SENT, ...).
// Writer::send: kSent (written), kSentWake (written; the reader sleeps: ring its bell), or
// nothing written: kNoRoom (not now), kIneligible (the Python encoder's business), kPeerClosed.
// Reader::recv: kEmpty (nothing yet), kStream (the Python stream decoder's business), kTaken
// (a Message, committed), kTakenWake (the same; the writer sleeps: ring its bell), kHeld (a
// message's fields, not committed); Reader::commit: kTaken or kTakenWake.
constexpr int64_t kSent = 0, kSentWake = 1, kNoRoom = 2, kIneligible = 3, kPeerClosed = 4;
constexpr int64_t kEmpty = 5, kStream = 6, kTaken = 7, kTakenWake = 8, kHeld = 9;
constexpr const char* kStatusNames[] = {"SENT",  "SENT_WAKE", "NO_ROOM", "INELIGIBLE",
                                        "PEER_CLOSED", "EMPTY", "STREAM", "TAKEN",
                                        "TAKEN_WAKE", "HELD"};
static_assert(std::size(kStatusNames) == kHeld + 1, "a name per status, in order");

// A struct member's kind: "s" a char array, else its (element) type's: "f" floating point,
// "i" signed or "u" unsigned integer.
template <typename M>
const char* kind_of() {
  using E = std::remove_all_extents_t<M>;
  if constexpr (std::is_same_v<E, char>) return "s";
  if constexpr (std::is_floating_point_v<E>) return "f";
  return std::is_signed_v<E> ? "i" : "u";
}

// The layout above as data: {"header": (size, rows), "descriptor": (size, rows), "magic",
// "version", "align", "max_ndim", "dtypes": {code: (torch dtype, item size)}, "ctl_words":
// {name: u64 index}, "limits": (field names in order)}. A row is (name, byte offset, size,
// kind) of one member (an array is one row; Desc::pad is padding, not a member).
inline py::dict layout() {
  py::dict out, dtypes, ctl;
  py::list header, desc, limits;
#define LAMINA_FIELD(rows, S, f) \
  rows.append(py::make_tuple(#f, offsetof(S, f), sizeof(S::f), kind_of<decltype(S::f)>()))
  LAMINA_FIELD(header, Header, magic);
  LAMINA_FIELD(header, Header, version);
  LAMINA_FIELD(header, Header, kind);
  LAMINA_FIELD(header, Header, step_id);
  LAMINA_FIELD(header, Header, layer);
  LAMINA_FIELD(header, Header, reply_to);
  LAMINA_FIELD(header, Header, num_tensors);
  LAMINA_FIELD(header, Header, meta_len);
  LAMINA_FIELD(header, Header, total);
  LAMINA_FIELD(desc, Desc, code);
  LAMINA_FIELD(desc, Desc, ndim);
  LAMINA_FIELD(desc, Desc, nbytes);
  LAMINA_FIELD(desc, Desc, shape);
#undef LAMINA_FIELD
  out["header"] = py::make_tuple(sizeof(Header), header);
  out["descriptor"] = py::make_tuple(sizeof(Desc), desc);
  out["magic"] = py::bytes(kMagic, sizeof(kMagic));
  out["version"] = kVersion;
  out["align"] = kAlign;
  out["max_ndim"] = kMaxNdim;
  for (const DType& d : kDTypes) dtypes[py::int_(d.code)] = py::make_tuple(d.type, d.size);
  out["dtypes"] = dtypes;
  ctl["HEAD"] = kHead, ctl["TAIL"] = kTail, ctl["R_WAIT"] = kReaderWaits;
  ctl["W_WAIT"] = kWriterWaits, ctl["W_CLOSED"] = kWriterClosed, ctl["R_CLOSED"] = kReaderClosed;
  out["ctl_words"] = ctl;
  for (const char* name : kLimitFields) limits.append(name);
  out["limits"] = py::tuple(limits);
  return out;
}

}  // namespace lamina_ring
