#pragma once
/// \file bindings.h
/// The parts of the `managedkv._managedkv` extension module (pybind11), one translation unit each:
/// tensors and DLPack (tensor.cpp), configs and value types (types.cpp), the runtime, its
/// resources and the request facade (runtime.cpp). module.cpp defines the module and
/// managedkv.Error.

#include <pybind11/pybind11.h>

#include <cstdint>

#include "mkv/cuda_types.h"
#include "mkv/tensor.h"

namespace mkv::python {

namespace py = pybind11;

void bindTensor(py::module_& module);
void bindTypes(py::module_& module);
void bindRuntime(py::module_& module);

/// A tensor argument: an mkv.Tensor, or any object with `__dlpack__` (a torch tensor, a NumPy
/// array) or a "dltensor" capsule, as a non-owning mkv::Tensor over the same memory (no copy).
/// `owner` keeps that memory alive while the view is used. Throws mkv::Error naming `call` for a
/// tensor that is not dense row-major, of a type or on a device the library has no name for.
struct TensorArg {
  Tensor view;
  py::object owner;
};
TensorArg tensorArg(py::handle object, char const* call);

/// A CUDA stream handle from Python: an int (a cudaStream_t value, 0 = the legacy default stream,
/// torch.cuda.Stream.cuda_stream) or None.
cudaStream_t streamArg(py::handle stream);

}  // namespace mkv::python
