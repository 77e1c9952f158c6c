// GE op reader: the ops of a serialised GE ``GraphDef`` as sgdfuse's lowering check reads them.
//
// A CPython extension module (``sgdfuse.lowering._opscan``), built on first use by sgdfuse/lowering/op_scan.py
// (which documents the API) with the node scanner's build (sgdfuse.passes.scan.build_extension). It gives
// exactly what the Python reader ``sgdfuse.lowering.parts._read_python_ops`` gives for the canonical bytes sgdfuse
// writes, and refuses (ValueError) whatever that reader would read by a path this one does not take, so the
// caller then runs the Python reader on the same bytes and gets its answer, or its error:
//
//   GraphDef: every field length-delimited with a one-byte tag; ``op`` = 6 (0x32), the others skipped.
//   OpDef: first its ``name`` = 1 (0x0a), ``type`` = 2 (0x12) and ``input`` = 5 (0x2a) fields, one-byte tags,
//          in any order (the last name and type win, inputs append); then the op's *body*, the bytes up to its
//          end (attributes, descriptors). A ``Data`` op's body without its ``index`` attribute: the entry cut
//          from the bytes when it is found once, as a top-level ``attr`` = 10 (0x52) entry after attr entries
//          only, holding one int64 ``i`` (the canonical layout); any other layout is refused.
//   An input "src:k" resolves to (the last op named src, or -2, k) with k an optional "-" and decimal digits
//   (anything else is refused: Python's int() has its own rules); "" to (-1, 0).
//
// Every read is bounds-checked; a name that is not valid UTF-8 is refused like the rest.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../passes/_wire.h"

#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

using sgdfuse_wire::Reader;

constexpr uint8_t kOpTag = 0x32, kNameTag = 0x0a, kTypeTag = 0x12, kInputTag = 0x2a, kAttrTag = 0x52;
constexpr char kIndexKey[] = "\x0a\x05index\x12";  // a map entry's key "index", then its value's tag
constexpr size_t kIndexKeySize = sizeof(kIndexKey) - 1;

struct Op {
  std::string_view name, type;
  size_t start = 0, end = 0;             // the op's bytes in the graph
  size_t body = 0;                        // where its body starts
  size_t cut_start = 0, cut_end = 0;      // a Data op's index entry, within the graph's bytes (empty: none)
  std::vector<std::string_view> inputs;
};

// A varint at p (at most ten bytes, within end); false when truncated or overlong.
bool varint(const uint8_t*& p, const uint8_t* end, uint64_t& out) {
  Reader r{p, end};
  if (!sgdfuse_wire::read_varint(r, out)) return false;
  p = r.p;
  return true;
}

std::string_view view(const uint8_t* p, size_t n) { return std::string_view(reinterpret_cast<const char*>(p), n); }

// The index entry of a Data op's body [body, end): its bounds when the canonical layout holds (module comment).
bool index_entry(const uint8_t* base, size_t body, size_t end, size_t& cut_start, size_t& cut_end) {
  const std::string_view bytes = view(base + body, end - body);
  const size_t at = bytes.find(std::string_view(kIndexKey, kIndexKeySize));
  if (at == std::string_view::npos || at < 2 || bytes.find(std::string_view(kIndexKey, kIndexKeySize), at + 1) != std::string_view::npos) return false;
  if (uint8_t(bytes[at - 2]) != kAttrTag) return false;
  const size_t entry = uint8_t(bytes[at - 1]);
  const size_t start = at - 2, stop = at + entry, value = at + kIndexKeySize;
  if (entry >= 0x80 || stop > bytes.size() || value + 1 >= bytes.size() || stop == 0) return false;
  if (uint8_t(bytes[value]) != entry - kIndexKeySize - 1 || uint8_t(bytes[value + 1]) != 0x18 || uint8_t(bytes[stop - 1]) >= 0x80) return false;
  // Only attr entries before it (canonical bytes list them first).
  const uint8_t* p = base + body;
  const uint8_t* cut = p + start;
  while (p < cut && *p == kAttrTag) {
    ++p;
    uint64_t length;
    if (!varint(p, base + end, length) || length > uint64_t(base + end - p)) return false;
    p += length;
  }
  if (p != cut) return false;
  cut_start = body + start;
  cut_end = body + stop;
  return true;
}

// The ops of the GraphDef bytes [base, base + size), or false when they are not laid out as the module comment says.
bool read_ops(const uint8_t* base, size_t size, std::vector<Op>& ops) {
  size_t top = 0;
  while (top < size) {
    if (top + 1 >= size) return false;
    const uint8_t tag = base[top];
    const uint8_t* p = base + top + 1;
    uint64_t length;
    if (!varint(p, base + size, length) || length > uint64_t(base + size - p)) return false;
    const size_t start = size_t(p - base), end = start + size_t(length);
    top = end;
    if (tag != kOpTag) continue;
    Op op;
    op.start = start;
    op.end = end;
    const uint8_t* q = base + start;
    const uint8_t* stop = base + end;
    while (q < stop && (*q == kNameTag || *q == kTypeTag || *q == kInputTag)) {
      const uint8_t field = *q++;
      uint64_t n;
      if (!varint(q, stop, n) || n > uint64_t(stop - q)) return false;
      const std::string_view text = view(q, size_t(n));
      q += n;
      if (field == kNameTag) {
        op.name = text;
      } else if (field == kTypeTag) {
        op.type = text;
      } else {
        op.inputs.push_back(text);
      }
    }
    op.body = size_t(q - base);
    if (op.type == "Data" && !index_entry(base, op.body, end, op.cut_start, op.cut_end)) return false;
    ops.push_back(std::move(op));
  }
  return true;
}

// "-?[0-9]+" as a long (at most 18 digits), else false.
bool edge_index(std::string_view text, long& out) {
  size_t k = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (negative) k = 1;
  if (k == text.size() || text.size() - k > 18) return false;
  long value = 0;
  for (; k < text.size(); ++k) {
    if (text[k] < '0' || text[k] > '9') return false;
    value = value * 10 + (text[k] - '0');
  }
  out = negative ? -value : value;
  return true;
}

PyObject* text(std::string_view s) { return PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "strict"); }

// Owns the references of the result while it is built.
struct Result {
  PyObject* names = nullptr;
  PyObject* spans = nullptr;
  PyObject* types = nullptr;
  PyObject* numbers = nullptr;
  PyObject* sources = nullptr;
  PyObject* position = nullptr;
  ~Result() {
    Py_XDECREF(names);
    Py_XDECREF(spans);
    Py_XDECREF(types);
    Py_XDECREF(numbers);
    Py_XDECREF(sources);
    Py_XDECREF(position);
  }
};

// Set item k of a new list, taking the reference (false when item is null).
bool put(PyObject* list, Py_ssize_t k, PyObject* item) {
  if (item == nullptr) return false;
  PyList_SET_ITEM(list, k, item);
  return true;
}

// A pair of Python ints as a new tuple (null on failure).
PyObject* pair(Py_ssize_t a, Py_ssize_t b) {
  PyObject* first = PyLong_FromSsize_t(a);
  PyObject* second = first ? PyLong_FromSsize_t(b) : nullptr;
  PyObject* result = second ? PyTuple_New(2) : nullptr;
  if (result == nullptr) {
    Py_XDECREF(first);
    Py_XDECREF(second);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, first);
  PyTuple_SET_ITEM(result, 1, second);
  return result;
}

// Body numbers: bodies (the caller's dict, (type, body bytes) -> number, shared by the graphs of a model) is
// asked once per distinct body of this graph; the other ops of that body find its number here, by the bytes
// themselves, without a Python object per op.
struct Numbers {
  PyObject* bodies;
  std::unordered_map<std::string, PyObject*> seen;  // type, NUL, body -> number (borrowed from bodies)
  std::string key;

  // The number of op's body (its type and its body's bytes, a Data op's without its index entry).
  PyObject* of(PyObject* type, const uint8_t* base, const Op& op) {
    key.assign(op.type.data(), op.type.size());
    key.push_back('\0');  // op types hold no NUL (they are GE op names), so type and body cannot run together
    if (op.cut_end > op.cut_start) {
      key.append(reinterpret_cast<const char*>(base + op.body), op.cut_start - op.body);
      key.append(reinterpret_cast<const char*>(base + op.cut_end), op.end - op.cut_end);
    } else {
      key.append(reinterpret_cast<const char*>(base + op.body), op.end - op.body);
    }
    const auto found = seen.find(key);
    if (found != seen.end()) {
      Py_INCREF(found->second);
      return found->second;
    }
    const size_t header = op.type.size() + 1;
    PyObject* body = PyBytes_FromStringAndSize(key.data() + header, Py_ssize_t(key.size() - header));
    if (body == nullptr) return nullptr;
    PyObject* entry = PyTuple_Pack(2, type, body);
    Py_DECREF(body);
    if (entry == nullptr) return nullptr;
    PyObject* number = PyDict_GetItemWithError(bodies, entry);
    if (number != nullptr) {
      Py_INCREF(number);
    } else if (!PyErr_Occurred()) {
      number = PyLong_FromSsize_t(PyDict_Size(bodies));
      if (number != nullptr && PyDict_SetItem(bodies, entry, number) != 0) Py_CLEAR(number);
    }
    Py_DECREF(entry);
    if (number != nullptr) seen.emplace(key, number);  // bodies holds it for as long as this call runs
    return number;
  }
};

// read(data, bodies) -> (names, spans, types, numbers, sources, position, net_output); ValueError when the bytes
// are not laid out as the module comment says.
PyObject* read(PyObject*, PyObject* args) {
  Py_buffer buffer;
  PyObject* bodies;
  if (!PyArg_ParseTuple(args, "y*O!", &buffer, &PyDict_Type, &bodies)) return nullptr;
  const uint8_t* base = static_cast<const uint8_t*>(buffer.buf);
  std::vector<Op> ops;
  PyObject* out = nullptr;
  try {
    if (!read_ops(base, size_t(buffer.len), ops)) {
      PyErr_SetString(PyExc_ValueError, "the GraphDef bytes are not laid out as the native reader reads them");
      PyBuffer_Release(&buffer);
      return nullptr;
    }
    // The last op of each name, as {name: k for k, name in enumerate(names)} keeps it.
    std::unordered_map<std::string_view, Py_ssize_t> last;
    last.reserve(ops.size() * 2);
    for (size_t k = 0; k < ops.size(); ++k) last[ops[k].name] = Py_ssize_t(k);
    // Every input resolved first: an edge this reader does not read is refused before any body is numbered.
    std::vector<std::vector<std::pair<Py_ssize_t, long>>> resolved(ops.size());
    for (size_t k = 0; k < ops.size(); ++k) {
      for (std::string_view edge : ops[k].inputs) {
        if (edge.empty()) {
          resolved[k].emplace_back(-1, 0);
          continue;
        }
        const size_t colon = edge.rfind(':');
        long index;
        if (colon == std::string_view::npos || !edge_index(edge.substr(colon + 1), index)) {
          PyErr_SetString(PyExc_ValueError, "an input edge the native reader does not read");
          PyBuffer_Release(&buffer);
          return nullptr;
        }
        const auto found = last.find(edge.substr(0, colon));
        if (found == last.end()) {
          // The Python reader decodes every edge: one naming no op must be valid UTF-8 too (a name that is one
          // op's is decoded as that op's name).
          PyObject* decoded = text(edge);
          if (decoded == nullptr) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "an input edge that is not UTF-8");
            PyBuffer_Release(&buffer);
            return nullptr;
          }
          Py_DECREF(decoded);
        }
        resolved[k].emplace_back(found == last.end() ? -2 : found->second, index);
      }
    }
    const Py_ssize_t count = Py_ssize_t(ops.size());
    Result r;
    r.names = PyList_New(count);
    r.spans = PyList_New(count);
    r.types = PyList_New(count);
    r.numbers = PyList_New(count);
    r.sources = PyList_New(count);
    r.position = PyDict_New();
    bool ok = r.names && r.spans && r.types && r.numbers && r.sources && r.position;
    std::unordered_map<std::string_view, PyObject*> type_objects;  // borrowed from r.types
    Py_ssize_t net_output = -1;
    // Names and types first: one that is not UTF-8 is refused before any body is numbered in bodies.
    for (Py_ssize_t k = 0; ok && k < count; ++k) {
      const Op& op = ops[size_t(k)];
      PyObject* name = text(op.name);
      ok = put(r.names, k, name);
      if (ok) {
        PyObject* number = PyLong_FromSsize_t(k);
        ok = number != nullptr && PyDict_SetItem(r.position, name, number) == 0;
        Py_XDECREF(number);
      }
      if (!ok) break;
      PyObject* type;
      const auto seen = type_objects.find(op.type);
      if (seen != type_objects.end()) {
        type = seen->second;
        Py_INCREF(type);
      } else {
        type = text(op.type);
        if (type != nullptr) {
          PyUnicode_InternInPlace(&type);
          type_objects.emplace(op.type, type);
        }
      }
      ok = put(r.types, k, type);
      if (ok && net_output < 0 && op.type == "NetOutput") net_output = k;
      ok = ok && put(r.spans, k, pair(Py_ssize_t(op.start), Py_ssize_t(op.end)));
    }
    Numbers numbers{bodies, {}, {}};
    for (Py_ssize_t k = 0; ok && k < count; ++k) {
      const Op& op = ops[size_t(k)];
      ok = put(r.numbers, k, numbers.of(PyList_GET_ITEM(r.types, k), base, op));
      if (!ok) break;
      const auto& edges = resolved[size_t(k)];
      PyObject* list = PyList_New(Py_ssize_t(edges.size()));
      ok = put(r.sources, k, list);
      for (size_t e = 0; ok && e < edges.size(); ++e) ok = put(list, Py_ssize_t(e), pair(edges[e].first, Py_ssize_t(edges[e].second)));
    }
    if (ok) out = Py_BuildValue("(OOOOOOn)", r.names, r.spans, r.types, r.numbers, r.sources, r.position, net_output);
    // An op name or type that is not UTF-8 is the Python reader's to refuse (it raises its own error).
    if (out == nullptr && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "an op name or type that is not UTF-8");
    }
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  }
  PyBuffer_Release(&buffer);
  return out;
}

PyMethodDef kMethods[] = {
    {"read", read, METH_VARARGS, "read(data, bodies) -> (names, spans, types, numbers, sources, position, net_output)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_opscan", "GE op reader (see sgdfuse.lowering.op_scan).", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__opscan(void) { return PyModule_Create(&kModule); }
