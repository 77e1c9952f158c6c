// Value-info scanner: reads the ValueInfoProtos of the main graph straight from a serialised ONNX ModelProto,
// and strips a model's labels before shape inference (strip, below).
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

#include <structmember.h>

#include "_pylist.h"
#include "_wire.h"

#include <cstdint>
#include <cstring>
#include <deque>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

using namespace sgdfuse_wire;

struct Table : Scan {
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
  bool python_error = false;
};

using sgdfuse_py::append;  // _pylist.h

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
  return scan_length_delimited(t, r, 7, [&t](Reader graph) { return scan_graph(t, graph); });
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

// --- strip(data): the model without what shape inference never reads -------------------------------------
//
// ONNX shape inference types values from op types, domains, inputs, outputs, attributes, the graph's inputs,
// outputs, value infos and initializers, and the opset imports and functions; a node's name (NodeProto field
// 3), doc_string (6) and metadata_props (9), the graph's doc_string (10) and metadata_props (16), and the
// model's doc_string (6) and metadata_props (14) only label them (an exporter's stack traces, say), yet
// inference parses and copies them, and hands them back. Every other field is copied byte for byte, in order,
// and a graph given twice stays two (protobuf merges them as before). Subgraphs (inside attributes) are copied
// as they are.

struct Stripper : Scan {};

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(char(uint8_t(value) | 0x80));
    value >>= 7;
  }
  out.push_back(char(uint8_t(value)));
}

// Copy the fields of the message in r to out, dropping the length-delimited fields for which drop(field) is
// true and passing those for which nested(field) is true through rewrite(payload, out_payload).
template <class Drop, class Nested, class Rewrite>
bool copy_fields(Stripper& t, Reader r, std::string& out, Drop&& drop, Nested&& nested, Rewrite&& rewrite) {
  while (r.p < r.end) {
    const uint8_t* start = r.p;
    uint32_t field;
    int wire_type;
    if (!read_tag(t, r, field, wire_type)) return false;
    if (wire_type == 2 && (drop(field) || nested(field))) {
      Reader payload;
      if (!read_bytes(t, r, payload)) return false;
      if (drop(field)) continue;
      std::string inner;
      if (!rewrite(payload, inner)) return false;
      put_varint(out, (uint64_t(field) << 3) | 2);
      put_varint(out, inner.size());
      out.append(inner);
      continue;
    }
    if (!skip_field(t, r, field, wire_type, 0)) return false;
    out.append(reinterpret_cast<const char*>(start), size_t(r.p - start));
  }
  return true;
}

bool strip_node(Stripper& t, Reader r, std::string& out) {
  out.reserve(size_t(r.end - r.p));
  return copy_fields(
      t, r, out, [](uint32_t f) { return f == 3 || f == 6 || f == 9; }, [](uint32_t) { return false; },
      [](Reader, std::string&) { return true; });
}

bool strip_graph(Stripper& t, Reader r, std::string& out) {
  out.reserve(size_t(r.end - r.p));
  return copy_fields(
      t, r, out, [](uint32_t f) { return f == 10 || f == 16; }, [](uint32_t f) { return f == 1; },
      [&t](Reader node, std::string& inner) { return strip_node(t, node, inner); });
}

// strip(data) -> bytes: the serialised ModelProto ``data`` without the fields above.
PyObject* strip(PyObject*, PyObject* args) {
  Py_buffer view;
  if (!PyArg_ParseTuple(args, "y*", &view)) return nullptr;
  Stripper t;
  const uint8_t* base = static_cast<const uint8_t*>(view.buf);
  PyObject* result = nullptr;
  try {
    std::string out;
    out.reserve(size_t(view.len));
    const bool done = copy_fields(
        t, Reader{base, base + view.len}, out, [](uint32_t f) { return f == 6 || f == 14; }, [](uint32_t f) { return f == 7; },
        [&t](Reader graph, std::string& inner) { return strip_graph(t, graph, inner); });
    if (done) {
      result = PyBytes_FromStringAndSize(out.data(), Py_ssize_t(out.size()));
    } else {
      const Py_ssize_t offset = t.failure.at ? Py_ssize_t(t.failure.at - base) : 0;
      PyErr_Format(PyExc_ValueError, "malformed protobuf at byte %zd: %s", offset, t.failure.reason);
    }
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  }
  PyBuffer_Release(&view);
  return result;
}

// --- add_specs and sweep: the index's tables, built from what the scanners return ------------------------
//
// sgdfuse.passes.index builds two tables per model from lists the scanners made: the specs (value name ->
// TensorSpec, half a million entries at 50,000 updates) and the producer and consumers of every value (from
// the node table). The loops below are those of index._add_scanned_specs and index._sweep_nodes, step for
// step (the same dictionary operations in the same order, so the same dictionaries, their order included);
// value_scan.py documents them and keeps the Python loops as the fallback.

// The byte offset of a slot of ``type`` named ``name`` (a member descriptor of an object slot), or -1.
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  PyObject* descriptor = PyDict_GetItemString(type->tp_dict, name);  // borrowed
  if (descriptor == nullptr || !Py_IS_TYPE(descriptor, &PyMemberDescr_Type)) return -1;
  PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member;
  if (member->type != T_OBJECT_EX || (member->flags & READONLY)) return -1;
  return member->offset;
}

PyObject*& slot(PyObject* object, Py_ssize_t offset) { return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(object) + offset); }

// add_specs(specs, names, type_ids, found_of, spec_type) -> None: for each names[i] whose spec in ``specs`` is
// missing or has shape None, and whose found_of[type_ids[i]] is a (shape, dtype) pair (not None), set
// specs[names[i]] = spec_type(names[i], shape, dtype). spec_type is a slots class whose instances are its three
// slots name, shape and dtype (TensorSpec: a frozen slots dataclass, whose __init__ only sets them); it is
// made as object.__new__ makes it and its slots set directly.
PyObject* add_specs(PyObject*, PyObject* args) {
  PyObject *specs, *names, *type_ids, *found_of;
  PyTypeObject* spec_type;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyDict_Type, &specs, &PyList_Type, &names, &PyList_Type, &type_ids, &PyList_Type,
                        &found_of, &PyType_Type, &spec_type))
    return nullptr;
  const Py_ssize_t name_at = slot_offset(spec_type, "name"), shape_at = slot_offset(spec_type, "shape"),
                   dtype_at = slot_offset(spec_type, "dtype");
  if (name_at < 0 || shape_at < 0 || dtype_at < 0 || spec_type->tp_itemsize != 0) {
    PyErr_SetString(PyExc_TypeError, "add_specs: spec_type must have the object slots name, shape and dtype");
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(names);
  if (PyList_GET_SIZE(type_ids) != count) {
    PyErr_SetString(PyExc_ValueError, "add_specs: names and type_ids differ in length");
    return nullptr;
  }
  const Py_ssize_t kinds = PyList_GET_SIZE(found_of);
  for (Py_ssize_t i = 0; i < kinds; ++i) {
    PyObject* found = PyList_GET_ITEM(found_of, i);
    if (found != Py_None && !(PyTuple_CheckExact(found) && PyTuple_GET_SIZE(found) == 2)) {
      PyErr_SetString(PyExc_TypeError, "add_specs: found_of holds a (shape, dtype) pair or None per type");
      return nullptr;
    }
  }
  PyObject* shape_name = PyUnicode_InternFromString("shape");
  if (shape_name == nullptr) return nullptr;
  bool failed = false;
  for (Py_ssize_t i = 0; i < count && !failed; ++i) {
    PyObject* name = PyList_GET_ITEM(names, i);
    PyObject* known = PyDict_GetItemWithError(specs, name);  // borrowed
    if (known == nullptr && PyErr_Occurred()) {
      failed = true;
      break;
    }
    if (known != nullptr && known != Py_None) {
      bool shaped;
      if (Py_IS_TYPE(known, spec_type)) {
        PyObject* shape = slot(known, shape_at);
        shaped = shape != nullptr && shape != Py_None;
      } else {
        PyObject* shape = PyObject_GetAttr(known, shape_name);
        if (shape == nullptr) {
          failed = true;
          break;
        }
        shaped = shape != Py_None;
        Py_DECREF(shape);
      }
      if (shaped) continue;
    }
    const Py_ssize_t type_id = PyLong_AsSsize_t(PyList_GET_ITEM(type_ids, i));
    if (type_id == -1 && PyErr_Occurred()) {
      failed = true;
      break;
    }
    if (type_id < 0 || type_id >= kinds) {
      PyErr_SetString(PyExc_IndexError, "add_specs: a type number past found_of");
      failed = true;
      break;
    }
    PyObject* found = PyList_GET_ITEM(found_of, type_id);
    if (found == Py_None) continue;
    PyObject* spec = spec_type->tp_alloc(spec_type, 0);
    if (spec == nullptr) {
      failed = true;
      break;
    }
    PyObject* shape = PyTuple_GET_ITEM(found, 0);
    PyObject* dtype = PyTuple_GET_ITEM(found, 1);
    Py_INCREF(name);
    Py_INCREF(shape);
    Py_INCREF(dtype);
    slot(spec, name_at) = name;
    slot(spec, shape_at) = shape;
    slot(spec, dtype_at) = dtype;
    failed = PyDict_SetItem(specs, name, spec) != 0;
    Py_DECREF(spec);
  }
  Py_DECREF(shape_name);
  if (failed) return nullptr;
  Py_RETURN_NONE;
}

// sweep(nodes) -> (producer, consumers, holders, defined, text): over the node facts ``nodes`` (a list of
// tuples (op_type, domain, inputs, outputs, has_subgraph, has_attributes), inputs and outputs tuples of names),
// in order: producer[name] = k for each non-empty output name of node k, consumers[name] gets k appended for
// each non-empty input name (a new list at the first), holders the k whose has_subgraph is true, defined the
// number of non-empty output names; text is true when every op type, domain and non-empty name is a str.
PyObject* sweep(PyObject*, PyObject* args) {
  PyObject* nodes;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &nodes)) return nullptr;
  PyObject* producer = PyDict_New();
  PyObject* consumers = PyDict_New();
  PyObject* holders = PyList_New(0);
  bool failed = producer == nullptr || consumers == nullptr || holders == nullptr;
  Py_ssize_t defined = 0;
  bool text = true;
  const Py_ssize_t count = PyList_GET_SIZE(nodes);
  auto nonempty = [&failed, &text](PyObject* name) -> bool {
    if (PyUnicode_CheckExact(name)) return PyUnicode_GET_LENGTH(name) != 0;
    const int truth = PyObject_IsTrue(name);
    if (truth > 0) text = false;
    if (truth < 0) failed = true;
    return truth > 0;
  };
  for (Py_ssize_t k = 0; k < count && !failed; ++k) {
    PyObject* facts = PyList_GET_ITEM(nodes, k);
    if (!PyTuple_Check(facts) || PyTuple_GET_SIZE(facts) != 6 || !PyTuple_Check(PyTuple_GET_ITEM(facts, 2)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(facts, 3))) {
      PyErr_SetString(PyExc_TypeError, "sweep: a node's facts are a 6-tuple with tuples of inputs and outputs");
      failed = true;
      break;
    }
    if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(facts, 0)) || !PyUnicode_CheckExact(PyTuple_GET_ITEM(facts, 1))) text = false;
    PyObject* position = PyLong_FromSsize_t(k);
    if (position == nullptr) {
      failed = true;
      break;
    }
    PyObject* outputs = PyTuple_GET_ITEM(facts, 3);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(outputs) && !failed; ++j) {
      PyObject* name = PyTuple_GET_ITEM(outputs, j);
      if (nonempty(name)) {
        failed = PyDict_SetItem(producer, name, position) != 0;
        ++defined;
      }
    }
    PyObject* inputs = PyTuple_GET_ITEM(facts, 2);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(inputs) && !failed; ++j) {
      PyObject* name = PyTuple_GET_ITEM(inputs, j);
      if (!nonempty(name) || failed) continue;
      PyObject* readers = PyDict_GetItemWithError(consumers, name);  // borrowed
      if (readers != nullptr) {
        failed = PyList_Append(readers, position) != 0;
      } else if (PyErr_Occurred()) {
        failed = true;
      } else {
        PyObject* fresh = PyList_New(1);
        if (fresh == nullptr) {
          failed = true;
        } else {
          Py_INCREF(position);
          PyList_SET_ITEM(fresh, 0, position);
          failed = PyDict_SetItem(consumers, name, fresh) != 0;
          Py_DECREF(fresh);
        }
      }
    }
    if (!failed) {
      const int held = PyObject_IsTrue(PyTuple_GET_ITEM(facts, 4));
      if (held < 0) failed = true;
      else if (held) failed = PyList_Append(holders, position) != 0;
    }
    Py_DECREF(position);
  }
  if (failed) {
    Py_XDECREF(producer);
    Py_XDECREF(consumers);
    Py_XDECREF(holders);
    return nullptr;
  }
  return Py_BuildValue("NNNnO", producer, consumers, holders, defined, text ? Py_True : Py_False);
}

PyMethodDef kMethods[] = {
    {"scan", scan, METH_VARARGS, "scan(data, wanted) -> (names, type_ids, types, node_count)."},
    {"strip", strip, METH_VARARGS, "strip(data) -> the model's bytes without the fields shape inference never reads."},
    {"add_specs", add_specs, METH_VARARGS, "add_specs(specs, names, type_ids, found_of, spec_type) -> None: index._add_scanned_specs's loop."},
    {"sweep", sweep, METH_VARARGS, "sweep(nodes) -> (producer, consumers, holders, defined, text): index._sweep_nodes's loop."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_vscan", "Value-info scanner (see sgdfuse.passes.value_scan).", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__vscan(void) { return PyModule_Create(&kModule); }
