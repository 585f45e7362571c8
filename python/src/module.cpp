// The managedkv._managedkv extension module: the library's C++ API in Python (docs/python.md).
// mkv::Error becomes managedkv.Error (a RuntimeError) with the library's message, .call and
// .detail.
#include <pybind11/pybind11.h>

#include <exception>

#include "bindings.h"
#include "mkv/error.h"

PYBIND11_MODULE(_managedkv, module) {
  namespace py = pybind11;
  module.doc() =
      "managedkv: the KV-cache request layer, its pools and page tables shared with "
      "torch through DLPack, and kernel-ready attention views.";
  // The class outlives every translation: pybind11 keeps the module (so the class) alive while
  // the interpreter runs, and the handle is leaked on purpose at exit.
  static py::handle const errorClass = [&module] {
    py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
    py::dict attributes;
    attributes["__doc__"] =
        "A contract violation reported by the library (mkv::Error): str() is "
        "the library's message, .call the call, .detail the offending value.";
    attributes["__module__"] = "managedkv";
    attributes["call"] = "";
    attributes["detail"] = "";
    py::object cls = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type))(
        "Error", py::make_tuple(base), attributes);
    module.attr("Error") = cls;
    return cls.release();
  }();
  // NOLINTNEXTLINE(performance-unnecessary-value-param): pybind11's translator type takes it so
  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) {
        std::rethrow_exception(pointer);
      }
    } catch (mkv::Error const& error) {
      py::object const instance = py::reinterpret_borrow<py::object>(errorClass)(error.what());
      instance.attr("call") = error.call();
      instance.attr("detail") = error.detail();
      PyErr_SetObject(errorClass.ptr(), instance.ptr());
    }
  });
  // Types first: the others name them in default arguments.
  mkv::python::bindTypes(module);
  mkv::python::bindTensor(module);
  mkv::python::bindRuntime(module);
}
