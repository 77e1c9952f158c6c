// Native writer of replayed plan nodes (see sgdfuse.passes.rewrite._write_nodes and _Replay.wire, its Python
// reference): the serialised NodeProtos of a run of (replay, j) entries, each as a GraphProto.node entry
// (field 1), so that one GraphProto.MergeFromString appends them all.
//
// A node's bytes are its fields in number order, as protobuf serialises the node _Replay.write makes: each
// input (field 1), each output (field 2), the name (field 3, present even when empty), each renamed through
// the replay's names (a dict; a name not in it stays), then the template's bytes of every other field (the
// stripped node serialised, whose fields are numbered 4 and up).
#include <Python.h>

#include <string>

namespace {

void put_varint(std::string& out, size_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

// Append field `tag` (a length-delimited field's key byte) holding `name` renamed through `names`.
bool put_name(std::string& out, char tag, PyObject* name, PyObject* names) {
  PyObject* renamed = PyDict_GetItemWithError(names, name);  // borrowed
  if (renamed == nullptr) {
    if (PyErr_Occurred()) return false;
    renamed = name;
  }
  if (!PyUnicode_Check(renamed)) {
    PyErr_SetString(PyExc_TypeError, "a node name is not a str");
    return false;
  }
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(renamed, &size);
  if (data == nullptr) return false;
  out.push_back(tag);
  put_varint(out, static_cast<size_t>(size));
  out.append(data, static_cast<size_t>(size));
  return true;
}

bool put_names(std::string& out, char tag, PyObject* list, PyObject* names) {
  if (!PyTuple_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "a template node's names are not a tuple");
    return false;
  }
  const Py_ssize_t count = PyTuple_GET_SIZE(list);
  for (Py_ssize_t k = 0; k < count; ++k) {
    if (!put_name(out, tag, PyTuple_GET_ITEM(list, k), names)) return false;
  }
  return true;
}

// node_wires(items) -> bytes. items: a list of (replay, j); replay.template.wire_nodes[j] is
// (tail: bytes, name: str, inputs: tuple[str], outputs: tuple[str]) and replay.names the renaming.
PyObject* node_wires(PyObject*, PyObject* args) {
  PyObject* items = nullptr;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &items)) return nullptr;
  std::string out;
  std::string body;
  PyObject* last = nullptr;  // the replay whose wire_nodes and names are held (entries of one plan follow one another)
  PyObject* nodes = nullptr;
  PyObject* names = nullptr;
  bool ok = true;
  const Py_ssize_t count = PyList_GET_SIZE(items);
  for (Py_ssize_t i = 0; i < count && ok; ++i) {
    PyObject* item = PyList_GET_ITEM(items, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
      PyErr_SetString(PyExc_TypeError, "an entry is not a (replay, j) tuple");
      ok = false;
      break;
    }
    PyObject* replay = PyTuple_GET_ITEM(item, 0);
    if (replay != last) {
      Py_XDECREF(nodes);
      Py_XDECREF(names);
      nodes = names = nullptr;
      last = nullptr;
      PyObject* templ = PyObject_GetAttrString(replay, "template");
      if (templ == nullptr) { ok = false; break; }
      nodes = PyObject_GetAttrString(templ, "wire_nodes");
      Py_DECREF(templ);
      names = PyObject_GetAttrString(replay, "names");
      if (nodes == nullptr || names == nullptr) { ok = false; break; }
      if (!PyTuple_Check(nodes) || !PyDict_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "a replay's template.wire_nodes is not a tuple or its names not a dict");
        ok = false;
        break;
      }
      last = replay;
    }
    const Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
    if (j == -1 && PyErr_Occurred()) { ok = false; break; }
    if (j < 0 || j >= PyTuple_GET_SIZE(nodes)) {
      PyErr_SetString(PyExc_IndexError, "a node index is out of its template");
      ok = false;
      break;
    }
    PyObject* node = PyTuple_GET_ITEM(nodes, j);
    if (!PyTuple_Check(node) || PyTuple_GET_SIZE(node) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(node, 0))) {
      PyErr_SetString(PyExc_TypeError, "a template node is not (tail, name, inputs, outputs)");
      ok = false;
      break;
    }
    body.clear();
    ok = put_names(body, '\x0a', PyTuple_GET_ITEM(node, 2), names) && put_names(body, '\x12', PyTuple_GET_ITEM(node, 3), names) &&
         put_name(body, '\x1a', PyTuple_GET_ITEM(node, 1), names);
    if (!ok) break;
    PyObject* tail = PyTuple_GET_ITEM(node, 0);
    body.append(PyBytes_AS_STRING(tail), static_cast<size_t>(PyBytes_GET_SIZE(tail)));
    out.push_back('\x0a');
    put_varint(out, body.size());
    out.append(body);
  }
  Py_XDECREF(nodes);
  Py_XDECREF(names);
  if (!ok) return nullptr;
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

PyMethodDef kMethods[] = {
    {"node_wires", node_wires, METH_VARARGS, "node_wires(items) -> the GraphProto.node entries of (replay, j) items, serialised."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_splice", "Replayed-node writer (see sgdfuse.passes.rewrite._write_nodes).", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__splice(void) { return PyModule_Create(&kModule); }
