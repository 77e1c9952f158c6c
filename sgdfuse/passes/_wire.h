// Reading protobuf's wire format, shared by sgdfuse's native scanners (_scan.cc, the node table; _vscan.cc,
// the value infos): every read is checked against the end of the buffer, and malformed bytes stop the scan
// with the first failure's reason and offset, never a read past the end. Semantics are protobuf's (upb):
// varints of at most ten bytes (bits past 64 dropped), field numbers from 1, wire types 0 to 5, groups
// skipped to their matching end.
#pragma once

#include <cstdint>

namespace sgdfuse_wire {

constexpr int kMaxDepth = 64;  // nested unknown groups (upb allows 100 levels of messages and groups in all)

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
};

struct Failure {
  const char* reason = nullptr;
  const uint8_t* at = nullptr;
};

// What a scan keeps of its first failure; a scanner's own table derives from it.
struct Scan {
  Failure failure;

  bool fail(const char* reason, const uint8_t* at) {
    if (failure.reason == nullptr) {
      failure.reason = reason;
      failure.at = at;
    }
    return false;
  }
};

inline bool read_varint(Reader& r, uint64_t& out) {
  uint64_t value = 0;
  for (int i = 0; i < 10; ++i) {
    if (r.p >= r.end) return false;
    const uint8_t byte = *r.p++;
    value |= uint64_t(byte & 0x7f) << (7 * i);  // bits past 64 (in a tenth byte) are dropped, as protobuf does
    if ((byte & 0x80) == 0) {
      out = value;
      return true;
    }
  }
  return false;  // more than ten bytes
}

// A tag: field number (1 .. 2^29 - 1) and wire type (0..5).
inline bool read_tag(Scan& t, Reader& r, uint32_t& field, int& wire_type) {
  const uint8_t* at = r.p;
  uint64_t tag;
  if (!read_varint(r, tag)) return t.fail("truncated or overlong tag", at);
  if (tag > 0xffffffffu) return t.fail("tag above 32 bits", at);
  field = uint32_t(tag >> 3);
  wire_type = int(tag & 7);
  if (field == 0) return t.fail("field number 0", at);
  if (wire_type > 5) return t.fail("wire type 6 or 7", at);
  return true;
}

// The payload of a length-delimited field, whose tag has been read.
inline bool read_bytes(Scan& t, Reader& r, Reader& payload) {
  const uint8_t* at = r.p;
  uint64_t length;
  if (!read_varint(r, length)) return t.fail("truncated length", at);
  if (length > uint64_t(r.end - r.p)) return t.fail("length past the end of the data", at);
  payload.p = r.p;
  payload.end = r.p + length;
  r.p = payload.end;
  return true;
}

// Skip the value of a field whose tag (field, wire_type) has been read.
inline bool skip_field(Scan& t, Reader& r, uint32_t field, int wire_type, int depth) {
  const uint8_t* at = r.p;
  switch (wire_type) {
    case 0: {
      uint64_t ignored;
      if (!read_varint(r, ignored)) return t.fail("truncated varint", at);
      return true;
    }
    case 1:
      if (r.end - r.p < 8) return t.fail("truncated fixed64", at);
      r.p += 8;
      return true;
    case 5:
      if (r.end - r.p < 4) return t.fail("truncated fixed32", at);
      r.p += 4;
      return true;
    case 2: {
      Reader ignored;
      return read_bytes(t, r, ignored);
    }
    case 3: {
      if (depth >= kMaxDepth) return t.fail("groups nested too deep", at);
      for (;;) {
        uint32_t inner;
        int inner_type;
        if (r.p >= r.end) return t.fail("group without an end", at);
        const uint8_t* tag_at = r.p;
        if (!read_tag(t, r, inner, inner_type)) return false;
        if (inner_type == 4) {
          if (inner != field) return t.fail("end group of another field", tag_at);
          return true;
        }
        if (!skip_field(t, r, inner, inner_type, depth + 1)) return false;
      }
    }
    default:  // 4: an end group outside its group
      return t.fail("end group without a start", at);
  }
}

// Each field of the message in r numbered `number` with wire type 2 goes to visit(payload) (false stops the
// scan); every other field is skipped. A ModelProto's graph (field 7), for both scanners.
template <class Visit>
bool scan_length_delimited(Scan& t, Reader r, uint32_t number, Visit&& visit) {
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (field == number && wire_type == 2) {
      Reader payload;
      if (!read_bytes(t, r, payload) || !visit(payload)) return false;
    } else if (!skip_field(t, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

}  // namespace sgdfuse_wire
