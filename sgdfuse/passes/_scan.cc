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

#include "_pylist.h"
#include "_wire.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <string_view>
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
  // The position of the first node whose name (field 3) or an attribute's name is not valid UTF-8; -1: none.
  Py_ssize_t non_text_name = -1;
  // When the caller asks: per node, (overload, (each attribute's bytes as they stand, ...)) (else null).
  PyObject* details = nullptr;
  // A name read again soon is not decoded and interned again (a learning rate is read by thousands of nodes).
  StringCache strings;
  bool python_error = false;  // a Python exception is set (out of memory)
};

PyObject* make_string(Table& t, const uint8_t* data, size_t size) { return t.strings.get(data, size); }

// Whether these bytes are valid UTF-8 as Python's strict decoder takes it (RFC 3629: no overlong form, no
// surrogate U+D800..U+DFFF, nothing above U+10FFFF), which is when protobuf's Python API hands a string field
// out as str rather than bytes.
bool utf8_valid(const uint8_t* p, size_t size) {
  const uint8_t* end = p + size;
  while (p < end) {
    const uint8_t c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    size_t length;
    uint8_t low = 0x80, high = 0xBF;  // the range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) low = 0xA0;        // overlong
      if (c == 0xED) high = 0x9F;       // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) low = 0x90;        // overlong
      if (c == 0xF4) high = 0x8F;       // above U+10FFFF
    } else {
      return false;
    }
    if (size_t(end - p) < length || p[1] < low || p[1] > high) return false;
    for (size_t i = 2; i < length; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
    }
    p += length;
  }
  return true;
}

// AttributeProto: whether it holds a subgraph (type GRAPH or GRAPHS, or a g or graphs field); with
// ``text_name``, also whether its name (field 1, the last one wins) is valid UTF-8.
bool scan_attribute(Scan& t, Reader r, bool& subgraph, bool* text_name = nullptr) {
  int32_t type = 0;  // UNDEFINED, the default
  bool holds_graph = false;
  bool name_ok = true;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (text_name != nullptr && field == 1 && wire_type == 2) {
      Reader name;
      if (!read_bytes(t, r, name)) return false;
      name_ok = utf8_valid(name.p, size_t(name.end - name.p));
    } else if (field == 20 && wire_type == 0) {
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
  if (text_name != nullptr) *text_name = name_ok;
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

using sgdfuse_py::append;  // _pylist.h

bool append_bool(Table& t, PyObject* list, bool value) {
  PyObject* item = value ? Py_True : Py_False;
  Py_INCREF(item);
  return append(t, list, item);
}

// NodeProto: one row of the table.
// A tuple of the bytes of each span (new reference), or null with an exception set.
PyObject* bytes_tuple(const std::vector<Span>& spans) {
  PyObject* tuple = PyTuple_New(Py_ssize_t(spans.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < spans.size(); ++i) {
    PyObject* item = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(spans[i].data), Py_ssize_t(spans[i].size));
    if (item == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, Py_ssize_t(i), item);
  }
  return tuple;
}

bool scan_node(Table& t, Reader r, std::vector<Span>& inputs, std::vector<Span>& outputs, std::vector<Span>& attribute_spans) {
  inputs.clear();
  outputs.clear();
  attribute_spans.clear();
  Span op_type{nullptr, 0};
  Span domain{nullptr, 0};
  Span name{nullptr, 0};
  Span overload{nullptr, 0};
  bool attributes = false;
  bool subgraph = false;
  bool attribute_names_text = true;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (wire_type == 2 && (field == 1 || field == 2 || field == 3 || field == 4 || field == 5 || field == 7 ||
                           (field == 8 && t.details != nullptr))) {
      Reader payload;
      if (!read_bytes(t, r, payload)) return false;
      const Span span{payload.p, size_t(payload.end - payload.p)};
      switch (field) {
        case 1: inputs.push_back(span); break;
        case 2: outputs.push_back(span); break;
        case 3: name = span; break;
        case 4: op_type = span; break;
        case 7: domain = span; break;
        case 8: overload = span; break;
        default: {  // 5: attribute
          if (t.details != nullptr) attribute_spans.push_back(span);
          bool held = false;
          bool text_name = true;
          if (!scan_attribute(t, payload, held, t.non_text_name < 0 ? &text_name : nullptr)) return false;
          attribute_names_text = attribute_names_text && text_name;
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
  if (overload.data == nullptr) overload.data = &kEmpty;
  if (t.details != nullptr) {
    PyObject* overload_text = make_string(t, overload.data, overload.size);
    PyObject* attribute_bytes = overload_text == nullptr ? nullptr : bytes_tuple(attribute_spans);
    PyObject* row = attribute_bytes == nullptr ? nullptr : PyTuple_Pack(2, overload_text, attribute_bytes);
    Py_XDECREF(overload_text);
    Py_XDECREF(attribute_bytes);
    if (!append(t, t.details, row)) return false;
  }
  if (t.non_text_name < 0 && !(attribute_names_text && utf8_valid(name.data, name.size))) {
    t.non_text_name = PyList_GET_SIZE(t.op_types);  // this node's position: the rows before it are appended
  }
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
  std::vector<Span> inputs, outputs, attribute_spans;  // reused by every node
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (field == 1 && wire_type == 2) {
      Reader node;
      if (!read_bytes(t, r, node) || !scan_node(t, node, inputs, outputs, attribute_spans)) return false;
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
  Py_XDECREF(t.details);
}

// The ValueError of a failed scan (unless a Python exception is set already).
void raise_failure(const Scan& s, const uint8_t* base, bool python_error) {
  if (python_error) return;
  const Py_ssize_t offset = s.failure.at ? Py_ssize_t(s.failure.at - base) : 0;
  PyErr_Format(PyExc_ValueError, "malformed protobuf at byte %zd: %s", offset, s.failure.reason);
}

// scan(data, is_model, name_prefix=None, details=False) -> (op_types, domains, inputs, outputs, has_attributes,
// has_subgraph, prefixed_names, non_text_name, details): seven lists, an int and a list or None; prefixed_names
// holds the names of the nodes whose name starts with the bytes name_prefix, in node order (empty when name_prefix
// is None); non_text_name is the position of the first node whose name or one of whose attributes' names is not
// valid UTF-8, -1 when none; details (when asked, else None) holds per node (overload, (the bytes of each
// attribute as they stand in data, in order)).
PyObject* scan(PyObject*, PyObject* args) {
  Py_buffer view;
  int is_model;
  Py_buffer prefix{};
  prefix.buf = nullptr;
  int details = 0;
  if (!PyArg_ParseTuple(args, "y*p|z*p", &view, &is_model, &prefix, &details)) return nullptr;
  Table t;
  if (details) t.details = PyList_New(0);
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
  if (t.op_types && t.domains && t.inputs && t.outputs && t.has_attributes && t.has_subgraph && names && (t.details || !details)) {
    const Reader r{t.base, t.base + view.len};
    bool done = false;
    try {
      done = is_model ? scan_model(t, r) : scan_graph(t, r);
    } catch (const std::bad_alloc&) {  // a vector of names or the string cache could not grow
      PyErr_NoMemory();
      t.python_error = true;
    }
    if (done) {
      result = Py_BuildValue("(OOOOOOOnO)", t.op_types, t.domains, t.inputs, t.outputs, t.has_attributes, t.has_subgraph, names,
                             t.non_text_name, t.details ? t.details : Py_None);
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

// --- structure(): the output guard's pass over a rewritten graph (sgdfuse.passes.output_check) -------------
//
// Single assignment and definition before use over the main graph, as output_check's Python pass does it (the
// reference; tests/test_node_scan.py holds the two to one another): the names defined before the first node are
// the graph inputs' (GraphProto.input = 11, ValueInfoProto.name = 1), the initializers' (GraphProto.initializer =
// 5, TensorProto.name = 8), the sparse initializers' values' (GraphProto.sparse_initializer = 15,
// SparseTensorProto.values = 1, merged when repeated) and ""; then node by node, every input must be defined,
// every name a subgraph reads from outside (asked of Python: outer(position)) too, and the node's non-empty
// outputs must be new and distinct, and are defined; at the end every graph output (GraphProto.output = 12)
// must be defined. Names are compared as their bytes (protobuf's Python API gives equal objects exactly for
// equal bytes: str when UTF-8, bytes otherwise). Along the way, the nodes whose first output is one of the
// wanted names are found, and per group of wanted names (a plan's nodes, in order) a summary of what the
// checker sees of them is made: their bytes but names, and the names as the places they first stand.

// A set of names (their bytes live as long as the scan: in the buffer, or in Python objects the caller holds), each
// with a number: open addressing with linear probing over 8-byte slots (part of the hash and the name's entry),
// grown at half full. std::unordered_set allocates a node per name; a graph's names fill tables past the CPU's
// caches, and small slots keep the probes in fewer cache lines.
class NameTable {
 public:
  static constexpr uint32_t kMissing = 0xffffffffu;

  explicit NameTable(size_t expected) { rehash(expected < 8 ? 16 : expected * 2); }

  uint32_t find(std::string_view name) const {
    const uint64_t hash = hash_of(name);
    const uint64_t tag = hash >> 32;
    for (size_t i = size_t(hash) & mask_;; i = (i + 1) & mask_) {
      const uint64_t slot = slots_[i];
      if (slot == 0) return kMissing;
      if ((slot >> 32) == tag) {
        const Name& entry = names_[uint32_t(slot) - 1];
        if (entry.size == name.size() && std::memcmp(entry.data, name.data(), name.size()) == 0) return entry.value;
      }
    }
  }

  bool contains(std::string_view name) const { return find(name) != kMissing; }

  // Sets the name's number (a new entry, or the old one's number replaced).
  void set(std::string_view name, uint32_t value) {
    if (2 * (names_.size() + 1) > slots_.size()) rehash(slots_.size() * 2);
    const uint64_t hash = hash_of(name);
    const uint64_t tag = hash >> 32;
    for (size_t i = size_t(hash) & mask_;; i = (i + 1) & mask_) {
      const uint64_t slot = slots_[i];
      if (slot == 0) {
        names_.push_back(Name{name.data() ? name.data() : "", uint32_t(name.size()), value, hash});
        slots_[i] = (tag << 32) | uint64_t(names_.size());
        return;
      }
      if ((slot >> 32) == tag) {
        Name& entry = names_[uint32_t(slot) - 1];
        if (entry.size == name.size() && std::memcmp(entry.data, name.data(), name.size()) == 0) {
          entry.value = value;
          return;
        }
      }
    }
  }

 private:
  struct Name {
    const char* data;
    uint32_t size;
    uint32_t value;
    uint64_t hash;
  };

  static uint64_t hash_of(std::string_view name) {
    const uint8_t* data = reinterpret_cast<const uint8_t*>(name.data());
    const size_t size = name.size();
    uint64_t hash = 0x9e3779b97f4a7c15ull ^ size;
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      uint64_t word;
      std::memcpy(&word, data + i, 8);
      hash = (hash ^ word) * 0xff51afd7ed558ccdull;
      hash ^= hash >> 32;
    }
    uint64_t tail = 0;
    if (size > i) std::memcpy(&tail, data + i, size - i);
    hash = (hash ^ tail) * 0xc4ceb9fe1a85ec53ull;
    return hash ^ (hash >> 29);
  }

  void rehash(size_t capacity) {
    size_t size = 16;
    while (size < capacity) size <<= 1;
    slots_.assign(size, 0);
    mask_ = size - 1;
    names_.reserve(size / 2);
    for (size_t n = 0; n < names_.size(); ++n) {
      const uint64_t hash = names_[n].hash;
      for (size_t i = size_t(hash) & mask_;; i = (i + 1) & mask_) {
        if (slots_[i] == 0) {
          slots_[i] = ((hash >> 32) << 32) | uint64_t(n + 1);
          break;
        }
      }
    }
  }

  std::vector<uint64_t> slots_;
  std::vector<Name> names_;
  size_t mask_ = 0;
};

// A wanted node found: its fields, the names and attributes as ranges of Structure::spans.
struct Found {
  Span op_type{nullptr, 0};
  Span domain{nullptr, 0};
  Span overload{nullptr, 0};
  uint32_t attributes = 0, inputs = 0, outputs = 0, end = 0;  // [attributes, inputs), [inputs, outputs), [outputs, end)
  bool subgraph = false;
};

struct Structure : Scan {
  explicit Structure(size_t expected_names) : defined(expected_names), wanted(16) {}
  ~Structure() { Py_XDECREF(error); }
  Structure(const Structure&) = delete;
  Structure& operator=(const Structure&) = delete;

  NameTable defined;
  NameTable wanted;  // name -> the last wanted entry of that name
  std::vector<Py_ssize_t> found;  // per wanted entry: the node's position, or -1
  std::vector<Found> nodes;       // per wanted entry found
  std::vector<Span> spans;        // the found nodes' attributes and names
  std::vector<Span> graph_outputs;
  // One node's fields while it is read (kept for the next node: no allocation per node).
  std::vector<Span> inputs, outputs, attributes;
  PyObject* outer = nullptr;  // callable(position) -> list of lists of names
  PyObject* error = nullptr;  // (kind, [names]) once a rule is broken
  Py_ssize_t position = 0;
  StringCache strings;
  bool python_error = false;
};

std::string_view view_of(const Span& span) { return std::string_view(reinterpret_cast<const char*>(span.data), span.size); }

// The bytes of a Python str (UTF-8) or bytes object; false with an exception set otherwise.
bool bytes_of(PyObject* name, std::string_view& out) {
  if (PyUnicode_Check(name)) {
    Py_ssize_t size;
    const char* text = PyUnicode_AsUTF8AndSize(name, &size);
    if (text == nullptr) return false;
    out = std::string_view(text, size_t(size));
    return true;
  }
  if (PyBytes_Check(name)) {
    out = std::string_view(PyBytes_AS_STRING(name), size_t(PyBytes_GET_SIZE(name)));
    return true;
  }
  PyErr_SetString(PyExc_TypeError, "names must be str or bytes");
  return false;
}

bool set_error(Structure& s, const char* kind, PyObject* names) {
  if (names == nullptr) {
    s.python_error = true;
    return false;
  }
  s.error = Py_BuildValue("(sN)", kind, names);
  if (s.error == nullptr) s.python_error = true;
  return false;
}

bool name_error(Structure& s, const char* kind, const Span& name) {
  PyObject* text = s.strings.get(name.data, name.size);
  return set_error(s, kind, text == nullptr ? nullptr : Py_BuildValue("[N]", text));
}

// The payload of the last length-delimited field `number` of a message into `out`; `out` is left as it was
// when the message has none.
bool last_bytes_field(Scan& s, Reader r, uint32_t number, Span& out) {
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(s, r, field, wire_type)) return false;
    if (field == number && wire_type == 2) {
      Reader payload;
      if (!read_bytes(s, r, payload)) return false;
      out = Span{payload.p, size_t(payload.end - payload.p)};
    } else if (!skip_field(s, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

// TensorProto: its name (field 8, last wins) into `name` when present.
bool tensor_name(Scan& s, Reader r, Span& name) { return last_bytes_field(s, r, 8, name); }

// ValueInfoProto: its name (field 1, last wins), "" without one.
bool value_info_name(Scan& s, Reader r, Span& name) {
  static const uint8_t kEmpty = 0;
  name = Span{&kEmpty, 0};
  return last_bytes_field(s, r, 1, name);
}

// The names a graph defines before its first node, and its outputs (every occurrence of the graph: merged).
bool structure_names(Structure& s, Reader r) {
  static const uint8_t kEmpty = 0;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(s, r, field, wire_type)) return false;
    if (wire_type == 2 && (field == 5 || field == 11 || field == 12 || field == 15)) {
      Reader payload;
      if (!read_bytes(s, r, payload)) return false;
      Span name{&kEmpty, 0};
      if (field == 5) {
        if (!tensor_name(s, payload, name)) return false;
        s.defined.set(view_of(name), 0);
      } else if (field == 15) {  // SparseTensorProto.values (1), merged when given again: its last name
        Reader sparse = payload;
        while (sparse.p < sparse.end) {
          uint32_t inner;
          int inner_type;
          if (!read_tag(s, sparse, inner, inner_type)) return false;
          if (inner == 1 && inner_type == 2) {
            Reader values;
            if (!read_bytes(s, sparse, values) || !tensor_name(s, values, name)) return false;
          } else if (!skip_field(s, sparse, inner, inner_type, 0)) {
            return false;
          }
        }
        s.defined.set(view_of(name), 0);
      } else {
        if (!value_info_name(s, payload, name)) return false;
        if (field == 11) {
          s.defined.set(view_of(name), 0);
        } else {
          s.graph_outputs.push_back(name);
        }
      }
    } else if (!skip_field(s, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

// Whether the names a node's subgraphs read from outside (outer(position)) are all defined; false after setting
// the error (or a Python exception).
bool subgraphs_defined(Structure& s) {
  PyObject* lists = PyObject_CallFunction(s.outer, "n", s.position);
  PyObject* fast = lists == nullptr ? nullptr : PySequence_Fast(lists, "outer() must return a list of lists of names");
  Py_XDECREF(lists);
  if (fast == nullptr) {
    s.python_error = true;
    return false;
  }
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject* names = PySequence_Fast(PySequence_Fast_GET_ITEM(fast, i), "outer() must return a list of lists of names");
    PyObject* missing = names == nullptr ? nullptr : PyList_New(0);
    bool ok = missing != nullptr;
    for (Py_ssize_t k = 0; ok && k < PySequence_Fast_GET_SIZE(names); ++k) {
      PyObject* name = PySequence_Fast_GET_ITEM(names, k);
      std::string_view bytes;
      ok = bytes_of(name, bytes) && (bytes.empty() || s.defined.contains(bytes) || PyList_Append(missing, name) == 0);
    }
    Py_XDECREF(names);
    if (!ok) {
      Py_XDECREF(missing);
      Py_DECREF(fast);
      s.python_error = true;
      return false;
    }
    if (PyList_GET_SIZE(missing) > 0) {
      Py_DECREF(fast);
      return set_error(s, "subgraph", missing);
    }
    Py_DECREF(missing);
  }
  Py_DECREF(fast);
  return true;
}

// One node: its fields, then the rules; a wanted node is kept.
bool structure_node(Structure& s, Reader r) {
  static const uint8_t kEmpty = 0;
  s.inputs.clear();
  s.outputs.clear();
  s.attributes.clear();
  Span op_type{&kEmpty, 0}, domain{&kEmpty, 0}, overload{&kEmpty, 0};
  bool subgraph = false;
  while (r.p < r.end) {
    uint32_t field;
    int wire_type;
    if (!read_tag(s, r, field, wire_type)) return false;
    if (wire_type == 2 && (field == 1 || field == 2 || field == 4 || field == 5 || field == 7 || field == 8)) {
      Reader payload;
      if (!read_bytes(s, r, payload)) return false;
      const Span span{payload.p, size_t(payload.end - payload.p)};
      switch (field) {
        case 1: s.inputs.push_back(span); break;
        case 2: s.outputs.push_back(span); break;
        case 4: op_type = span; break;
        case 7: domain = span; break;
        case 8: overload = span; break;
        default: {  // 5: attribute
          bool held = false;
          if (!scan_attribute(s, payload, held)) return false;
          s.attributes.push_back(span);
          subgraph = subgraph || held;
        }
      }
    } else if (!skip_field(s, r, field, wire_type, 0)) {
      return false;
    }
  }
  for (const Span& name : s.inputs) {
    if (name.size != 0 && !s.defined.contains(view_of(name))) return name_error(s, "read", name);
  }
  if (subgraph && !subgraphs_defined(s)) return false;
  if (s.outputs.empty()) return true;
  for (size_t k = 0; k < s.outputs.size(); ++k) {
    const Span& name = s.outputs[k];
    if (name.size == 0) continue;
    bool twice = s.defined.contains(view_of(name));
    for (size_t j = 0; j < k && !twice; ++j) twice = view_of(s.outputs[j]) == view_of(name);
    if (twice) return name_error(s, "twice", name);
  }
  for (const Span& name : s.outputs) {
    if (name.size != 0) s.defined.set(view_of(name), 0);
  }
  const uint32_t wanted = s.wanted.find(view_of(s.outputs[0]));
  if (wanted != NameTable::kMissing) {
    s.found[wanted] = s.position;
    Found& node = s.nodes[wanted];
    node.op_type = op_type;
    node.domain = domain;
    node.overload = overload;
    node.subgraph = subgraph;
    node.attributes = uint32_t(s.spans.size());
    s.spans.insert(s.spans.end(), s.attributes.begin(), s.attributes.end());
    node.inputs = uint32_t(s.spans.size());
    s.spans.insert(s.spans.end(), s.inputs.begin(), s.inputs.end());
    node.outputs = uint32_t(s.spans.size());
    s.spans.insert(s.spans.end(), s.outputs.begin(), s.outputs.end());
    node.end = uint32_t(s.spans.size());
  }
  return true;
}

bool structure_graph(Structure& s, Reader r) {
  while (r.p < r.end && s.error == nullptr) {
    uint32_t field;
    int wire_type;
    if (!read_tag(s, r, field, wire_type)) return false;
    if (field == 1 && wire_type == 2) {
      Reader node;
      if (!read_bytes(s, r, node) || !structure_node(s, node)) return false;
      ++s.position;
    } else if (!skip_field(s, r, field, wire_type, 0)) {
      return false;
    }
  }
  return true;
}

void put_u32(std::string& out, uint32_t value) {
  const char bytes[4] = {char(value & 0xff), char((value >> 8) & 0xff), char((value >> 16) & 0xff), char((value >> 24) & 0xff)};
  out.append(bytes, 4);
}

void put_span(std::string& out, const Span& span) {
  put_u32(out, uint32_t(span.size));
  out.append(reinterpret_cast<const char*>(span.data), span.size);
}

// What summary() reuses from one group to the next.
struct Scratch {
  std::vector<std::string_view> sequence;
  std::vector<uint32_t> firsts;  // places of the distinct non-empty names, in order
  std::string bytes;
};

// The place `k`'s name first stands in the sequence (names repeat within a dozen slots: a linear search).
uint32_t first_place(const std::vector<std::string_view>& sequence, const std::vector<uint32_t>& firsts, size_t k) {
  for (uint32_t place : firsts) {
    if (sequence[place] == sequence[k]) return place;
  }
  return NameTable::kMissing;
}

// One group's summary: (bytes of what the checker sees but names, names in order of first appearance, the place
// each first stands, whether the group's nodes output it). Every length is in the bytes: they split uniquely.
PyObject* summary(Structure& s, Scratch& scratch, size_t first, size_t count) {
  std::vector<std::string_view>& sequence = scratch.sequence;
  std::vector<uint32_t>& firsts = scratch.firsts;
  std::string& bytes = scratch.bytes;
  sequence.clear();
  firsts.clear();
  bytes.clear();
  for (size_t f = first; f < first + count; ++f) {
    const Found& node = s.nodes[f];
    put_span(bytes, node.domain);
    put_span(bytes, node.op_type);
    put_span(bytes, node.overload);
    put_u32(bytes, node.inputs - node.attributes);
    for (uint32_t a = node.attributes; a < node.inputs; ++a) put_span(bytes, s.spans[a]);
    put_u32(bytes, node.outputs - node.inputs);
    put_u32(bytes, node.end - node.outputs);
    for (uint32_t n = node.inputs; n < node.end; ++n) sequence.push_back(view_of(s.spans[n]));
  }
  // A table for a long sequence; else a linear search per slot (a plan's nodes hold a dozen names).
  std::unique_ptr<NameTable> places(sequence.size() > 64 ? new NameTable(sequence.size()) : nullptr);
  for (size_t k = 0; k < sequence.size(); ++k) {
    uint32_t place = 0xffffffffu;  // "" stays "": -1
    if (!sequence[k].empty()) {
      place = places ? places->find(sequence[k]) : first_place(sequence, firsts, k);
      if (place == NameTable::kMissing) {
        place = uint32_t(k);
        firsts.push_back(place);
        if (places) places->set(sequence[k], place);
      }
    }
    put_u32(bytes, place);
  }
  PyObject* names = PyTuple_New(Py_ssize_t(firsts.size()));
  PyObject* where = PyTuple_New(Py_ssize_t(firsts.size()));
  PyObject* outputs = PyTuple_New(Py_ssize_t(firsts.size()));
  PyObject* blob = PyBytes_FromStringAndSize(bytes.data(), Py_ssize_t(bytes.size()));
  PyObject* result = nullptr;
  if (names && where && outputs && blob) {
    bool made = true;
    for (size_t i = 0; i < firsts.size() && made; ++i) {
      const std::string_view name = sequence[firsts[i]];
      PyObject* text = s.strings.get(reinterpret_cast<const uint8_t*>(name.data()), name.size());
      PyObject* place = PyLong_FromSize_t(firsts[i]);
      if (text == nullptr || place == nullptr) {
        Py_XDECREF(text);
        Py_XDECREF(place);
        made = false;
        break;
      }
      PyTuple_SET_ITEM(names, Py_ssize_t(i), text);
      PyTuple_SET_ITEM(where, Py_ssize_t(i), place);
      // Whether one of the group's nodes outputs it (each node's outputs follow its inputs among the spans).
      bool produced = false;
      for (size_t f = first; f < first + count && !produced; ++f) {
        for (uint32_t n = s.nodes[f].outputs; n < s.nodes[f].end && !produced; ++n) produced = view_of(s.spans[n]) == name;
      }
      PyObject* flag = produced ? Py_True : Py_False;
      Py_INCREF(flag);
      PyTuple_SET_ITEM(outputs, Py_ssize_t(i), flag);
    }
    if (made) result = PyTuple_Pack(4, blob, names, where, outputs);
  }
  Py_XDECREF(names);
  Py_XDECREF(where);
  Py_XDECREF(outputs);
  Py_XDECREF(blob);
  return result;
}

// structure(data, is_model, wanted, sizes, outer) -> (error, found, subgraph, groups): error None or (kind, names)
// with kind "read", "subgraph", "twice" or "output" (names: the name, or a subgraph's missing names); found, per
// wanted name (None: never found), the position of the node whose first output it is (-1: none, and for all
// but the last of equal names); subgraph, per wanted name, whether
// that node holds a subgraph; groups, per group of sizes[i] consecutive wanted names, the summary of its nodes
// (None when one is not found; all None after an error).
PyObject* structure(PyObject*, PyObject* args) {
  Py_buffer view;
  int is_model;
  PyObject* wanted;
  PyObject* sizes;
  PyObject* outer;
  if (!PyArg_ParseTuple(args, "y*pOOO", &view, &is_model, &wanted, &sizes, &outer)) return nullptr;
  PyObject* result = nullptr;
  PyObject* wanted_fast = PySequence_Fast(wanted, "wanted must be a sequence of names");
  PyObject* sizes_fast = wanted_fast ? PySequence_Fast(sizes, "sizes must be a sequence of ints") : nullptr;
  if (sizes_fast != nullptr) {
    const uint8_t* base = static_cast<const uint8_t*>(view.buf);
    try {
      // A start for the table of defined names (a graph of small nodes holds a name per 100 bytes or so, one
      // with large constants far fewer: at most a million to start with); it grows.
      Structure s(std::min(size_t(view.len) / 128, size_t(1) << 20));
      s.outer = outer;
      bool ready = true;
      const Py_ssize_t count = PySequence_Fast_GET_SIZE(wanted_fast);
      s.found.assign(size_t(count), -1);
      s.nodes.resize(size_t(count));
      for (Py_ssize_t i = 0; i < count && ready; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(wanted_fast, i);
        std::string_view name;
        if (item == Py_None) continue;  // a node with no output: never found
        if (!bytes_of(item, name)) {
          ready = false;
        } else {
          s.wanted.set(name, uint32_t(i));
        }
      }
      static const uint8_t kEmpty = 0;
      s.defined.set(view_of(Span{&kEmpty, 0}), 0);
      const Reader r{base, base + view.len};
      bool done = ready;
      if (done) {
        done = is_model ? scan_length_delimited(s, r, 7, [&s](Reader graph) { return structure_names(s, graph); }) : structure_names(s, r);
      }
      if (done) {
        done = is_model ? scan_length_delimited(s, r, 7, [&s](Reader graph) { return structure_graph(s, graph); }) : structure_graph(s, r);
      }
      if (done && s.error == nullptr) {
        for (const Span& name : s.graph_outputs) {
          if (!s.defined.contains(view_of(name))) {
            name_error(s, "output", name);
            break;
          }
        }
      }
      if (s.python_error) {
        done = false;  // a Python exception is set
      } else if (!done && s.error != nullptr) {
        done = true;  // a broken rule stopped the walk, not malformed bytes
      }
      if (done) {
        PyObject* found = PyList_New(count);
        PyObject* subgraph = PyList_New(count);
        const Py_ssize_t groups_count = PySequence_Fast_GET_SIZE(sizes_fast);
        PyObject* groups = PyList_New(groups_count);
        bool made = found && subgraph && groups;
        for (Py_ssize_t i = 0; made && i < count; ++i) {
          PyObject* position = PyLong_FromSsize_t(s.found[size_t(i)]);
          if (position == nullptr) {
            made = false;
            break;
          }
          PyList_SET_ITEM(found, i, position);
          PyObject* flag = s.nodes[size_t(i)].subgraph ? Py_True : Py_False;
          Py_INCREF(flag);
          PyList_SET_ITEM(subgraph, i, flag);
        }
        Scratch scratch;
        size_t first = 0;
        for (Py_ssize_t g = 0; made && g < groups_count; ++g) {
          const Py_ssize_t size = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes_fast, g));
          if (size < 0 || first + size_t(size) > size_t(count)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sizes must be non-negative and add up to at most len(wanted)");
            made = false;
            break;
          }
          bool complete = s.error == nullptr;
          for (size_t f = first; complete && f < first + size_t(size); ++f) complete = s.found[f] >= 0;
          PyObject* item = complete ? summary(s, scratch, first, size_t(size)) : Py_None;
          if (item == nullptr) {
            made = false;
            break;
          }
          if (item == Py_None) Py_INCREF(item);
          PyList_SET_ITEM(groups, g, item);
          first += size_t(size);
        }
        if (made) result = PyTuple_Pack(4, s.error ? s.error : Py_None, found, subgraph, groups);
        Py_XDECREF(found);
        Py_XDECREF(subgraph);
        Py_XDECREF(groups);
      } else if (ready && !s.python_error) {
        raise_failure(s, base, false);
      }
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
      Py_XDECREF(result);
      result = nullptr;
    }
  }
  Py_XDECREF(wanted_fast);
  Py_XDECREF(sizes_fast);
  PyBuffer_Release(&view);
  return result;
}

PyMethodDef kMethods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, is_model, name_prefix=None, details=False) -> seven lists: op_types, domains, inputs, outputs, "
     "has_attributes, has_subgraph, and the node names starting with name_prefix; the first node with a name that is not "
     "UTF-8, or -1; and with details, per node (overload, attribute bytes), else None."},
    {"structure", structure, METH_VARARGS,
     "structure(data, is_model, wanted, sizes, outer) -> (error, found, subgraph, groups): the output guard's pass."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_scan", "Node-table scanner (see sgdfuse.passes.scan).", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&kModule); }
