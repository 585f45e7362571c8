// mkv.Tensor in Python, and DLPack both ways: `__dlpack__` / `__dlpack_device__` / to_dlpack()
// hand a tensor's memory to torch.from_dlpack (or any DLPack consumer) without a copy, and every
// call that takes a tensor accepts a DLPack producer, viewed in place (tensorArg).
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "mkv/error.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

#if MKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace mkv::python {
namespace {

// The DLPack ABI (dlpack.h, version 0.x "dltensor" capsules, unchanged in 1.x for the
// unversioned protocol): declared here, the module needs nothing else of it.
// NOLINTBEGIN(readability-identifier-naming,cppcoreguidelines-pro-type-member-init)
enum DLDeviceTypeCode : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };
enum DLDataTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
// NOLINTEND(readability-identifier-naming,cppcoreguidelines-pro-type-member-init)

constexpr char const* kCapsuleName = "dltensor";
constexpr char const* kUsedCapsuleName = "used_dltensor";

/// fp8 E4M3 travels as uint8 (its bytes): DLPack consumers before 1.1 have no fp8 code.
DLDataType dlTypeOf(DataType type) {
  auto const bits = static_cast<uint8_t>(dataTypeSize(type) * 8);
  switch (type) {
    case DataType::kFloat32:
    case DataType::kFloat16:
      return {kDLFloat, bits, 1};
    case DataType::kBFloat16:
      return {kDLBfloat, bits, 1};
    case DataType::kInt8:
    case DataType::kInt32:
    case DataType::kInt64:
      return {kDLInt, bits, 1};
    case DataType::kFp8E4M3:
    case DataType::kUInt8:
      return {kDLUInt, bits, 1};
  }
  return {kDLUInt, 8, 1};
}

DataType dataTypeOf(DLDataType type, char const* call) {
  struct Known {
    uint8_t code;
    uint8_t bits;
    DataType type;
  };
  static constexpr std::array<Known, 7> kKnown{{{kDLFloat, 32, DataType::kFloat32},
                                                {kDLFloat, 16, DataType::kFloat16},
                                                {kDLBfloat, 16, DataType::kBFloat16},
                                                {kDLInt, 8, DataType::kInt8},
                                                {kDLInt, 32, DataType::kInt32},
                                                {kDLInt, 64, DataType::kInt64},
                                                {kDLUInt, 8, DataType::kUInt8}}};
  for (Known const& known : kKnown) {
    if (type.lanes == 1 && type.code == known.code && type.bits == known.bits) {
      return known.type;
    }
  }
  throw Error(call, "a DLPack tensor of type code " + std::to_string(type.code) + ", " +
                        std::to_string(type.bits) + " bits, " + std::to_string(type.lanes) +
                        " lanes: expected float32/16, bfloat16, int8/32/64 or uint8");
}

/// DLPack device of a tensor: the CPU, or the CUDA device that holds the pointer.
std::pair<int32_t, int32_t> dlDeviceOf(Tensor const& tensor) {
  if (tensor.deviceType() == DeviceType::kCPU) {
    return {kDLCPU, 0};
  }
  int32_t device = 0;
#if MKV_WITH_CUDA
  cudaPointerAttributes attributes{};
  if (tensor.rawPointer() != nullptr &&
      cudaPointerGetAttributes(&attributes, tensor.rawPointer()) == cudaSuccess) {
    device = attributes.device;
  } else {
    cudaGetLastError();
    cudaGetDevice(&device);
  }
#endif
  return {kDLCUDA, device};
}

Coords coordsOf(std::vector<int64_t> const& e, char const* call) {
  switch (e.size()) {
    case 0:
      return Coords{};
    case 1:
      return Coords{e[0]};
    case 2:
      return Coords{e[0], e[1]};
    case 3:
      return Coords{e[0], e[1], e[2]};
    case 4:
      return Coords{e[0], e[1], e[2], e[3]};
    case 5:
      return Coords{e[0], e[1], e[2], e[3], e[4]};
    case 6:
      return Coords{e[0], e[1], e[2], e[3], e[4], e[5]};
    case 7:
      return Coords{e[0], e[1], e[2], e[3], e[4], e[5], e[6]};
    case 8:
      return Coords{e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]};
    default:
      throw Error(call, std::to_string(e.size()) + " dimensions, at most " +
                            std::to_string(Coords::kMaxRank));
  }
}

/// What a "dltensor" capsule of ours points to: the descriptor, its shape and strides, and a
/// reference to the Python tensor whose memory it describes.
struct ExportContext {
  DLManagedTensor managed{};
  std::array<int64_t, Coords::kMaxRank> shape{};
  std::array<int64_t, Coords::kMaxRank> strides{};
  PyObject* owner = nullptr;
};

void deleteExport(DLManagedTensor* managed) {
  auto* context = static_cast<ExportContext*>(managed->manager_ctx);
  if (Py_IsInitialized() != 0) {
    PyGILState_STATE const state = PyGILState_Ensure();
    Py_XDECREF(context->owner);
    PyGILState_Release(state);
  }
  delete context;
}

/// A capsule nobody consumed still owns its tensor.
void destroyCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kCapsuleName) == 0) {
    return;  // consumed: renamed "used_dltensor", the consumer owns it
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) {
    managed->deleter(managed);
  }
}

py::capsule exportDlpack(py::object const& self) {
  auto const& tensor = self.cast<Tensor const&>();
  auto context = std::make_unique<ExportContext>();
  int32_t const rank = tensor.rank();
  for (int32_t d = 0; d < rank; ++d) {
    context->shape[static_cast<std::size_t>(d)] = tensor.dim(d);
    context->strides[static_cast<std::size_t>(d)] = tensor.stride(d);
  }
  auto const [deviceType, deviceId] = dlDeviceOf(tensor);
  DLTensor& dl = context->managed.dl_tensor;
  dl.data =
      const_cast<void*>(tensor.rawPointer());  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  dl.device = {deviceType, deviceId};
  dl.ndim = rank;
  dl.dtype = dlTypeOf(tensor.dataType());
  dl.shape = context->shape.data();
  dl.strides = context->strides.data();
  dl.byte_offset = 0;
  context->owner = self.ptr();
  Py_INCREF(context->owner);
  context->managed.manager_ctx = context.get();
  context->managed.deleter = deleteExport;
  PyObject* capsule = PyCapsule_New(&context->managed, kCapsuleName, destroyCapsule);
  if (capsule == nullptr) {
    Py_DECREF(context->owner);
    throw py::error_already_set();
  }
  static_cast<void>(context.release());
  return py::reinterpret_steal<py::capsule>(capsule);
}

/// Takes a "dltensor" capsule (renaming it "used_dltensor": its tensor is ours to delete) and
/// returns a view of it and an owner that deletes it.
TensorArg importCapsule(py::handle capsule, char const* call) {
  if (PyCapsule_IsValid(capsule.ptr(), kCapsuleName) == 0) {
    throw Error(call, "expected a \"dltensor\" capsule (a used one cannot be taken twice)");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  auto owner = py::capsule(managed, [](void* pointer) {
    auto* taken = static_cast<DLManagedTensor*>(pointer);
    if (taken->deleter != nullptr) {
      taken->deleter(taken);
    }
  });
  // From here `owner` deletes the tensor whatever happens: the capsule is marked used first.
  PyCapsule_SetName(capsule.ptr(), kUsedCapsuleName);
  DLTensor const& dl = managed->dl_tensor;
  DeviceType device = DeviceType::kCPU;
  if (dl.device.device_type == kDLCUDA) {
    device = DeviceType::kGPU;
  } else if (dl.device.device_type != kDLCPU && dl.device.device_type != kDLCUDAHost) {
    throw Error(call, "a DLPack tensor on device type " + std::to_string(dl.device.device_type) +
                          ": expected the CPU (1) or CUDA (2)");
  }
  DataType const type = dataTypeOf(dl.dtype, call);
  if (dl.ndim < 0 || dl.ndim > Coords::kMaxRank) {
    throw Error(call, "a DLPack tensor of " + std::to_string(dl.ndim) + " dimensions, at most " +
                          std::to_string(Coords::kMaxRank));
  }
  std::vector<int64_t> const extents(dl.shape, dl.shape + dl.ndim);
  if (dl.strides != nullptr) {
    int64_t expected = 1;
    for (int32_t d = dl.ndim - 1; d >= 0; --d) {
      auto const index = static_cast<std::size_t>(d);
      if (extents[index] != 1 && dl.strides[d] != expected) {
        throw Error(call, "a DLPack tensor with strides that are not dense row-major (dimension " +
                              std::to_string(d) + " has stride " + std::to_string(dl.strides[d]) +
                              ", expected " + std::to_string(expected) +
                              "): pass a contiguous tensor");
      }
      expected *= extents[index];
    }
  }
  Coords const shape = coordsOf(extents, call);
  void* data = static_cast<char*>(dl.data) + dl.byte_offset;
  if (shape.numel() == 0 && data == nullptr) {
    data = &managed->dl_tensor;  // an empty tensor may carry no pointer; Tensor::view wants one
  }
  return {Tensor::view(data, shape, type, device), std::move(owner)};
}

py::tuple shapeOf(Tensor const& tensor) {
  py::tuple shape(static_cast<std::size_t>(tensor.rank()));
  for (int32_t d = 0; d < tensor.rank(); ++d) {
    shape[static_cast<std::size_t>(d)] = tensor.dim(d);
  }
  return shape;
}

/// Host tensors only: the elements as a flat Python list, read through the library's pointer.
py::list toList(Tensor const& tensor) {
  if (tensor.deviceType() != DeviceType::kCPU) {
    throw Error("Tensor.tolist", "a kGPU tensor: copy it to the host first (torch.from_dlpack)");
  }
  py::list out;
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    switch (tensor.dataType()) {
      case DataType::kFloat32:
        out.append(tensor.dataPointer<float>()[i]);
        break;
      case DataType::kInt32:
        out.append(tensor.dataPointer<int32_t>()[i]);
        break;
      case DataType::kInt64:
        out.append(tensor.dataPointer<int64_t>()[i]);
        break;
      case DataType::kInt8:
        out.append(tensor.dataPointer<int8_t>()[i]);
        break;
      case DataType::kUInt8:
      case DataType::kFp8E4M3:
        out.append(tensor.dataPointer<uint8_t>()[i]);
        break;
      case DataType::kFloat16:
      case DataType::kBFloat16:
        out.append(tensor.dataPointer<uint16_t>()[i]);  // the raw 16-bit pattern
        break;
    }
  }
  return out;
}

}  // namespace

TensorArg tensorArg(py::handle object, char const* call) {
  if (py::isinstance<Tensor>(object)) {
    return {Tensor::viewOf(object.cast<Tensor const&>()),
            py::reinterpret_borrow<py::object>(object)};
  }
  if (PyCapsule_CheckExact(object.ptr()) != 0) {
    return importCapsule(object, call);
  }
  if (py::hasattr(object, "__dlpack__")) {
    py::object const capsule = object.attr("__dlpack__")();
    TensorArg arg = importCapsule(capsule, call);
    // The producer's memory may be owned by the object rather than by the capsule's deleter.
    arg.owner = py::make_tuple(arg.owner, object);
    return arg;
  }
  throw Error(call, std::string("expected an mkv Tensor or an object with __dlpack__ (a torch "
                                "tensor, a NumPy array), got ") +
                        py::str(py::type::handle_of(object)).cast<std::string>());
}

cudaStream_t streamArg(py::handle stream) {
  if (stream.is_none()) {
    return nullptr;
  }
  // NOLINTNEXTLINE(performance-no-int-to-ptr): a CUDA stream handle is a pointer value
  return reinterpret_cast<cudaStream_t>(stream.cast<uintptr_t>());
}

void bindTensor(py::module_& module) {
  py::class_<Tensor>(module, "Tensor", py::dynamic_attr(),
                     "A dense row-major tensor of the library (mkv::Tensor). Shared with torch "
                     "without a copy: torch.from_dlpack(t), or t.to_dlpack().")
      .def(py::init([](std::vector<int64_t> const& shape, DataType type, DeviceType device) {
             return Tensor(coordsOf(shape, "Tensor"), type, device);
           }),
           py::arg("shape"), py::arg("dtype"), py::arg("device") = DeviceType::kCPU,
           "An owning, zero-filled tensor.")
      .def_static(
          "from_dlpack",
          [](py::object const& object) {
            TensorArg arg = tensorArg(object, "Tensor.from_dlpack");
            py::object result = py::cast(std::move(arg.view));
            result.attr("_owner") = arg.owner;
            return result;
          },
          py::arg("tensor"), "A non-owning view of a DLPack producer's memory (no copy).")
      .def_property_readonly("shape", &shapeOf)
      .def_property_readonly("dtype", &Tensor::dataType)
      .def_property_readonly("device", &Tensor::deviceType)
      .def_property_readonly("numel", &Tensor::numel)
      .def_property_readonly("size_bytes", &Tensor::sizeBytes)
      .def_property_readonly("capacity_bytes", &Tensor::capacityBytes)
      .def_property_readonly("is_owning", &Tensor::isOwning)
      .def_property_readonly(
          "data_ptr", [](Tensor const& t) { return reinterpret_cast<uintptr_t>(t.rawPointer()); })
      .def("tolist", &toList, "Host tensors: the elements, flat, read through the library.")
      .def(
          "__dlpack__",
          [](py::object const& self, py::object const& /*stream*/, py::object const& /*maxVersion*/,
             py::object const& dlDevice, py::object const& copy) {
            if (!copy.is_none() && copy.cast<bool>()) {
              throw Error("Tensor.__dlpack__", "copy=True: the library only shares its memory");
            }
            if (!dlDevice.is_none()) {
              auto const [type, id] = dlDeviceOf(self.cast<Tensor const&>());
              auto const wanted = dlDevice.cast<std::pair<int32_t, int32_t>>();
              if (wanted.first != type || wanted.second != id) {
                throw Error("Tensor.__dlpack__",
                            "dl_device (" + std::to_string(wanted.first) + ", " +
                                std::to_string(wanted.second) + ") is not the tensor's (" +
                                std::to_string(type) + ", " + std::to_string(id) +
                                "): the library does not copy across devices");
              }
            }
            return exportDlpack(self);
          },
          py::kw_only(), py::arg("stream") = py::none(), py::arg("max_version") = py::none(),
          py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
          "A \"dltensor\" capsule over this tensor's memory (no copy). The library synchronises "
          "nothing: its writes are ordered on the runtime's stream, which the consumer uses.")
      .def("__dlpack_device__",
           [](Tensor const& t) {
             auto const [type, id] = dlDeviceOf(t);
             return py::make_tuple(type, id);
           })
      .def("to_dlpack", &exportDlpack, "The same capsule as __dlpack__().")
      .def("__repr__", [](Tensor const& t) {
        return "managedkv.Tensor(shape=" + t.shape().toString() +
               ", dtype=" + std::string(toString(t.dataType())) +
               ", device=" + std::string(toString(t.deviceType())) + ")";
      });
}

}  // namespace mkv::python
