// Autograd nodes in C++ whose backward is one launch of a compiled Triton kernel.
//
// An eager call's backward through a Python autograd.Function runs Python on autograd's device
// thread: the GIL changes hands twice per node, which on the GPU machine costs more than the whole
// native backward of a small norm. A node from here holds what the launch needs (the kernel,
// its parameter layout, the saved tensors) and launches it through the CUDA driver, without Python.
//
// The driver is found in libcuda at run time: nothing CUDA is needed to build this file.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// --- the CUDA driver, looked up once ---------------------------------------------------------------

using CUresult = int;
using LaunchKernel = CUresult (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                  unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                  void* stream, void** params, void** extra);
using StreamIsCapturing = CUresult (*)(void* stream, int* status);
using GetErrorString = CUresult (*)(CUresult error, const char** text);
using GetContext = CUresult (*)(void** context);
using SetContext = CUresult (*)(void* context);

struct Driver {
  LaunchKernel launch = nullptr;
  StreamIsCapturing is_capturing = nullptr;
  GetErrorString error_string = nullptr;
  GetContext get_context = nullptr;
  SetContext set_context = nullptr;
};

const Driver& driver() {
  static const Driver found = [] {
    Driver d;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) library = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(library != nullptr, "taac native backward: libcuda.so.1 not found");
    d.launch = reinterpret_cast<LaunchKernel>(dlsym(library, "cuLaunchKernel"));
    d.is_capturing = reinterpret_cast<StreamIsCapturing>(dlsym(library, "cuStreamIsCapturing"));
    d.error_string = reinterpret_cast<GetErrorString>(dlsym(library, "cuGetErrorString"));
    d.get_context = reinterpret_cast<GetContext>(dlsym(library, "cuCtxGetCurrent"));
    d.set_context = reinterpret_cast<SetContext>(dlsym(library, "cuCtxSetCurrent"));
    TORCH_CHECK(d.launch && d.is_capturing && d.error_string && d.get_context && d.set_context,
                "taac native backward: libcuda lacks a driver function");
    return d;
  }();
  return found;
}

void check_cuda(CUresult result, const std::string& what) {
  if (result == 0) return;
  const char* text = nullptr;
  driver().error_string(result, &text);
  TORCH_CHECK(false, what, ": CUDA error ", result, " (", text ? text : "unknown", ")");
}

// --- what a launch needs --------------------------------------------------------------------------------

// One compiled kernel's parameters: for each (constexprs left out, as Triton's launcher leaves them out), the
// position of its argument in the per-call tuple and its type: 'p' pointer, 'i' int32, 'l' int64, 'f' fp32.
// Triton 3.6 kernels take two more pointers last (global and profile scratch), null for the kernels used here.
struct Plan {
  std::string name;
  uintptr_t function;
  unsigned threads;
  unsigned shared_bytes;
  std::vector<int> positions;
  std::string types;
};

// Where a pointer parameter's address comes from at backward time.
enum class Source : uint8_t { Grad, Output, Saved, Scratch };

struct Pointer {
  Source source;
  int index;
};

union Value {
  Pointer pointer;
  int64_t integer;
  double real;
};

bool poison_outputs = false;  // set from Python (runtime.accelerators.buffers.poison_outputs)

template <typename T>
auto new_node() {
  // torch 2.13 holds nodes in intrusive_ptr, earlier versions in shared_ptr
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>();
  } else {
    return std::make_shared<T>();
  }
}

struct TritonBackward : Node {
  std::shared_ptr<const Plan> plan;
  std::vector<Value> values;       // one per kernel parameter (plan->types)
  std::vector<SavedVariable> saved;
  std::vector<at::Tensor> scratch;  // zero-initialised buffers the kernel leaves as it found them
  std::vector<std::vector<int64_t>> output_sizes;  // the gradient of input i: shaped and typed as input i
  std::vector<at::TensorOptions> output_options;
  std::vector<bool> has_output;
  at::ScalarType grad_dtype = at::kFloat;
  unsigned grid[3] = {1, 1, 1};
  void* stream = nullptr;
  void* context = nullptr;  // the forward's: Triton loaded the kernel into it

  std::string name() const override { return plan->name; }

  void release_variables() override {
    for (auto& variable : saved) variable.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!at::GradMode::is_enabled(), plan->name,
                ": double backward (create_graph=True) is not supported: the backward is a Triton kernel that "
                "autograd does not record");
    const size_t n_inputs = has_output.size();
    if (!grads[0].defined()) return variable_list(n_inputs);
    at::Tensor grad = grads[0];
    // the kernel was compiled for a contiguous gradient of the output's dtype, 16-byte aligned
    if (grad.scalar_type() != grad_dtype || !grad.is_contiguous() ||
        reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 != 0) {
      grad = grad.to(grad_dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
    }
    variable_list unpacked;
    unpacked.reserve(saved.size());
    for (const auto& variable : saved) unpacked.push_back(variable.unpack());
    variable_list outputs(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) {
      if (!has_output[i]) continue;
      outputs[i] = at::empty(output_sizes[i], output_options[i]);
      if (poison_outputs) outputs[i].fill_(std::numeric_limits<double>::quiet_NaN());
    }
    // autograd's device threads use CUDA through the runtime API, which makes a context current only on a call
    // that needs one: a backward served from the caching allocator may run here with none
    void* current = nullptr;
    check_cuda(driver().get_context(&current), plan->name + ": cuCtxGetCurrent");
    if (current != context) check_cuda(driver().set_context(context), plan->name + ": cuCtxSetCurrent");
    int capture_status = 0;
    check_cuda(driver().is_capturing(stream, &capture_status), plan->name + ": cuStreamIsCapturing");
    std::vector<at::Tensor> fresh;
    if (capture_status != 0) {
      // a graph gets buffers of its own: its replays, on any stream, never share them with eager launches
      for (const auto& buffer : scratch) fresh.push_back(at::zeros_like(buffer));
    }
    const std::vector<at::Tensor>& buffers = capture_status != 0 ? fresh : scratch;
    const size_t n_params = plan->types.size();
    std::vector<uint64_t> storage(n_params + 2, 0);  // the last two: Triton's global and profile scratch (null)
    std::vector<void*> params(n_params + 2);
    for (size_t i = 0; i < n_params; ++i) {
      const Value& value = values[i];
      void* slot = &storage[i];
      switch (plan->types[i]) {
        case 'p': {
          const at::Tensor* tensor = nullptr;
          switch (value.pointer.source) {
            case Source::Grad: tensor = &grad; break;
            case Source::Output: tensor = &outputs[value.pointer.index]; break;
            case Source::Saved: tensor = &unpacked[value.pointer.index]; break;
            case Source::Scratch: tensor = &buffers[value.pointer.index]; break;
          }
          storage[i] = reinterpret_cast<uintptr_t>(tensor->data_ptr());
          break;
        }
        case 'i': {
          int32_t narrow = static_cast<int32_t>(value.integer);
          std::memcpy(slot, &narrow, sizeof(narrow));
          break;
        }
        case 'l': std::memcpy(slot, &value.integer, sizeof(int64_t)); break;
        case 'f': {
          float single = static_cast<float>(value.real);
          std::memcpy(slot, &single, sizeof(single));
          break;
        }
      }
      params[i] = slot;
    }
    params[n_params] = &storage[n_params];
    params[n_params + 1] = &storage[n_params + 1];
    check_cuda(driver().launch(reinterpret_cast<void*>(plan->function), grid[0], grid[1], grid[2], plan->threads, 1,
                               1, plan->shared_bytes, stream, params.data(), nullptr),
               plan->name + ": cuLaunchKernel");
    return outputs;
  }
};

int index_of(const std::vector<PyObject*>& objects, PyObject* object) {
  for (size_t i = 0; i < objects.size(); ++i) {
    if (objects[i] == object) return static_cast<int>(i);
  }
  return -1;
}

// Gives `output` (a tensor no autograd graph holds yet) a TritonBackward node as its grad_fn, with an edge to each
// of `inputs` (None: no gradient). `args`: the kernel's arguments as Python would pass them at backward time, with
// `grad_marker` where the output's gradient goes, `output_marker` where the output itself goes and
// output_markers[i] where input i's gradient goes; a tensor among `scratch` is a zero-initialised buffer the
// kernel hands back zeroed; any other tensor is saved for backward. Returns false, attaching nothing, where an
// input carries a forward-mode tangent.
bool attach(std::shared_ptr<Plan> plan, const at::Tensor& output, const std::vector<std::optional<at::Tensor>>& inputs,
            const py::tuple& args, const std::vector<at::Tensor>& scratch, py::handle grad_marker,
            py::handle output_marker, const py::tuple& output_markers, std::vector<unsigned> grid, uintptr_t stream) {
  for (const auto& input : inputs) {
    if (input && input->defined() && input->_fw_grad(/*level=*/0).defined()) return false;
  }
  auto node = new_node<TritonBackward>();
  TritonBackward& backward = *node;
  backward.plan = plan;
  backward.grad_dtype = output.scalar_type();
  backward.stream = reinterpret_cast<void*>(stream);
  check_cuda(driver().get_context(&backward.context), plan->name + ": cuCtxGetCurrent");
  TORCH_CHECK(backward.context != nullptr, plan->name, ": no CUDA context is current (the forward launched nothing?)");
  TORCH_CHECK(grid.size() >= 1 && grid.size() <= 3, plan->name, ": grid: expected 1 to 3 sizes");
  for (size_t i = 0; i < grid.size(); ++i) backward.grid[i] = grid[i];
  std::vector<PyObject*> outputs_of;
  for (auto marker : output_markers) outputs_of.push_back(marker.ptr());
  std::vector<PyObject*> saved_objects;
  backward.values.resize(plan->types.size());
  for (size_t i = 0; i < plan->types.size(); ++i) {
    PyObject* arg = PyTuple_GET_ITEM(args.ptr(), plan->positions[i]);
    Value& value = backward.values[i];
    if (plan->types[i] != 'p') {
      if (plan->types[i] == 'f') {
        value.real = PyFloat_AsDouble(arg);
      } else {
        value.integer = PyLong_AsLongLong(arg);
      }
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;
    }
    if (arg == grad_marker.ptr()) {
      value.pointer = {Source::Grad, 0};
      continue;
    }
    if (arg == output_marker.ptr()) {
      // saved as an alias without autograd history: the output itself would hold this node, which holds it
      int saved_index = index_of(saved_objects, arg);
      if (saved_index < 0) {
        saved_index = static_cast<int>(saved_objects.size());
        saved_objects.push_back(arg);
        backward.saved.emplace_back(output.detach(), /*is_output=*/false);
      }
      value.pointer = {Source::Saved, saved_index};
      continue;
    }
    int output_index = index_of(outputs_of, arg);
    if (output_index >= 0) {
      TORCH_CHECK(static_cast<size_t>(output_index) < inputs.size() && inputs[output_index] &&
                      inputs[output_index]->defined(),
                  plan->name, ": the gradient of input ", output_index, " is written, but that input is None");
      value.pointer = {Source::Output, output_index};
      continue;
    }
    TORCH_CHECK(THPVariable_Check(arg), plan->name, ": argument ", plan->positions[i],
                " of the backward kernel: expected a tensor or a marker");
    const at::Tensor& tensor = THPVariable_Unpack(arg);
    int scratch_index = -1;
    for (size_t j = 0; j < scratch.size(); ++j) {
      if (scratch[j].unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) scratch_index = static_cast<int>(j);
    }
    if (scratch_index >= 0) {
      value.pointer = {Source::Scratch, scratch_index};
      continue;
    }
    int saved_index = index_of(saved_objects, arg);
    if (saved_index < 0) {
      saved_index = static_cast<int>(saved_objects.size());
      saved_objects.push_back(arg);
      backward.saved.emplace_back(tensor, /*is_output=*/false);
    }
    value.pointer = {Source::Saved, saved_index};
  }
  backward.scratch = scratch;
  for (const auto& input : inputs) {
    bool present = input && input->defined();
    backward.has_output.push_back(present);
    backward.output_sizes.push_back(present ? input->sizes().vec() : std::vector<int64_t>{});
    backward.output_options.push_back(present ? input->options().memory_format(at::MemoryFormat::Contiguous)
                                              : at::TensorOptions());
    backward.add_next_edge(present ? torch::autograd::impl::gradient_edge(*input) : torch::autograd::Edge());
  }
  torch::autograd::set_history(output, node);
  return true;
}

}  // namespace

PYBIND11_MODULE(taac_backward_node, m) {
  m.doc() = "C++ autograd nodes that launch a compiled Triton kernel (runtime.accelerators.native)";
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(py::init([](std::string name, uintptr_t function, unsigned threads, unsigned shared_bytes,
                       std::vector<int> positions, std::string types) {
             TORCH_CHECK(positions.size() == types.size(), name, ": one type per parameter position expected");
             return std::make_shared<Plan>(Plan{name, function, threads, shared_bytes, positions, types});
           }))
      .def_readonly("name", &Plan::name)
      .def_readonly("positions", &Plan::positions)
      .def_readonly("types", &Plan::types);
  m.def("attach", &attach);
  m.def("set_poison", [](bool on) { poison_outputs = on; });
}
