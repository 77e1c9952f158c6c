// Value-info scanner: reads the ValueInfoProtos of the main graph straight from a serialised ONNX ModelProto.
//
// A CPython extension module (``sgdfuse.passes._vscan``), built on first use by sgdfuse/passes/value_scan.py;
// that module documents the API and the results. The wire-format helpers are those of _scan.cc (the node
// scanner), with the same bounds checks and the same protobuf (upb) semantics.
//
// Field numbers (onnx/onnx.proto, proto2):
//   ModelProto.graph = 7 (GraphProto; seen again it is merged: the repeated fields of every occurrence append)
//   GraphProto: node = 1 (only counted), input = 11, output = 12, value_info = 13 (repeated ValueInfoProto)
//   ValueInfoProto: name = 1 (string, last one wins), type = 2 (TypeProto; seen again it is merged, and the
//                   concatenation of serialised messages parses as their merge, so the type's bytes are the
//                   concatenation of every occurrence's payload); others (doc_string 3, metadata_props 4) skipped
// A known field with another wire type than its declared one is an unknown field (skipped). A name that is
// not valid UTF-8 raises ValueError (the caller then reads through protobuf). Malformed input raises
// ValueError with the byte offset; nothing is read past the end of the buffer.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kMaxDepth = 64;

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
};

struct Failure {
  const char* reason = nullptr;
  const uint8_t* at = nullptr;
};

struct Table {
  // Per selected GraphProto field (input, output, value_info): the names and the type numbers, in order.
  PyObject* names[3] = {nullptr, nullptr, nullptr};
  PyObject* type_ids[3] = {nullptr, nullptr, nullptr};
  PyObject* types = nullptr;  // the distinct types' bytes, by type number
  std::unordered_map<std::string_view, long> type_numbers;
  std::deque<std::string> merged;  // the bytes of types given in more than one field (keys point into these)
  std::string scratch;
  long node_count = 0;
  int wanted = 0;  // bit 0: input, 1: output, 2: value_info
  const uint8_t* base = nullptr;
  Failure failure;
  bool python_error = false;

  bool fail(const char* reason, const uint8_t* at) {
    if (failure.reason == nullptr) {
      failure.reason = reason;
      failure.at = at;
    }
    return false;
  }
};

bool read_varint(Reader& r, uint64_t& out) {
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
bool read_tag(Table& t, Reader& r, uint32_t& field, int& wire_type) {
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
bool read_bytes(Table& t, Reader& r, Reader& payload) {
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
bool skip_field(Table& t, Reader& r, uint32_t field, int wire_type, int depth) {
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


// Append to a list, taking the reference to item (which may be null after a failed call).
bool append(Table& t, PyObject* list, PyObject* item) {
  if (item == nullptr) {
    t.python_error = true;
    return false;
  }
  const int status = PyList_Append(list, item);
  Py_DECREF(item);
  if (status != 0) {
    t.python_error = true;
    return false;
  }
  return true;
}

// ValueInfoProto: its name and the number of its type's bytes, appended to the lists of ``slot``.
bool scan_value_info(Table& t, Reader r, int slot) {
  const uint8_t* name = nullptr;
  size_t name_size = 0;
  const uint8_t* type = nullptr;
  size_t type_size = 0;
  int type_fields = 0;
  t.scratch.clear();
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (wire_type == 2 && (field == 1 || field == 2)) {
      Reader payload;
      if (!read_bytes(t, r, payload)) return false;
      const size_t size = size_t(payload.end - payload.p);
      if (field == 1) {
        name = payload.p;
        name_size = size;
      } else {
        if (type_fields == 1) t.scratch.assign(reinterpret_cast<const char*>(type), type_size);
        if (type_fields >= 1) t.scratch.append(reinterpret_cast<const char*>(payload.p), size);
        type = payload.p;
        type_size = size;
        ++type_fields;
      }
    } else if (!skip_field(t, r, field, wire_type, 0)) {
      return false;
    }
  }
  std::string_view key;
  if (type_fields > 1) {
    t.merged.push_back(t.scratch);
    key = std::string_view(t.merged.back());
  } else if (type_fields == 1) {
    key = std::string_view(reinterpret_cast<const char*>(type), type_size);
  }
  long number;
  auto found = t.type_numbers.find(key);
  if (found == t.type_numbers.end()) {
    number = long(t.type_numbers.size());
    t.type_numbers.emplace(key, number);
    if (!append(t, t.types, PyBytes_FromStringAndSize(key.data(), Py_ssize_t(key.size())))) return false;
  } else {
    number = found->second;
  }
  static const char kEmpty = 0;
  PyObject* text = PyUnicode_DecodeUTF8(name ? reinterpret_cast<const char*>(name) : &kEmpty, Py_ssize_t(name_size), nullptr);
  if (text == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
      t.python_error = true;
      return false;
    }
    PyErr_Clear();
    return t.fail("a value name that is not UTF-8", name);
  }
  PyUnicode_InternInPlace(&text);
  return append(t, t.names[slot], text) && append(t, t.type_ids[slot], PyLong_FromLong(number));
}

bool scan_graph(Table& t, Reader r) {
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (wire_type == 2 && field >= 11 && field <= 13 && (t.wanted & (1 << (field - 11)))) {
      Reader info;
      if (!read_bytes(t, r, info) || !scan_value_info(t, info, int(field - 11))) return false;
    } else {
      if (field == 1 && wire_type == 2) ++t.node_count;
      if (!skip_field(t, r, field, wire_type, 0)) return false;
    }
  }
  return true;
}

bool scan_model(Table& t, Reader r) {
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (field == 7 && wire_type == 2) {
      Reader graph;
      if (!read_bytes(t, r, graph) || !scan_graph(t, graph)) return false;
    } else if (!skip_field(t, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

void release(Table& t) {
  for (int i = 0; i < 3; ++i) {
    Py_XDECREF(t.names[i]);
    Py_XDECREF(t.type_ids[i]);
  }
  Py_XDECREF(t.types);
}

// scan(data, wanted) -> (names, type_ids, types, node_count): names and type_ids are three lists each (input,
// output, value_info; empty where the bit of ``wanted`` is clear), types the distinct types' bytes.
PyObject* scan(PyObject*, PyObject* args) {
  Py_buffer view;
  int wanted;
  if (!PyArg_ParseTuple(args, "y*i", &view, &wanted)) return nullptr;
  Table t;
  t.wanted = wanted;
  t.base = static_cast<const uint8_t*>(view.buf);
  bool made = (t.types = PyList_New(0)) != nullptr;
  for (int i = 0; i < 3 && made; ++i) made = (t.names[i] = PyList_New(0)) != nullptr && (t.type_ids[i] = PyList_New(0)) != nullptr;
  PyObject* result = nullptr;
  if (made) {
    const Reader r{t.base, t.base + view.len};
    bool done = false;
    try {
      done = scan_model(t, r);
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
      t.python_error = true;
    }
    if (done) {
      result = Py_BuildValue("(OOO)(OOO)Ol", t.names[0], t.names[1], t.names[2], t.type_ids[0], t.type_ids[1], t.type_ids[2],
                             t.types, t.node_count);
    } else if (!t.python_error) {
      const Py_ssize_t offset = t.failure.at ? Py_ssize_t(t.failure.at - t.base) : 0;
      PyErr_Format(PyExc_ValueError, "malformed protobuf at byte %zd: %s", offset, t.failure.reason);
    }
  }
  release(t);
  PyBuffer_Release(&view);
  return result;
}

PyMethodDef kMethods[] = {
    {"scan", scan, METH_VARARGS, "scan(data, wanted) -> (names, type_ids, types, node_count)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_vscan", "Value-info scanner (see sgdfuse.passes.value_scan).", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__vscan(void) { return PyModule_Create(&kModule); }
