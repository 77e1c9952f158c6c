// Region walk of the structural classes (sgdfuse/passes/classes.py), over the same Python objects.
//
// A CPython extension module (``sgdfuse.passes._classes``), built on first use by sgdfuse/passes/classes.py
// (through sgdfuse.passes.scan.build_extension). Each function here is a line-for-line port of a pure-Python
// function of classes.py that stays there as the fallback:
//
//   steps(nodes, entered_ops, direct_ops, copy_ops, default_domains)   == classes._steps_python
//   walk(outputs, behind_copies, steps, leaf_step, listed, walked, nothing, max_walk, max_region,
//        too_large, not_one, links)                                    == classes._walk_regions_python (core)
//   union(outputs, appearances, links, one_element_readers)            == classes._union_python
//   key_columns(computed, starts, referred, listed, local)             == the columns of classes._key_together
//   key_clusters(clusters, ...)                                        == the loop of classes._key_together
//   facts(values, steps, ...)                                          == classes._Walker.facts_python
//   cluster_values(clusters, regions, steps, fringes, shared, listed)  == classes._values of each cluster
//
// They build the same dicts, lists, sets and tuples in the same insertion order, with the same objects in
// them (names, inputs tuples and kinds are the caller's objects, not copies), so everything downstream reads
// the same values (tests/test_classes_native.py compares both on the committed models and generated steps).
// Nothing here interprets a name: the speed comes from running the loops without the interpreter, the
// look-ups themselves are CPython's dict and set operations.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace {

// An owned reference, released at scope exit.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& other) noexcept : p(other.p) { other.p = nullptr; }
  Ref& operator=(Ref&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
  void reset(PyObject* o) {
    Py_XDECREF(p);
    p = o;
  }
  explicit operator bool() const { return p != nullptr; }
};

// A non-empty str (the walk's ``if name:``); any other truthy object counts as well, as in Python.
inline int truthy(PyObject* o) {
  if (PyUnicode_CheckExact(o)) return PyUnicode_GET_LENGTH(o) != 0;
  return PyObject_IsTrue(o);
}

// Append ``o`` to the list at ``key`` of ``table`` (a dict of lists), making the list when missing.
inline bool append_at(PyObject* table, PyObject* key, PyObject* o) {
  PyObject* list = PyDict_GetItemWithError(table, key);  // borrowed
  if (list == nullptr) {
    if (PyErr_Occurred()) return false;
    Ref made(PyList_New(0));
    if (!made || PyDict_SetItem(table, key, made.get()) != 0) return false;
    list = made.get();
    return PyList_Append(list, o) == 0;
  }
  return PyList_Append(list, o) == 0;
}

// steps(nodes, entered_ops, direct_ops, copy_ops, default_domains) -> (steps, copies): classes._steps_python.
PyObject* steps(PyObject*, PyObject* args) {
  PyObject *nodes, *entered_ops, *direct_ops, *copy_ops, *default_domains;
  if (!PyArg_ParseTuple(args, "O!OOOO", &PyList_Type, &nodes, &entered_ops, &direct_ops, &copy_ops, &default_domains))
    return nullptr;
  Ref result_steps(PyDict_New()), copies(PySet_New(nullptr)), ops(PyDict_New()), kinds(PyDict_New());
  Ref empty(PyTuple_New(0)), node_word(PyUnicode_InternFromString("node")), computed_word(PyUnicode_InternFromString("computed"));
  Ref no_bytes(PyBytes_FromStringAndSize("", 0)), zero(PyLong_FromLong(0)), one(PyLong_FromLong(1));
  if (!result_steps || !copies || !ops || !kinds || !empty || !node_word || !computed_word || !no_bytes || !zero || !one)
    return nullptr;
  // kinds.setdefault(kind, kind): the interned kind (a new reference).
  auto interned = [&](PyObject* kind) -> PyObject* {
    PyObject* found = PyDict_SetDefault(kinds.get(), kind, kind);  // borrowed
    Py_XINCREF(found);
    return found;
  };
  const Py_ssize_t count = PyList_GET_SIZE(nodes);
  for (Py_ssize_t k = 0; k < count; ++k) {
    PyObject* facts = PyList_GET_ITEM(nodes, k);
    if (!PyTuple_Check(facts) || PyTuple_GET_SIZE(facts) != 6) {
      PyErr_Format(PyExc_TypeError, "node facts %zd: expected a 6-tuple", k);
      return nullptr;
    }
    PyObject* op = PyTuple_GET_ITEM(facts, 0);
    PyObject* domain = PyTuple_GET_ITEM(facts, 1);
    PyObject* inputs = PyTuple_GET_ITEM(facts, 2);
    PyObject* outputs = PyTuple_GET_ITEM(facts, 3);
    PyObject* subgraph = PyTuple_GET_ITEM(facts, 4);
    const int has_attributes = PyObject_IsTrue(PyTuple_GET_ITEM(facts, 5));
    if (has_attributes < 0) return nullptr;
    Ref op_key(PyTuple_Pack(2, op, domain));
    if (!op_key) return nullptr;
    PyObject* known = PyDict_GetItemWithError(ops.get(), op_key.get());  // borrowed
    if (known == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      const int in_entered = PySequence_Contains(entered_ops, op);
      const int in_default = in_entered == 1 ? PySequence_Contains(default_domains, domain) : 0;
      const int in_direct = PySequence_Contains(direct_ops, op);
      const int in_copy = PySequence_Contains(copy_ops, op);
      if (in_entered < 0 || in_default < 0 || in_direct < 0 || in_copy < 0) return nullptr;
      const bool entered = in_entered == 1 && in_default == 1;
      Ref single(PyTuple_Pack(6, entered ? node_word.get() : computed_word.get(), op, domain, zero.get(), one.get(), no_bytes.get()));
      if (!single) return nullptr;
      Ref kind(interned(single.get()));
      if (!kind) return nullptr;
      Ref made(PyTuple_Pack(4, entered ? Py_True : Py_False, in_direct ? Py_True : Py_False, kind.get(), in_copy ? Py_True : Py_False));
      if (!made || PyDict_SetItem(ops.get(), op_key.get(), made.get()) != 0) return nullptr;
      known = made.get();  // the dict holds it
    }
    const bool entered = PyTuple_GET_ITEM(known, 0) == Py_True;
    PyObject* direct = PyTuple_GET_ITEM(known, 1) == Py_True ? Py_True : subgraph;  // direct or subgraph
    PyObject* kind = PyTuple_GET_ITEM(known, 2);
    const bool copy = PyTuple_GET_ITEM(known, 3) == Py_True;
    Ref fast(PySequence_Fast(outputs, "node outputs must be a sequence"));
    if (!fast) return nullptr;
    const Py_ssize_t n_out = PySequence_Fast_GET_SIZE(fast.get());
    PyObject** out = PySequence_Fast_ITEMS(fast.get());
    if (copy) {
      for (Py_ssize_t j = 0; j < n_out; ++j)
        if (PySet_Add(copies.get(), out[j]) != 0) return nullptr;
    }
    Ref index(PyLong_FromSsize_t(k));
    if (!index) return nullptr;
    if (n_out == 1) {
      PyObject* name = out[0];
      const int named = truthy(name);
      if (named < 0) return nullptr;
      if (named) {
        Ref step(entered ? PyTuple_Pack(5, index.get(), inputs, direct, empty.get(), has_attributes ? Py_None : kind)
                         : PyTuple_Pack(5, Py_None, empty.get(), direct, inputs, kind));
        if (!step || PyDict_SetItem(result_steps.get(), name, step.get()) != 0) return nullptr;
      }
      continue;
    }
    Ref n_out_object(PyLong_FromSsize_t(n_out));
    if (!n_out_object) return nullptr;
    for (Py_ssize_t j = 0; j < n_out; ++j) {
      PyObject* name = out[j];
      const int named = truthy(name);
      if (named < 0) return nullptr;
      if (!named) continue;
      Ref this_kind;
      if (entered && has_attributes) {
        Py_INCREF(Py_None);
        this_kind.reset(Py_None);
      } else {
        Py_ssize_t first = 0;  // outputs.index(name)
        for (; first < n_out; ++first) {
          const int same = PyObject_RichCompareBool(out[first], name, Py_EQ);
          if (same < 0) return nullptr;
          if (same) break;
        }
        Ref position(PyLong_FromSsize_t(first));
        if (!position) return nullptr;
        Ref made(PyTuple_Pack(6, entered ? node_word.get() : computed_word.get(), op, domain, position.get(), n_out_object.get(), no_bytes.get()));
        if (!made) return nullptr;
        this_kind.reset(interned(made.get()));
        if (!this_kind) return nullptr;
      }
      Ref step(entered ? PyTuple_Pack(5, index.get(), inputs, direct, empty.get(), this_kind.get())
                       : PyTuple_Pack(5, Py_None, empty.get(), direct, inputs, this_kind.get()));
      if (!step || PyDict_SetItem(result_steps.get(), name, step.get()) != 0) return nullptr;
    }
  }
  return PyTuple_Pack(2, result_steps.get(), copies.get());
}

// walk(outputs, behind_copies, steps, leaf_step, listed, walked, nothing, max_walk, max_region, too_large,
//      not_one, links) -> (regions, steps_of, fringes, direct, appearances, leaves): the loop of
// classes._walk_regions_python over the outputs, later outputs first. ``not_one(o)``: the output is not one
// element (asked only of an output some region walked already); ``links(name)``: whether a value only listed
// links its region (asked once per fringe value, the caller caches). Raises ``too_large(o)`` past max_walk.
PyObject* walk(PyObject*, PyObject* args) {
  PyObject *outputs, *behind_copies, *steps_table, *leaf_step, *listed_word, *walked_word, *nothing, *too_large, *not_one, *links;
  Py_ssize_t max_walk, max_region;
  if (!PyArg_ParseTuple(args, "O!O!O!O!OOOnnOOO", &PyList_Type, &outputs, &PyDict_Type, &behind_copies, &PyDict_Type, &steps_table,
                        &PyTuple_Type, &leaf_step, &listed_word, &walked_word, &nothing, &max_walk, &max_region, &too_large, &not_one, &links))
    return nullptr;
  Ref regions(PyDict_New()), steps_of(PyDict_New()), fringes(PyDict_New()), direct(PySet_New(nullptr)), appearances(PyDict_New()),
      leaves(PyDict_New());
  if (!regions || !steps_of || !fringes || !direct || !appearances || !leaves) return nullptr;
  // Borrowed: every name on it is held by the outputs list or by a step's inputs tuple in ``steps``.
  std::vector<PyObject*> stack;
  for (Py_ssize_t i = PyList_GET_SIZE(outputs) - 1; i >= 0; --i) {
    PyObject* o = PyList_GET_ITEM(outputs, i);
    // behind = steps.get(behind_copies[o]); past its copies, an op the walk does not enter.
    PyObject* behind_name = PyDict_GetItemWithError(behind_copies, o);
    if (behind_name == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, o);
      return nullptr;
    }
    PyObject* behind = PyDict_GetItemWithError(steps_table, behind_name);
    if (behind == nullptr && PyErr_Occurred()) return nullptr;
    if (behind != nullptr && PyTuple_GET_ITEM(behind, 0) == Py_None) {
      if (PySet_Add(direct.get(), o) != 0) return nullptr;
    }
    // _walked_in(o, appearances.get(o), fringes)
    bool walked_in = false;
    PyObject* readers = PyDict_GetItemWithError(appearances.get(), o);
    if (readers == nullptr && PyErr_Occurred()) return nullptr;
    if (readers != nullptr) {
      for (Py_ssize_t r = 0; r < PyList_GET_SIZE(readers); ++r) {
        PyObject* fringe = PyDict_GetItemWithError(fringes.get(), PyList_GET_ITEM(readers, r));
        if (fringe == nullptr) {
          if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyList_GET_ITEM(readers, r));
          return nullptr;
        }
        const int in = PySequence_Contains(fringe, o);
        if (in < 0) return nullptr;
        if (!in) {
          walked_in = true;
          break;
        }
      }
    }
    if (walked_in) {
      Ref answer(PyObject_CallOneArg(not_one, o));
      if (!answer) return nullptr;
      const int is_not_one = PyObject_IsTrue(answer.get());
      if (is_not_one < 0) return nullptr;
      if (is_not_one) {
        if (PyDict_SetItem(regions.get(), o, Py_None) != 0 || PyDict_SetItem(fringes.get(), o, nothing) != 0) return nullptr;
        if (!append_at(appearances.get(), o, o)) return nullptr;
        continue;
      }
    }
    Ref seen(PyDict_New()), listed(PyList_New(0)), found_leaves(PyList_New(0));
    if (!seen || !listed || !found_leaves) return nullptr;
    if (PyDict_SetItem(seen.get(), o, walked_word) != 0) return nullptr;
    stack.push_back(o);
    bool must = false;
    if (!append_at(appearances.get(), o, o)) return nullptr;
    while (!stack.empty()) {
      PyObject* const name_popped = stack.back();
      stack.pop_back();
      Py_INCREF(name_popped);
      Ref value(name_popped);
      PyObject* step = PyDict_GetItemWithError(steps_table, value.get());
      if (step == nullptr) {
        if (PyErr_Occurred()) return nullptr;
        step = leaf_step;
      }
      if (PyDict_SetItem(seen.get(), value.get(), step) != 0) return nullptr;
      if (PyTuple_GET_ITEM(step, 0) == Py_None && PyList_Append(found_leaves.get(), value.get()) != 0) return nullptr;
      const int makes_direct = PyObject_IsTrue(PyTuple_GET_ITEM(step, 2));
      if (makes_direct < 0) return nullptr;
      if (makes_direct) must = true;
      Ref inputs(PySequence_Fast(PyTuple_GET_ITEM(step, 1), "step inputs must be a sequence"));
      if (!inputs) return nullptr;
      const Py_ssize_t n_in = PySequence_Fast_GET_SIZE(inputs.get());
      PyObject** in = PySequence_Fast_ITEMS(inputs.get());
      for (Py_ssize_t j = 0; j < n_in; ++j) {
        PyObject* name = in[j];
        const int named = truthy(name);
        if (named < 0) return nullptr;
        if (!named) continue;
        PyObject* was = PyDict_GetItemWithError(seen.get(), name);
        if (was == nullptr && PyErr_Occurred()) return nullptr;
        if (was == nullptr || was == listed_word) {
          if (PyDict_SetItem(seen.get(), name, walked_word) != 0) return nullptr;
          stack.push_back(name);
          if (!append_at(appearances.get(), name, o)) return nullptr;
        }
      }
      Ref operands(PySequence_Fast(PyTuple_GET_ITEM(step, 3), "step operands must be a sequence"));
      if (!operands) return nullptr;
      const Py_ssize_t n_op = PySequence_Fast_GET_SIZE(operands.get());
      PyObject** op = PySequence_Fast_ITEMS(operands.get());
      for (Py_ssize_t j = 0; j < n_op; ++j) {
        PyObject* name = op[j];
        const int named = truthy(name);
        if (named < 0) return nullptr;
        if (!named) continue;
        const int in_seen = PyDict_Contains(seen.get(), name);
        if (in_seen < 0) return nullptr;
        if (!in_seen) {
          if (PyDict_SetItem(seen.get(), name, listed_word) != 0 || PyList_Append(listed.get(), name) != 0) return nullptr;
        }
      }
      if (PyDict_GET_SIZE(seen.get()) > max_walk) {
        PyErr_SetObject(too_large, o);
        return nullptr;
      }
    }
    Ref order(PyDict_Keys(seen.get())), values(PyDict_Values(seen.get()));
    if (!order || !values) return nullptr;
    Ref fringe;
    if (PyList_GET_SIZE(listed.get()) > 0) {
      fringe.reset(PySet_New(nullptr));
      if (!fringe) return nullptr;
      for (Py_ssize_t j = 0; j < PyList_GET_SIZE(listed.get()); ++j) {
        PyObject* name = PyList_GET_ITEM(listed.get(), j);
        if (PyDict_GetItemWithError(seen.get(), name) == listed_word && PySet_Add(fringe.get(), name) != 0) return nullptr;
        if (PyErr_Occurred()) return nullptr;
      }
    } else {
      Py_INCREF(nothing);
      fringe.reset(nothing);
    }
    const Py_ssize_t size = PyList_GET_SIZE(order.get());
    if (PyDict_SetItem(regions.get(), o, order.get()) != 0 || PyDict_SetItem(steps_of.get(), o, values.get()) != 0 ||
        PyDict_SetItem(fringes.get(), o, fringe.get()) != 0 || PyDict_SetItem(leaves.get(), o, found_leaves.get()) != 0)
      return nullptr;
    if ((must || size > max_region) && PySet_Add(direct.get(), o) != 0) return nullptr;
    if (fringe.get() != nothing) {
      // Python iterates the fringe set; the same set object, the same order.
      Ref iterator(PyObject_GetIter(fringe.get()));
      if (!iterator) return nullptr;
      while (PyObject* name = PyIter_Next(iterator.get())) {
        Ref held(name);
        Ref answer(PyObject_CallOneArg(links, name));
        if (!answer) return nullptr;
        const int linked = PyObject_IsTrue(answer.get());
        if (linked < 0) return nullptr;
        if (linked && !append_at(appearances.get(), name, o)) return nullptr;
      }
      if (PyErr_Occurred()) return nullptr;
    }
  }
  return PyTuple_Pack(6, regions.get(), steps_of.get(), fringes.get(), direct.get(), appearances.get(), leaves.get());
}


// find(o) of classes._union_python: the root of ``o`` in ``parent``, halving the path (a new reference).
PyObject* find_root(PyObject* parent, PyObject* o) {
  Py_INCREF(o);
  for (;;) {
    PyObject* up = PyDict_GetItemWithError(parent, o);  // borrowed
    if (up == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, o);
      Py_DECREF(o);
      return nullptr;
    }
    const int same = PyObject_RichCompareBool(up, o, Py_EQ);
    if (same < 0) {
      Py_DECREF(o);
      return nullptr;
    }
    if (same) return o;
    // parent[o] = parent[parent[o]]; o = parent[o]
    PyObject* grand = PyDict_GetItemWithError(parent, up);
    if (grand == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, up);
      Py_DECREF(o);
      return nullptr;
    }
    Py_INCREF(grand);
    const int status = PyDict_SetItem(parent, o, grand);
    Py_DECREF(o);
    if (status != 0) {
      Py_DECREF(grand);
      return nullptr;
    }
    o = grand;
  }
}

// union(outputs, appearances, links, one_element_readers) -> (cluster_of, members, unlinked):
// classes._union_python. ``links(value, readers)`` is classes._links (True, False or None);
// ``one_element_readers(readers)`` the readers that are one-element outputs (the caller fills its table
// lazily, as the Python function does).
PyObject* union_(PyObject*, PyObject* args) {
  PyObject *outputs, *appearances, *links, *one_element_readers;
  if (!PyArg_ParseTuple(args, "O!O!OO", &PyList_Type, &outputs, &PyDict_Type, &appearances, &links, &one_element_readers)) return nullptr;
  Ref parent(PyDict_New()), unlinked(PyList_New(0));
  if (!parent || !unlinked) return nullptr;
  const Py_ssize_t n_outputs = PyList_GET_SIZE(outputs);
  for (Py_ssize_t i = 0; i < n_outputs; ++i) {
    PyObject* o = PyList_GET_ITEM(outputs, i);
    if (PyDict_SetItem(parent.get(), o, o) != 0) return nullptr;
  }
  auto differ = [](PyObject* a, PyObject* b) -> int {
    const int same = PyObject_RichCompareBool(a, b, Py_EQ);
    return same < 0 ? -1 : !same;
  };
  // Link every reader of ``readers`` to the first one's root.
  auto link_all = [&](PyObject* readers) -> bool {
    const Py_ssize_t n = PyList_GET_SIZE(readers);
    Ref root(find_root(parent.get(), PyList_GET_ITEM(readers, 0)));
    if (!root) return false;
    for (Py_ssize_t r = 1; r < n; ++r) {
      Ref other_root(find_root(parent.get(), PyList_GET_ITEM(readers, r)));
      if (!other_root) return false;
      const int d = differ(other_root.get(), root.get());
      if (d < 0) return false;
      if (d && PyDict_SetItem(parent.get(), other_root.get(), root.get()) != 0) return false;
    }
    return true;
  };
  Py_ssize_t position = 0;
  PyObject *value, *readers;
  while (PyDict_Next(appearances, &position, &value, &readers)) {
    if (!PyList_Check(readers)) {
      PyErr_SetString(PyExc_TypeError, "appearances must map to lists");
      return nullptr;
    }
    const Py_ssize_t n = PyList_GET_SIZE(readers);
    if (n < 2) continue;
    if (n == 2) {
      // One parent, one root: linked already.
      PyObject* first = PyDict_GetItemWithError(parent.get(), PyList_GET_ITEM(readers, 0));
      PyObject* second = first == nullptr ? nullptr : PyDict_GetItemWithError(parent.get(), PyList_GET_ITEM(readers, 1));
      if (second == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyList_GET_ITEM(readers, first == nullptr ? 0 : 1));
        return nullptr;
      }
      const int d = differ(first, second);
      if (d < 0) return nullptr;
      if (!d) continue;
    }
    {
      Ref root(find_root(parent.get(), PyList_GET_ITEM(readers, 0)));
      if (!root) return nullptr;
      bool all_linked = true;
      for (Py_ssize_t r = 0; r < n; ++r) {
        Ref other(find_root(parent.get(), PyList_GET_ITEM(readers, r)));
        if (!other) return nullptr;
        const int d = differ(other.get(), root.get());
        if (d < 0) return nullptr;
        if (d) {
          all_linked = false;
          break;
        }
      }
      if (all_linked) continue;
    }
    Ref count(PyLong_FromSsize_t(n));
    if (!count) return nullptr;
    Ref answer(PyObject_CallFunctionObjArgs(links, value, count.get(), nullptr));
    if (!answer) return nullptr;
    if (answer.get() == Py_None) {
      if (PyList_Append(unlinked.get(), value) != 0) return nullptr;
      Ref kept(PyObject_CallOneArg(one_element_readers, readers));
      if (!kept) return nullptr;
      if (!PyList_Check(kept.get())) {
        PyErr_SetString(PyExc_TypeError, "one_element_readers must return a list");
        return nullptr;
      }
      if (PyList_GET_SIZE(kept.get()) < 2) continue;
      if (!link_all(kept.get())) return nullptr;
      continue;
    }
    const int linked = PyObject_IsTrue(answer.get());
    if (linked < 0) return nullptr;
    if (!linked) {
      if (PyList_Append(unlinked.get(), value) != 0) return nullptr;
      continue;
    }
    if (!link_all(readers)) return nullptr;
  }
  Ref members(PyDict_New()), cluster_of(PyDict_New());
  if (!members || !cluster_of) return nullptr;
  for (Py_ssize_t i = 0; i < n_outputs; ++i) {
    PyObject* o = PyList_GET_ITEM(outputs, i);
    Ref root(find_root(parent.get(), o));
    if (!root || PyDict_SetItem(cluster_of.get(), o, root.get()) != 0) return nullptr;
    if (!append_at(members.get(), root.get(), o)) return nullptr;
  }
  return PyTuple_Pack(3, cluster_of.get(), members.get(), unlinked.get());
}


// bisect.bisect_left(sorted_list, x) (``a[mid] < x`` as Python compares); -1 on an error.
Py_ssize_t bisect_left(PyObject* sorted_list, PyObject* x) {
  Py_ssize_t lo = 0, hi = PyList_GET_SIZE(sorted_list);
  while (lo < hi) {
    const Py_ssize_t mid = lo + (hi - lo) / 2;
    const int less = PyObject_RichCompareBool(PyList_GET_ITEM(sorted_list, mid), x, Py_LT);
    if (less < 0) return -1;
    if (less) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// A tuple of ``items[start:end]`` (a tuple or a list), a new reference.
PyObject* slice_tuple(PyObject* items, Py_ssize_t start, Py_ssize_t end) {
  if (PyTuple_CheckExact(items)) return PyTuple_GetSlice(items, start, end);
  Ref part(PyList_GetSlice(items, start, end));
  return part ? PyList_AsTuple(part.get()) : nullptr;
}

// key_clusters(clusters, values_of, starts, ends, nodes, facts, node_ids, arities, inputs, at, tails, referred,
//              local, outside, shared_below) -> None: the loop of classes._key_together over its clusters,
// setting each cluster's values, nodes and key as the Python loop does (``outside``: the entries read outside
// their regions, sorted; the rest are _key_together's columns, tuples, and their cut points, lists).
PyObject* key_clusters(PyObject*, PyObject* args) {
  PyObject *clusters, *values_of, *starts, *ends, *nodes, *facts, *node_ids, *arities, *inputs, *at, *tails, *referred, *local, *outside,
      *shared_below;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O!O!O!O!O!O!O", &PyList_Type, &clusters, &PyList_Type, &values_of, &PyList_Type, &starts,
                        &PyList_Type, &ends, &PyList_Type, &nodes, &PyTuple_Type, &facts, &PyTuple_Type, &node_ids, &PyTuple_Type, &arities,
                        &PyTuple_Type, &inputs, &PyList_Type, &at, &PyTuple_Type, &tails, &PyList_Type, &referred, &PyDict_Type, &local,
                        &PyList_Type, &outside, &shared_below))
    return nullptr;
  Ref values_word(PyUnicode_InternFromString("values")), nodes_word(PyUnicode_InternFromString("nodes")),
      key_word(PyUnicode_InternFromString("key")), outputs_word(PyUnicode_InternFromString("outputs")),
      extras_word(PyUnicode_InternFromString("extras")), zero(PyLong_FromLong(0));
  if (!values_word || !nodes_word || !key_word || !outputs_word || !extras_word || !zero) return nullptr;
  const Py_ssize_t n_clusters = PyList_GET_SIZE(clusters);
  if (PyList_GET_SIZE(values_of) != n_clusters || PyList_GET_SIZE(starts) != n_clusters + 1 || PyList_GET_SIZE(ends) != n_clusters + 1) {
    PyErr_SetString(PyExc_ValueError, "key_clusters: the columns do not match the clusters");
    return nullptr;
  }
  const Py_ssize_t n_outside = PyList_GET_SIZE(outside);
  Py_ssize_t next_outside = 0;
  std::vector<Py_ssize_t> order;
  for (Py_ssize_t j = 0; j < n_clusters; ++j) {
    PyObject* cluster = PyList_GET_ITEM(clusters, j);
    const Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts, j));
    const Py_ssize_t end = PyLong_AsSsize_t(PyList_GET_ITEM(starts, j + 1));
    const Py_ssize_t node_start = PyLong_AsSsize_t(PyList_GET_ITEM(ends, j));
    const Py_ssize_t node_end = PyLong_AsSsize_t(PyList_GET_ITEM(ends, j + 1));
    if (PyErr_Occurred()) return nullptr;
    PyObject* values = PyList_GET_ITEM(values_of, j);
    if (!PyList_Check(values) || PyList_GET_SIZE(values) != end - start) {
      PyErr_SetString(PyExc_ValueError, "key_clusters: a cluster's values do not match its entries");
      return nullptr;
    }
    const Py_ssize_t count = end - start;
    // The shared values the cluster reads: referred names that are not local (nor "").
    Ref shared_read(PySet_New(nullptr));
    if (!shared_read) return nullptr;
    for (Py_ssize_t position = start; position < end; ++position) {
      Ref names(PySequence_Fast(PyList_GET_ITEM(referred, position), "referred names must be a sequence"));
      if (!names) return nullptr;
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(names.get());
      PyObject** item = PySequence_Fast_ITEMS(names.get());
      for (Py_ssize_t k = 0; k < n; ++k) {
        const int named = truthy(item[k]);
        if (named < 0) return nullptr;
        if (!named) continue;
        const int is_local = PyDict_Contains(local, item[k]);
        if (is_local < 0) return nullptr;
        if (!is_local && PySet_Add(shared_read.get(), item[k]) != 0) return nullptr;
      }
    }
    // The positions read outside the region.
    Ref read_outside;
    {
      Py_ssize_t first = next_outside;
      while (next_outside < n_outside) {
        const Py_ssize_t position = PyLong_AsSsize_t(PyList_GET_ITEM(outside, next_outside));
        if (position == -1 && PyErr_Occurred()) return nullptr;
        if (position >= end) break;
        ++next_outside;
      }
      read_outside.reset(PyTuple_New(next_outside - first));
      if (!read_outside) return nullptr;
      for (Py_ssize_t k = first; k < next_outside; ++k) {
        PyObject* number = PyLong_FromSsize_t(PyLong_AsSsize_t(PyList_GET_ITEM(outside, k)) - start);
        if (!number) return nullptr;
        PyTuple_SET_ITEM(read_outside.get(), k - first, number);
      }
    }
    // Output positions and extras.
    Ref outputs(PyObject_GetAttr(cluster, outputs_word.get())), extras(PyObject_GetAttr(cluster, extras_word.get()));
    if (!outputs || !extras) return nullptr;
    Ref outputs_fast(PySequence_Fast(outputs.get(), "cluster outputs must be a sequence"));
    if (!outputs_fast) return nullptr;
    const Py_ssize_t n_outputs = PySequence_Fast_GET_SIZE(outputs_fast.get());
    Ref output_positions(PyTuple_New(n_outputs));
    if (!output_positions) return nullptr;
    for (Py_ssize_t k = 0; k < n_outputs; ++k) {
      PyObject* o = PySequence_Fast_GET_ITEM(outputs_fast.get(), k);
      PyObject* position = PyDict_GetItemWithError(local, o);
      if (position == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, o);
        return nullptr;
      }
      Py_INCREF(position);
      PyTuple_SET_ITEM(output_positions.get(), k, position);
    }
    Ref extras_tuple(PySequence_Tuple(extras.get()));
    if (!extras_tuple) return nullptr;
    // The structure's columns.
    Ref structure_facts(PyTuple_GetSlice(facts, start, end)), structure_nodes(PyTuple_GetSlice(node_ids, start, end)),
        structure_arities(PyTuple_GetSlice(arities, start, end));
    const Py_ssize_t at_start = PyLong_AsSsize_t(PyList_GET_ITEM(at, start));
    const Py_ssize_t at_end = PyLong_AsSsize_t(PyList_GET_ITEM(at, end));
    if (PyErr_Occurred()) return nullptr;
    Ref structure_inputs(PyTuple_GetSlice(inputs, at_start, at_end));
    if (!structure_facts || !structure_nodes || !structure_arities || !structure_inputs) return nullptr;
    Ref structure(PyTuple_Pack(4, structure_facts.get(), structure_nodes.get(), structure_arities.get(), structure_inputs.get()));
    if (!structure) return nullptr;
    // _names: the positions in name order, each value's place among the shared names below, the tails.
    PyObject** value_items = reinterpret_cast<PyListObject*>(values)->ob_item;
    order.resize(count);
    for (Py_ssize_t k = 0; k < count; ++k) order[k] = k;
    bool failed = false;
    std::stable_sort(order.begin(), order.end(), [&](Py_ssize_t a, Py_ssize_t b) {
      if (failed) return false;
      const int less = PyObject_RichCompareBool(value_items[a], value_items[b], Py_LT);
      if (less < 0) {
        failed = true;
        return false;
      }
      return less == 1;
    });
    if (failed) return nullptr;
    Ref by_name(PyTuple_New(count));
    if (!by_name) return nullptr;
    for (Py_ssize_t k = 0; k < count; ++k) {
      PyObject* number = PyLong_FromSsize_t(order[k]);
      if (!number) return nullptr;
      PyTuple_SET_ITEM(by_name.get(), k, number);
    }
    Ref before(PyTuple_New(count));
    if (!before) return nullptr;
    if (PySet_GET_SIZE(shared_read.get()) > 0) {
      Ref roots(PyFrozenSet_New(shared_read.get()));
      if (!roots) return nullptr;
      Ref shared_names(PyObject_CallOneArg(shared_below, roots.get()));
      if (!shared_names) return nullptr;
      if (!PyList_Check(shared_names.get())) {
        PyErr_SetString(PyExc_TypeError, "shared_below must return a list");
        return nullptr;
      }
      for (Py_ssize_t k = 0; k < count; ++k) {
        PyObject* number = nullptr;
        if (PyList_GET_SIZE(shared_names.get()) == 0) {
          Py_INCREF(zero.get());
          number = zero.get();
        } else {
          const Py_ssize_t place = bisect_left(shared_names.get(), value_items[k]);
          if (place < 0) return nullptr;
          number = PyLong_FromSsize_t(place);
          if (!number) return nullptr;
        }
        PyTuple_SET_ITEM(before.get(), k, number);
      }
    } else {
      for (Py_ssize_t k = 0; k < count; ++k) {
        Py_INCREF(zero.get());
        PyTuple_SET_ITEM(before.get(), k, zero.get());
      }
    }
    Ref own_tails(PyTuple_GetSlice(tails, start, end));
    if (!own_tails) return nullptr;
    Ref names(PyTuple_Pack(3, by_name.get(), before.get(), own_tails.get()));
    if (!names) return nullptr;
    Ref key(PyTuple_Pack(5, output_positions.get(), extras_tuple.get(), structure.get(), names.get(), read_outside.get()));
    Ref own_nodes(PyList_GetSlice(nodes, node_start, node_end));
    if (!key || !own_nodes) return nullptr;
    if (PyObject_SetAttr(cluster, values_word.get(), values) != 0 || PyObject_SetAttr(cluster, nodes_word.get(), own_nodes.get()) != 0 ||
        PyObject_SetAttr(cluster, key_word.get(), key.get()) != 0)
      return nullptr;
  }
  Py_RETURN_NONE;
}


// facts(values, steps, leaf_step, leaf_kinds, leaf_kind, kind_with_attributes, specs, no_spec, outputs, numbers,
//       number) -> list of numbers: classes._Walker.facts. ``leaf_kind(value)`` and ``kind_with_attributes(value,
// k)`` are the walker's methods for the kinds a step does not hold; ``numbers`` its table of facts to numbers and
// ``number(facts)`` the method numbering new facts, called in entry order as the Python method calls it.
// Facts made of the same objects (dtype, shape tuple, kind tuple, output-ness) are numbered once per call
// without building and hashing their tuple again: the same objects make the same tuple, so the same number.
PyObject* facts(PyObject*, PyObject* args) {
  PyObject *values, *steps_list, *leaf_step, *leaf_kinds, *leaf_kind, *kind_with_attributes, *specs, *no_spec, *outputs, *numbers, *number;
  if (!PyArg_ParseTuple(args, "O!O!O!O!OOO!OO!O!O", &PyList_Type, &values, &PyList_Type, &steps_list, &PyTuple_Type, &leaf_step,
                        &PyDict_Type, &leaf_kinds, &leaf_kind, &kind_with_attributes, &PyDict_Type, &specs, &no_spec, &PySet_Type,
                        &outputs, &PyDict_Type, &numbers, &number))
    return nullptr;
  const Py_ssize_t count = PyList_GET_SIZE(values);
  if (PyList_GET_SIZE(steps_list) != count) {
    PyErr_SetString(PyExc_ValueError, "facts: values and steps differ in length");
    return nullptr;
  }
  Ref dtype_word(PyUnicode_InternFromString("dtype")), shape_word(PyUnicode_InternFromString("shape"));
  Ref result(PyList_New(count));
  if (!dtype_word || !shape_word || !result) return nullptr;
  // The distinct object combinations of this call, to their numbers.
  struct Objects {
    PyObject *dtype, *shape, *kind;
    int is_output;
    bool operator==(const Objects& o) const { return dtype == o.dtype && shape == o.shape && kind == o.kind && is_output == o.is_output; }
  };
  struct Hash {
    size_t operator()(const Objects& o) const {
      size_t h = reinterpret_cast<size_t>(o.dtype);
      for (size_t part : {reinterpret_cast<size_t>(o.shape), reinterpret_cast<size_t>(o.kind), static_cast<size_t>(o.is_output)})
        h = h * 1000003u ^ part;
      return h;
    }
  };
  std::unordered_map<Objects, PyObject*, Hash> seen;  // numbers borrowed from ``numbers``, which never drops one
  std::vector<Ref> kept;  // references to the objects ``seen`` names, so that no address is reused meanwhile
  // Kinds of the holes first (leaves, entered ops with attributes), as the Python method fills them before
  // numbering anything.
  std::vector<Ref> hole_kinds(count);
  for (Py_ssize_t position = 0; position < count; ++position) {
    PyObject* step = PyList_GET_ITEM(steps_list, position);
    if (PyTuple_GET_ITEM(step, 4) != Py_None) continue;
    PyObject* value = PyList_GET_ITEM(values, position);
    if (step == leaf_step) {
      PyObject* kind = PyDict_GetItemWithError(leaf_kinds, value);
      if (kind != nullptr) {
        Py_INCREF(kind);
        hole_kinds[position].reset(kind);
      } else {
        if (PyErr_Occurred()) return nullptr;
        hole_kinds[position].reset(PyObject_CallOneArg(leaf_kind, value));
      }
    } else {
      hole_kinds[position].reset(PyObject_CallFunctionObjArgs(kind_with_attributes, value, PyTuple_GET_ITEM(step, 0), nullptr));
    }
    if (!hole_kinds[position]) return nullptr;
  }
  for (Py_ssize_t position = 0; position < count; ++position) {
    PyObject* value = PyList_GET_ITEM(values, position);
    PyObject* step = PyList_GET_ITEM(steps_list, position);
    PyObject* kind = hole_kinds[position] ? hole_kinds[position].get() : PyTuple_GET_ITEM(step, 4);
    PyObject* spec = PyDict_GetItemWithError(specs, value);
    if (spec == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      spec = no_spec;
    }
    Ref dtype(PyObject_GetAttr(spec, dtype_word.get())), shape(PyObject_GetAttr(spec, shape_word.get()));
    if (!dtype || !shape) return nullptr;
    const int is_output = PySet_Contains(outputs, value);
    if (is_output < 0) return nullptr;
    const Objects objects{dtype.get(), shape.get(), kind, is_output};
    auto known = seen.find(objects);
    PyObject* found = known == seen.end() ? nullptr : known->second;
    if (found == nullptr) {
      Ref key(PyTuple_Pack(4, dtype.get(), shape.get(), kind, is_output ? Py_True : Py_False));
      if (!key) return nullptr;
      found = PyDict_GetItemWithError(numbers, key.get());
      if (found == nullptr) {
        if (PyErr_Occurred()) return nullptr;
        Ref made(PyObject_CallOneArg(number, key.get()));
        if (!made) return nullptr;
        found = PyDict_GetItemWithError(numbers, key.get());  // the method put it there
        if (found == nullptr) {
          if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "facts: number() did not record the facts");
          return nullptr;
        }
      }
      // Remembered by identity, with a reference to each object held until the call ends: an address in
      // ``seen`` is always the object it was, never a later one at the same address.
      seen.emplace(objects, found);
      for (PyObject* o : {dtype.get(), shape.get(), kind, found}) {
        Py_INCREF(o);
        kept.emplace_back(o);
      }
    }
    Py_INCREF(found);
    PyList_SET_ITEM(result.get(), position, found);
  }
  return result.release();
}


// cluster_values(clusters, regions, steps, fringes, shared, listed) -> [(values, steps)]: classes._values of
// each cluster (a list of clusters), in turn.
PyObject* cluster_values(PyObject*, PyObject* args) {
  PyObject *clusters, *regions, *steps_of, *fringes, *shared, *listed_word;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O", &PyList_Type, &clusters, &PyDict_Type, &regions, &PyDict_Type, &steps_of, &PyDict_Type,
                        &fringes, &PySet_Type, &shared, &listed_word))
    return nullptr;
  Ref outputs_word(PyUnicode_InternFromString("outputs"));
  const Py_ssize_t n_clusters = PyList_GET_SIZE(clusters);
  Ref result(PyList_New(n_clusters));
  if (!outputs_word || !result) return nullptr;
  auto item = [](PyObject* table, PyObject* key) -> PyObject* {  // table[key], borrowed
    PyObject* found = PyDict_GetItemWithError(table, key);
    if (found == nullptr && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return found;
  };
  const bool any_shared = PySet_GET_SIZE(shared) > 0;
  for (Py_ssize_t j = 0; j < n_clusters; ++j) {
    Ref outputs_object(PyObject_GetAttr(PyList_GET_ITEM(clusters, j), outputs_word.get()));
    if (!outputs_object) return nullptr;
    Ref outputs(PySequence_Fast(outputs_object.get(), "cluster outputs must be a sequence"));
    if (!outputs) return nullptr;
    const Py_ssize_t n_outputs = PySequence_Fast_GET_SIZE(outputs.get());
    PyObject** out = PySequence_Fast_ITEMS(outputs.get());
    if (n_outputs == 0) {
      PyErr_SetString(PyExc_IndexError, "a cluster without outputs");
      return nullptr;
    }
    PyObject* first = item(regions, out[0]);
    if (first == nullptr) return nullptr;
    bool alone = false;
    if (first != Py_None) {
      if (n_outputs == 1) {
        alone = true;
      } else if (n_outputs == 2) {
        // A parameter update and the new buffer it reads: the second region adds nothing.
        const int in_first = PySequence_Contains(first, out[1]);
        if (in_first < 0) return nullptr;
        if (in_first) {
          PyObject* fringe = item(fringes, out[0]);
          if (fringe == nullptr) return nullptr;
          const int in_fringe = PySequence_Contains(fringe, out[1]);
          if (in_fringe < 0) return nullptr;
          alone = !in_fringe;
        }
      }
    }
    Ref values, steps;
    if (alone) {
      PyObject* first_steps = item(steps_of, out[0]);
      if (first_steps == nullptr) return nullptr;
      values.reset(PySequence_List(first));
      steps.reset(PySequence_List(first_steps));
    } else {
      // The first place of each value, with the step of its last.
      Ref merged(PyDict_New());
      if (!merged) return nullptr;
      for (Py_ssize_t k = 0; k < n_outputs; ++k) {
        PyObject* region = item(regions, out[k]);
        if (region == nullptr) return nullptr;
        if (region == Py_None) {
          if (PyDict_SetItem(merged.get(), out[k], listed_word) != 0) return nullptr;
          continue;
        }
        PyObject* region_steps = item(steps_of, out[k]);
        if (region_steps == nullptr) return nullptr;
        Ref names(PySequence_Fast(region, "a region must be a sequence")), its(PySequence_Fast(region_steps, "steps must be a sequence"));
        if (!names || !its) return nullptr;
        const Py_ssize_t n = std::min(PySequence_Fast_GET_SIZE(names.get()), PySequence_Fast_GET_SIZE(its.get()));
        for (Py_ssize_t i = 0; i < n; ++i)
          if (PyDict_SetItem(merged.get(), PySequence_Fast_GET_ITEM(names.get(), i), PySequence_Fast_GET_ITEM(its.get(), i)) != 0) return nullptr;
      }
      values.reset(PyDict_Keys(merged.get()));
      steps.reset(PyDict_Values(merged.get()));
    }
    if (!values || !steps) return nullptr;
    if (any_shared) {
      Ref kept_values(PyList_New(0)), kept_steps(PyList_New(0));
      if (!kept_values || !kept_steps) return nullptr;
      const Py_ssize_t n = PyList_GET_SIZE(values.get());
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* value = PyList_GET_ITEM(values.get(), i);
        const int is_shared = PySet_Contains(shared, value);
        if (is_shared < 0) return nullptr;
        if (is_shared) continue;
        if (PyList_Append(kept_values.get(), value) != 0 || PyList_Append(kept_steps.get(), PyList_GET_ITEM(steps.get(), i)) != 0) return nullptr;
      }
      values.reset(kept_values.release());
      steps.reset(kept_steps.release());
    }
    PyObject* pair = PyTuple_Pack(2, values.get(), steps.get());
    if (pair == nullptr) return nullptr;
    PyList_SET_ITEM(result.get(), j, pair);
  }
  return result.release();
}


// key_columns(computed, starts, referred, listed, local) -> (ends, node_ids, arities, inputs, at): the columns
// classes._key_together computes before its loop: where each cluster's computed entries end (``computed``
// sorted), each entry's node number within its cluster (None for none), how many names each entry refers to
// (-1 for the ``listed`` entries), every referred name as its position (``local``) or itself, and where each
// entry's names begin.
PyObject* key_columns(PyObject*, PyObject* args) {
  PyObject *computed, *starts, *referred, *listed, *local;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &computed, &PyList_Type, &starts, &PyList_Type, &referred, &PyList_Type, &listed,
                        &PyDict_Type, &local))
    return nullptr;
  const Py_ssize_t count = PyList_GET_SIZE(referred);
  const Py_ssize_t n_computed = PyList_GET_SIZE(computed);
  const Py_ssize_t n_starts = PyList_GET_SIZE(starts);
  std::vector<Py_ssize_t> computed_at(n_computed);
  for (Py_ssize_t i = 0; i < n_computed; ++i) {
    computed_at[i] = PyLong_AsSsize_t(PyList_GET_ITEM(computed, i));
    if (computed_at[i] == -1 && PyErr_Occurred()) return nullptr;
    if (computed_at[i] < 0 || computed_at[i] >= count || (i > 0 && computed_at[i] <= computed_at[i - 1])) {
      PyErr_SetString(PyExc_ValueError, "key_columns: computed must be increasing entries");
      return nullptr;
    }
  }
  Ref ends(PyList_New(n_starts));
  if (!ends) return nullptr;
  std::vector<Py_ssize_t> end_at(n_starts);
  for (Py_ssize_t j = 0; j < n_starts; ++j) {
    const Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts, j));
    if (start == -1 && PyErr_Occurred()) return nullptr;
    end_at[j] = std::lower_bound(computed_at.begin(), computed_at.end(), start) - computed_at.begin();
    PyObject* number = PyLong_FromSsize_t(end_at[j]);
    if (!number) return nullptr;
    PyList_SET_ITEM(ends.get(), j, number);
  }
  Ref node_ids(PyTuple_New(count));
  if (!node_ids) return nullptr;
  for (Py_ssize_t position = 0; position < count; ++position) {
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(node_ids.get(), position, Py_None);
  }
  // node_of: computed[i], of cluster j (ends[j] <= i < ends[j + 1]), is node i - ends[j]; entries before
  // the first cluster's end or past the last are numbered as zip() pairs them with the ranges, which covers
  // exactly the computed entries between ends[0] and ends[-1].
  for (Py_ssize_t j = 0; j + 1 < n_starts; ++j) {
    for (Py_ssize_t i = end_at[j]; i < end_at[j + 1]; ++i) {
      PyObject* number = PyLong_FromSsize_t(i - end_at[j]);
      if (!number) return nullptr;
      PyObject* old = PyTuple_GET_ITEM(node_ids.get(), computed_at[i]);
      PyTuple_SET_ITEM(node_ids.get(), computed_at[i], number);
      Py_DECREF(old);
    }
  }
  Ref arities(PyTuple_New(count)), at(PyList_New(count + 1));
  if (!arities || !at) return nullptr;
  std::vector<Ref> fast(count);
  Py_ssize_t total = 0;
  for (Py_ssize_t position = 0; position < count; ++position) {
    fast[position].reset(PySequence_Fast(PyList_GET_ITEM(referred, position), "referred names must be a sequence"));
    if (!fast[position]) return nullptr;
    PyObject* start = PyLong_FromSsize_t(total);
    if (!start) return nullptr;
    PyList_SET_ITEM(at.get(), position, start);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast[position].get());
    PyObject* arity = PyLong_FromSsize_t(n);
    if (!arity) return nullptr;
    PyTuple_SET_ITEM(arities.get(), position, arity);
    total += n;
  }
  {
    PyObject* end = PyLong_FromSsize_t(total);
    if (!end) return nullptr;
    PyList_SET_ITEM(at.get(), count, end);
  }
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(listed); ++k) {
    const Py_ssize_t position = PyLong_AsSsize_t(PyList_GET_ITEM(listed, k));
    if (position == -1 && PyErr_Occurred()) return nullptr;
    if (position < 0 || position >= count) {
      PyErr_SetString(PyExc_IndexError, "key_columns: a listed entry out of range");
      return nullptr;
    }
    PyObject* minus_one = PyLong_FromLong(-1);
    if (!minus_one) return nullptr;
    PyObject* old = PyTuple_GET_ITEM(arities.get(), position);
    PyTuple_SET_ITEM(arities.get(), position, minus_one);
    Py_DECREF(old);
  }
  Ref inputs(PyTuple_New(total));
  if (!inputs) return nullptr;
  Py_ssize_t next = 0;
  for (Py_ssize_t position = 0; position < count; ++position) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast[position].get());
    PyObject** item = PySequence_Fast_ITEMS(fast[position].get());
    for (Py_ssize_t k = 0; k < n; ++k) {
      PyObject* found = PyDict_GetItemWithError(local, item[k]);
      if (found == nullptr) {
        if (PyErr_Occurred()) return nullptr;
        found = item[k];
      }
      Py_INCREF(found);
      PyTuple_SET_ITEM(inputs.get(), next++, found);
    }
  }
  return PyTuple_Pack(5, ends.get(), node_ids.get(), arities.get(), inputs.get(), at.get());
}

PyMethodDef kMethods[] = {
    {"steps", steps, METH_VARARGS, "steps(nodes, entered_ops, direct_ops, copy_ops, default_domains) -> (steps, copies)."},
    {"walk", walk, METH_VARARGS,
     "walk(outputs, behind_copies, steps, leaf_step, listed, walked, nothing, max_walk, max_region, too_large, not_one, links) "
     "-> (regions, steps, fringes, direct, appearances, leaves)."},
    {"union", union_, METH_VARARGS, "union(outputs, appearances, links, one_element_readers) -> (cluster_of, members, unlinked)."},
    {"key_clusters", key_clusters, METH_VARARGS,
     "key_clusters(clusters, values_of, starts, ends, nodes, facts, node_ids, arities, inputs, at, tails, referred, local, outside, "
     "shared_below) -> None: set each cluster's values, nodes and key."},
    {"facts", facts, METH_VARARGS,
     "facts(values, steps, leaf_step, leaf_kinds, leaf_kind, kind_with_attributes, specs, no_spec, outputs, numbers, number) -> numbers."},
    {"cluster_values", cluster_values, METH_VARARGS, "cluster_values(clusters, regions, steps, fringes, shared, listed) -> [(values, steps)]."},
    {"key_columns", key_columns, METH_VARARGS, "key_columns(computed, starts, referred, listed, local) -> (ends, node_ids, arities, inputs, at)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_classes", "Region walk of the structural classes (see sgdfuse.passes.classes).", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__classes(void) { return PyModule_Create(&kModule); }
