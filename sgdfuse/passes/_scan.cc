// Node-table scanner: reads the main graph's nodes straight from a serialised ONNX ModelProto (or GraphProto).
//
// A CPython extension module (``sgdfuse.passes._scan``), built on first use by sgdfuse/passes/scan.py; that
// module documents the API and the results. This file is the protobuf wire-format reader.
//
// Field numbers (onnx/onnx.proto, proto2):
//   ModelProto.graph = 7 (GraphProto)            GraphProto.node = 1 (repeated NodeProto)
//   NodeProto: input = 1, output = 2 (repeated string), name = 3, op_type = 4, domain = 7, overload = 8
//              (string), attribute = 5 (repeated AttributeProto); others (doc_string 6, ...) skipped
//   AttributeProto: type = 20 (closed enum AttributeType, 0..14; GRAPH = 5, GRAPHS = 10),
//                   g = 6 (GraphProto), graphs = 11 (repeated GraphProto)
// Wire format (protobuf encoding spec): a tag is a varint (field << 3 | wire type); wire types 0 varint,
// 1 fixed64, 2 length-delimited, 3/4 start/end group, 5 fixed32.
//
// Parsing follows protobuf's (upb's) semantics for the fields read here, so that the results equal what the
// Python protobuf API returns for the same bytes:
//   - a known field with another wire type than its declared one is an unknown field (skipped);
//   - repeated fields append in the order they occur, wherever they occur; a singular string (name, op_type,
//     domain, overload) or enum (type) seen again replaces the earlier value (last one wins); a message field seen
//     again (ModelProto.graph) is merged, so the nodes of every occurrence are appended;
//   - an enum value is read as int32 (the varint truncated); a value outside AttributeType leaves the field
//     as it was (proto2 closed enum: the value goes to the unknown fields);
//   - a string that is not valid UTF-8 is returned as bytes (as upb's Python API does for proto2 strings).
// Malformed input (a truncated varint or field, a length past the end, a wire type 6 or 7, field number 0,
// a tag above 32 bits, an unmatched end group, groups nested deeper than kMaxDepth) raises ValueError with
// the byte offset; every read is bounds-checked against the buffer, nothing is read past its end.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_wire.h"

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

using namespace sgdfuse_wire;

// A Python str of the UTF-8 text, interned; bytes when it is not valid UTF-8 (as protobuf's Python API).
PyObject* decode_string(const uint8_t* data, size_t size) {
  PyObject* text = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(data), Py_ssize_t(size), nullptr);
  if (text == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return nullptr;
    PyErr_Clear();
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(data), Py_ssize_t(size));
  }
  PyUnicode_InternInPlace(&text);
  return text;
}

// The strings made recently, by their bytes (which live in the scanned buffer for the whole scan); each entry
// holds a reference. Names repeat close together (op types, domains, a shared learning rate, a value read by
// the next nodes), so a small direct-mapped table that stays in the CPU's cache (2^12 entries, 128 KB) catches
// most repeats; a miss costs a decode and an intern, which finds the same object again. No probing: no input
// can make a lookup cost more than one comparison.
class StringCache {
 public:
  ~StringCache() {
    for (const Entry& entry : entries_) Py_XDECREF(entry.object);
  }

  // The interned string of these bytes (bytes when not UTF-8): a new reference, or null with an exception set.
  PyObject* get(const uint8_t* data, size_t size) {
    if (entries_.empty()) entries_.resize(kSize);
    const uint64_t hash = hash_bytes(data, size);
    Entry& entry = entries_[size_t(hash) & (kSize - 1)];
    if (entry.object != nullptr && entry.hash == hash && entry.size == size && std::memcmp(entry.data, data, size) == 0) {
      Py_INCREF(entry.object);
      return entry.object;
    }
    PyObject* made = decode_string(data, size);
    if (made == nullptr) return nullptr;
    PyObject* evicted = entry.object;
    entry = Entry{hash, data, size, made};  // the cache's reference
    Py_XDECREF(evicted);
    Py_INCREF(made);
    return made;
  }

 private:
  static constexpr size_t kSize = size_t(1) << 12;  // 1,024 to 16,384 entries do about as well; 65,536 worse (cache misses)

  struct Entry {
    uint64_t hash = 0;
    const uint8_t* data = nullptr;
    size_t size = 0;
    PyObject* object = nullptr;
  };

  static uint64_t hash_bytes(const uint8_t* data, size_t size) {
    uint64_t hash = 0x9e3779b97f4a7c15ull ^ size;
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      uint64_t word;
      std::memcpy(&word, data + i, 8);
      hash = (hash ^ word) * 0xff51afd7ed558ccdull;
      hash ^= hash >> 32;
    }
    uint64_t tail = 0;
    std::memcpy(&tail, data + i, size - i);
    hash = (hash ^ tail) * 0xc4ceb9fe1a85ec53ull;
    return hash ^ (hash >> 29);
  }

  std::vector<Entry> entries_;
};

// Everything one scan produces; the lists own their items.
struct Table : Scan {
  PyObject* op_types = nullptr;
  PyObject* domains = nullptr;
  PyObject* inputs = nullptr;
  PyObject* outputs = nullptr;
  PyObject* has_attributes = nullptr;
  PyObject* has_subgraph = nullptr;
  // The names (field 3) of the nodes whose name starts with these bytes, when the caller asks (else null).
  PyObject* prefixed_names = nullptr;
  const uint8_t* prefix = nullptr;
  size_t prefix_size = 0;
  const uint8_t* base = nullptr;
  // A name read again soon is not decoded and interned again (a learning rate is read by thousands of nodes).
  StringCache strings;
  bool python_error = false;  // a Python exception is set (out of memory)
};

PyObject* make_string(Table& t, const uint8_t* data, size_t size) { return t.strings.get(data, size); }

// AttributeProto: whether it holds a subgraph (type GRAPH or GRAPHS, or a g or graphs field).
bool scan_attribute(Table& t, Reader r, bool& subgraph) {
  int32_t type = 0;  // UNDEFINED, the default
  bool holds_graph = false;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (field == 20 && wire_type == 0) {
      const uint8_t* at = r.p;
      uint64_t value;
      if (!read_varint(r, value)) return t.fail("truncated varint", at);
      const int32_t number = int32_t(uint32_t(value));
      if (number >= 0 && number <= 14) type = number;  // AttributeType's values are 0..14
    } else if ((field == 6 || field == 11) && wire_type == 2) {
      Reader ignored;
      if (!read_bytes(t, r, ignored)) return false;
      holds_graph = true;
    } else if (!skip_field(t, r, field, wire_type, 0)) {
      return false;
    }
  }
  subgraph = holds_graph || type == 5 || type == 10;
  return true;
}

struct Span {
  const uint8_t* data;
  size_t size;
};

PyObject* name_tuple(Table& t, const std::vector<Span>& names) {
  PyObject* tuple = PyTuple_New(Py_ssize_t(names.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* name = make_string(t, names[i].data, names[i].size);
    if (name == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, Py_ssize_t(i), name);
  }
  return tuple;
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

bool append_bool(Table& t, PyObject* list, bool value) {
  PyObject* item = value ? Py_True : Py_False;
  Py_INCREF(item);
  return append(t, list, item);
}

// NodeProto: one row of the table.
bool scan_node(Table& t, Reader r, std::vector<Span>& inputs, std::vector<Span>& outputs) {
  inputs.clear();
  outputs.clear();
  Span op_type{nullptr, 0};
  Span domain{nullptr, 0};
  Span name{nullptr, 0};
  bool attributes = false;
  bool subgraph = false;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (wire_type == 2 && (field == 1 || field == 2 || field == 3 || field == 4 || field == 5 || field == 7)) {
      Reader payload;
      if (!read_bytes(t, r, payload)) return false;
      const Span span{payload.p, size_t(payload.end - payload.p)};
      switch (field) {
        case 1: inputs.push_back(span); break;
        case 2: outputs.push_back(span); break;
        case 3: name = span; break;
        case 4: op_type = span; break;
        case 7: domain = span; break;
        default: {  // 5: attribute
          bool held = false;
          if (!scan_attribute(t, payload, held)) return false;
          attributes = true;
          subgraph = subgraph || held;
        }
      }
    } else if (!skip_field(t, r, field, wire_type, 0)) {
      return false;
    }
  }
  static const uint8_t kEmpty = 0;
  if (op_type.data == nullptr) op_type.data = &kEmpty;
  if (domain.data == nullptr) domain.data = &kEmpty;
  if (name.data == nullptr) name.data = &kEmpty;
  if (t.prefixed_names != nullptr && name.size >= t.prefix_size && std::memcmp(name.data, t.prefix, t.prefix_size) == 0 &&
      !append(t, t.prefixed_names, make_string(t, name.data, name.size))) {
    return false;
  }
  return append(t, t.op_types, make_string(t, op_type.data, op_type.size)) &&
         append(t, t.domains, make_string(t, domain.data, domain.size)) &&
         append(t, t.inputs, name_tuple(t, inputs)) && append(t, t.outputs, name_tuple(t, outputs)) &&
         append_bool(t, t.has_attributes, attributes) && append_bool(t, t.has_subgraph, subgraph);
}

bool scan_graph(Table& t, Reader r) {
  std::vector<Span> inputs, outputs;  // reused by every node
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (field == 1 && wire_type == 2) {
      Reader node;
      if (!read_bytes(t, r, node) || !scan_node(t, node, inputs, outputs)) return false;
    } else if (!skip_field(t, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

bool scan_model(Table& t, Reader r) {
  return scan_length_delimited(t, r, 7, [&t](Reader graph) { return scan_graph(t, graph); });
}

void release(Table& t) {
  Py_XDECREF(t.op_types);
  Py_XDECREF(t.domains);
  Py_XDECREF(t.inputs);
  Py_XDECREF(t.outputs);
  Py_XDECREF(t.has_attributes);
  Py_XDECREF(t.has_subgraph);
  Py_XDECREF(t.prefixed_names);
}

// The ValueError of a failed scan (unless a Python exception is set already).
void raise_failure(const Scan& s, const uint8_t* base, bool python_error) {
  if (python_error) return;
  const Py_ssize_t offset = s.failure.at ? Py_ssize_t(s.failure.at - base) : 0;
  PyErr_Format(PyExc_ValueError, "malformed protobuf at byte %zd: %s", offset, s.failure.reason);
}

// scan(data, is_model, name_prefix=None) -> (op_types, domains, inputs, outputs, has_attributes, has_subgraph,
// prefixed_names), seven lists; prefixed_names holds the names of the nodes whose name starts with the bytes
// name_prefix, in node order (empty when name_prefix is None).
PyObject* scan(PyObject*, PyObject* args) {
  Py_buffer view;
  int is_model;
  Py_buffer prefix{};
  prefix.buf = nullptr;
  if (!PyArg_ParseTuple(args, "y*p|z*", &view, &is_model, &prefix)) return nullptr;
  Table t;
  t.base = static_cast<const uint8_t*>(view.buf);
  t.op_types = PyList_New(0);
  t.domains = PyList_New(0);
  t.inputs = PyList_New(0);
  t.outputs = PyList_New(0);
  t.has_attributes = PyList_New(0);
  t.has_subgraph = PyList_New(0);
  PyObject* names = PyList_New(0);
  if (prefix.buf != nullptr) {
    t.prefixed_names = names;
    Py_XINCREF(names);
    t.prefix = static_cast<const uint8_t*>(prefix.buf);
    t.prefix_size = size_t(prefix.len);
  }
  PyObject* result = nullptr;
  if (t.op_types && t.domains && t.inputs && t.outputs && t.has_attributes && t.has_subgraph && names) {
    const Reader r{t.base, t.base + view.len};
    bool done = false;
    try {
      done = is_model ? scan_model(t, r) : scan_graph(t, r);
    } catch (const std::bad_alloc&) {  // a vector of names or the string cache could not grow
      PyErr_NoMemory();
      t.python_error = true;
    }
    if (done) {
      result = PyTuple_Pack(7, t.op_types, t.domains, t.inputs, t.outputs, t.has_attributes, t.has_subgraph, names);
    } else {
      raise_failure(t, t.base, t.python_error);
    }
  }
  Py_XDECREF(names);
  release(t);
  if (prefix.buf != nullptr) PyBuffer_Release(&prefix);
  PyBuffer_Release(&view);
  return result;
}

// What details() reads of the nodes asked for: their overload (field 8, last wins) and the bytes of each
// attribute (field 5 with wire type 2, in order; a field of another wire type is an unknown field).
struct Details : Scan {
  const std::vector<Py_ssize_t>* positions = nullptr;
  size_t next = 0;           // the next entry of positions to find
  Py_ssize_t position = 0;   // of the next node in the graph
  PyObject* rows = nullptr;  // one (overload, attributes) tuple per position
  StringCache strings;
  bool python_error = false;
};

bool detail_node(Details& d, Reader r) {
  Span overload{nullptr, 0};
  std::vector<Span> attributes;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(d, r, field, wire_type)) return false;
    if (wire_type == 2 && (field == 5 || field == 8)) {
      Reader payload;
      if (!read_bytes(d, r, payload)) return false;
      const Span span{payload.p, size_t(payload.end - payload.p)};
      if (field == 5) {
        attributes.push_back(span);
      } else {
        overload = span;
      }
    } else if (!skip_field(d, r, field, wire_type, 0)) {
      return false;
    }
  }
  static const uint8_t kEmpty = 0;
  if (overload.data == nullptr) overload.data = &kEmpty;
  PyObject* text = d.strings.get(overload.data, overload.size);
  PyObject* blobs = PyTuple_New(Py_ssize_t(attributes.size()));
  PyObject* row = nullptr;
  if (text != nullptr && blobs != nullptr) {
    bool made = true;
    for (size_t i = 0; i < attributes.size() && made; ++i) {
      PyObject* blob = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(attributes[i].data), Py_ssize_t(attributes[i].size));
      if (blob == nullptr) {
        made = false;
      } else {
        PyTuple_SET_ITEM(blobs, Py_ssize_t(i), blob);
      }
    }
    if (made) row = PyTuple_Pack(2, text, blobs);
  }
  Py_XDECREF(text);
  Py_XDECREF(blobs);
  if (row == nullptr || PyList_Append(d.rows, row) != 0) {
    Py_XDECREF(row);
    d.python_error = true;
    return false;
  }
  Py_DECREF(row);
  return true;
}

bool detail_graph(Details& d, Reader r) {
  const std::vector<Py_ssize_t>& positions = *d.positions;
  while (r.p < r.end && d.next < positions.size()) {
    uint32_t field;
    int wire_type;
    if (!read_tag(d, r, field, wire_type)) return false;
    if (field == 1 && wire_type == 2) {
      Reader node;
      if (!read_bytes(d, r, node)) return false;
      if (d.position == positions[d.next]) {
        if (!detail_node(d, node)) return false;
        ++d.next;
      }
      ++d.position;
    } else if (!skip_field(d, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

// details(data, is_model, positions) -> one (overload, attributes) tuple per position (node numbers in the main
// graph, strictly increasing): overload a str (bytes when not UTF-8), attributes a tuple of the bytes of each
// AttributeProto as they stand in data. Positions past the last node get no row (the list is shorter).
PyObject* details(PyObject*, PyObject* args) {
  Py_buffer view;
  int is_model;
  PyObject* sequence;
  if (!PyArg_ParseTuple(args, "y*pO", &view, &is_model, &sequence)) return nullptr;
  std::vector<Py_ssize_t> positions;
  PyObject* fast = PySequence_Fast(sequence, "positions must be a sequence of ints");
  bool ordered = fast != nullptr;
  if (fast != nullptr) {
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    try {
      positions.reserve(size_t(count));
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
      ordered = false;
    }
    for (Py_ssize_t i = 0; i < count && ordered; ++i) {
      const Py_ssize_t value = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
      if (value == -1 && PyErr_Occurred()) {
        ordered = false;
      } else if (value < 0 || (!positions.empty() && value <= positions.back())) {
        PyErr_SetString(PyExc_ValueError, "positions must be non-negative and strictly increasing");
        ordered = false;
      } else {
        positions.push_back(value);
      }
    }
    Py_DECREF(fast);
  }
  PyObject* result = nullptr;
  if (ordered) {
    Details d;
    d.positions = &positions;
    d.rows = PyList_New(0);
    const uint8_t* base = static_cast<const uint8_t*>(view.buf);
    if (d.rows != nullptr) {
      const Reader r{base, base + view.len};
      bool done = false;
      try {
        done = is_model ? scan_length_delimited(d, r, 7, [&d](Reader graph) { return detail_graph(d, graph); }) : detail_graph(d, r);
      } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
        d.python_error = true;
      }
      if (done) {
        result = d.rows;
        Py_INCREF(result);
      } else {
        raise_failure(d, base, d.python_error);
      }
      Py_DECREF(d.rows);
    }
  }
  PyBuffer_Release(&view);
  return result;
}

PyMethodDef kMethods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, is_model, name_prefix=None) -> seven lists: op_types, domains, inputs, outputs, has_attributes, "
     "has_subgraph, and the node names starting with name_prefix."},
    {"details", details, METH_VARARGS,
     "details(data, is_model, positions) -> per position, (overload, the bytes of each attribute)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_scan", "Node-table scanner (see sgdfuse.passes.scan).", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&kModule); }
