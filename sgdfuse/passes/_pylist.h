// Python list helpers shared by the native scanners (_scan.cc, _vscan.cc), which include Python.h first.
// _wire.h stays free of Python; what needs the C API lives here.
#pragma once

#include <Python.h>

namespace sgdfuse_py {

// Append to a list, taking the reference to item (which may be null after a failed call). On failure sets
// owner.python_error, so the caller returns the Python error already set.
template <class Owner>
bool append(Owner& owner, PyObject* list, PyObject* item) {
  if (item == nullptr) {
    owner.python_error = true;
    return false;
  }
  const int status = PyList_Append(list, item);
  Py_DECREF(item);
  if (status != 0) {
    owner.python_error = true;
    return false;
  }
  return true;
}

}  // namespace sgdfuse_py
