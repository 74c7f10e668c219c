// Launch plans: a fixed sequence of the engine's CUDA kernels as ONE MLX operation
// (engine/cuda_ext.py builds and loads this; engine/launch_plan.py makes the plans).
//
// Why: on a GPU a 9B-shaped decode step waits for the host, not the device (BENCHMARKS.md, issue
// 13): each MLX operation costs the host its Python call, its array, the scheduler's visit, an
// allocation and the encoding of its launch (6-14 us a launching operation in a real step,
// views ~2 us), and a Gated DeltaNet layer is ~14 launching operations and ~20 views. A plan is
// one operation whose evaluation adds its kernels to MLX's CUDA graph directly: per kernel only
// the graph node and its dependencies.
//
// What a plan is: kernels compiled here from the same source text mx.fast.cuda_kernel would
// compile (engine/launch_plan.py writes it as MLX's build_kernel does, and this file compiles it
// with NVRTC under MLX's options), and launches whose every argument is a region of one of the
// call's input arrays (an input's base plus a byte offset): weights and states as they are,
// intermediate results in a workspace array the caller keeps, and results in fresh arrays the
// caller allocates through MLX (an empty kernel's outputs) and that the plan's outputs then share.
// This operation allocates nothing: MLX's CUDA allocator has no entry point outside libmlx.
//
// Dependencies: each launch declares the arrays it reads and writes to MLX's command encoder,
// which orders graph nodes by the buffers they touch, as for its own kernels.

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

// What this file uses of CUDA and of MLX's CUDA backend, declared here: the backend's headers
// need fmt and the CUDA toolkit's, which a machine with MLX's CUDA wheel need not have, while the
// functions themselves are exported by libmlx (MLX_API) and found by their C++ names, which do
// not depend on the classes' layout. The one layout used is MLX's CudaBuffer (the buffer behind
// an array: its device pointer first), as mlx/backend/cuda/allocator.h declares it in MLX 0.32;
// the build is keyed to MLX's version and engine/cuda_ext.py's self-test runs a kernel through it.
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
struct CUfunc_st;
struct CUmod_st;
using CUfunction = CUfunc_st*;
using CUmodule = CUmod_st*;
using CUdeviceptr = unsigned long long;

namespace mlx::core::cu {
class CommandEncoder {
 public:
  void set_input_array(const array& arr);
  void set_output_array(const array& arr);
  void add_kernel_node_raw(CUfunction func, dim3 grid_dim, dim3 block_dim, dim3 cluster_dim, uint32_t smem_bytes,
                           void** params);
};
CommandEncoder& get_command_encoder(Stream s);
struct CudaBuffer {
  void* data;
  size_t size;
  int device;
};
}  // namespace mlx::core::cu

namespace {

// NVRTC and the driver, resolved at run time from the libraries libmlx already loaded (it links
// both), so building this needs their headers only.
using nvrtc_program = void*;
struct Nvrtc {
  int (*create)(nvrtc_program*, const char*, const char*, int, const char* const*, const char* const*);
  int (*add_name)(nvrtc_program, const char*);
  int (*compile)(nvrtc_program, int, const char* const*);
  int (*log_size)(nvrtc_program, size_t*);
  int (*log)(nvrtc_program, char*);
  int (*lowered)(nvrtc_program, const char*, const char**);
  int (*cubin_size)(nvrtc_program, size_t*);
  int (*cubin)(nvrtc_program, char*);
  int (*ptx_size)(nvrtc_program, size_t*);
  int (*ptx)(nvrtc_program, char*);
  int (*destroy)(nvrtc_program*);
};
struct Driver {
  int (*load)(CUmodule*, const void*, unsigned int, int*, void**);
  int (*function)(CUfunction*, CUmodule, const char*);
  int (*set_attribute)(CUfunction, int, int);
  int (*init)(unsigned int);
  int (*device)(int*, int);
  int (*attribute)(int*, int, int);
};
// cuda.h's values (CUjit_option, CUfunction_attribute, CUdevice_attribute)
constexpr int JIT_ERROR_LOG_BUFFER = 5, JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;
constexpr int FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int DEVICE_CC_MAJOR = 75, DEVICE_CC_MINOR = 76;

void* symbol(const char* name, const char* library) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (p == nullptr) {
    if (void* h = dlopen(library, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD); h != nullptr) {
      p = dlsym(h, name);
    }
  }
  if (p == nullptr) {
    throw std::runtime_error(std::string("cuda_ext: ") + name + " not found (is MLX's CUDA backend loaded?)");
  }
  return p;
}

// One entry point of `library` into `fn`.
template <typename F>
void resolve(F& fn, const char* name, const char* library) {
  fn = reinterpret_cast<F>(symbol(name, library));
}

const Nvrtc& nvrtc() {
  static const Nvrtc n = [] {
    const char* lib = "libnvrtc.so.13";
    Nvrtc r;
    resolve(r.create, "nvrtcCreateProgram", lib);
    resolve(r.add_name, "nvrtcAddNameExpression", lib);
    resolve(r.compile, "nvrtcCompileProgram", lib);
    resolve(r.log_size, "nvrtcGetProgramLogSize", lib);
    resolve(r.log, "nvrtcGetProgramLog", lib);
    resolve(r.lowered, "nvrtcGetLoweredName", lib);
    resolve(r.cubin_size, "nvrtcGetCUBINSize", lib);
    resolve(r.cubin, "nvrtcGetCUBIN", lib);
    resolve(r.ptx_size, "nvrtcGetPTXSize", lib);
    resolve(r.ptx, "nvrtcGetPTX", lib);
    resolve(r.destroy, "nvrtcDestroyProgram", lib);
    return r;
  }();
  return n;
}

const Driver& driver() {
  static const Driver d = [] {
    const char* lib = "libcuda.so.1";
    Driver r;
    resolve(r.load, "cuModuleLoadDataEx", lib);
    resolve(r.function, "cuModuleGetFunction", lib);
    resolve(r.set_attribute, "cuFuncSetAttribute", lib);
    resolve(r.init, "cuInit", lib);
    resolve(r.device, "cuDeviceGet", lib);
    resolve(r.attribute, "cuDeviceGetAttribute", lib);
    return r;
  }();
  return d;
}

// A compiled kernel. Modules are never unloaded: a plan's kernels live as long as the process,
// like MLX's own JIT modules.
struct Kernel {
  CUfunction fn{nullptr};
  std::string name;
};

// Compiles `source` (a whole translation unit: the generated signature and body included) and
// returns its kernel `name` (a name expression, e.g. "mlx::core::cu::custom_kernel_x"). `arch`:
// NVRTC's --gpu-architecture value; an "sm_" target yields a CUBIN, a "compute_" one PTX for the
// driver to finish. `options`: the rest of NVRTC's options (include paths among them).
std::shared_ptr<Kernel> compile_kernel(const std::string& module_name, const std::string& source,
                                       const std::string& name, const std::string& arch,
                                       const std::vector<std::string>& options, int shared_memory) {
  // MLX has made its device's primary context current on this thread (a plan is made after MLX's
  // first evaluation on the GPU: engine/cuda_ext.py), and the module loads into it
  const Nvrtc& n = nvrtc();
  nvrtc_program prog = nullptr;
  if (n.create(&prog, source.c_str(), (module_name + ".cu").c_str(), 0, nullptr, nullptr) != 0) {
    throw std::runtime_error("cuda_ext: nvrtcCreateProgram failed for " + module_name);
  }
  struct Free {
    nvrtc_program* p;
    ~Free() { nvrtc().destroy(p); }
  } free_prog{&prog};
  n.add_name(prog, name.c_str());
  std::vector<std::string> all{"--device-as-default-execution-space", "--gpu-architecture=" + arch};
  all.insert(all.end(), options.begin(), options.end());
  std::vector<const char*> args;
  for (const auto& a : all) {
    args.push_back(a.c_str());
  }
  if (n.compile(prog, static_cast<int>(args.size()), args.data()) != 0) {
    size_t size = 0;
    n.log_size(prog, &size);
    std::string log(size + 1, '\0');
    n.log(prog, log.data());
    throw std::runtime_error("cuda_ext: " + module_name + " did not compile: " + log);
  }
  const char* lowered = nullptr;
  if (n.lowered(prog, name.c_str(), &lowered) != 0 || lowered == nullptr) {
    throw std::runtime_error("cuda_ext: no kernel " + name + " in " + module_name);
  }
  std::string mangled(lowered);  // owned by the program, which is destroyed on return
  bool sass = arch.rfind("sm_", 0) == 0;
  size_t size = 0;
  std::string image;
  if (sass) {
    n.cubin_size(prog, &size);
    image.resize(size);
    n.cubin(prog, image.data());
  } else {
    n.ptx_size(prog, &size);
    image.resize(size);
    n.ptx(prog, image.data());
  }
  const Driver& d = driver();
  char log[4096] = {};
  int opts[] = {JIT_ERROR_LOG_BUFFER, JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log, reinterpret_cast<void*>(sizeof(log) - 1)};
  CUmodule module = nullptr;
  if (d.load(&module, image.data(), 2, opts, values) != 0) {
    throw std::runtime_error("cuda_ext: " + module_name + " did not load: " + log);
  }
  auto k = std::make_shared<Kernel>();
  k->name = name;
  if (d.function(&k->fn, module, mangled.c_str()) != 0) {
    throw std::runtime_error("cuda_ext: " + name + " not in its module");
  }
  if (shared_memory > 48000) {
    d.set_attribute(k->fn, FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_memory);
  }
  return k;
}

// One argument of a launch: the region of the call's input `input` starting `offset` bytes into
// it (`written`: the kernel writes it, an output parameter), or where `input` is -1 a parameter
// passed by value, its bytes in `value` (an input's Shape or Strides, MLX's way).
struct Arg {
  int input;
  int64_t offset;
  bool written;
  std::string value;
};

struct Launch {
  std::shared_ptr<Kernel> kernel;
  dim3 grid, block;
  unsigned int shared_memory;
  std::vector<Arg> args;
};

// A plan: its launches in order, how many inputs a call takes and the least bytes each must hold
// (every region a launch touches lies inside), and for each output the input whose buffer it
// shares (whole: shape, dtype and all).
struct Plan {
  std::string name;
  std::vector<Launch> launches;
  std::vector<int64_t> input_bytes;
  std::vector<int> outputs;
};

class PlanPrimitive : public mx::Primitive {
 public:
  PlanPrimitive(mx::Stream s, std::shared_ptr<Plan> plan) : mx::Primitive(s), plan_(std::move(plan)) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("a launch plan runs on CUDA only");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Plan& p = *plan_;
    for (size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].copy_shared_buffer(inputs[p.outputs[i]]);
    }
    auto& encoder = mx::cu::get_command_encoder(stream());
    std::vector<CUdeviceptr> pointers;
    std::vector<void*> params;
    for (const Launch& l : p.launches) {
      pointers.resize(l.args.size());
      params.resize(l.args.size());
      for (size_t j = 0; j < l.args.size(); ++j) {
        const Arg& a = l.args[j];
        if (a.input < 0) {
          params[j] = const_cast<char*>(a.value.data());  // copied into the node when it is added
          continue;
        }
        const mx::array& in = inputs[a.input];
        if (!in.flags().row_contiguous) {
          throw std::runtime_error("cuda_ext: plan " + p.name + " was handed an input that is not row-contiguous");
        }
        auto* buffer = static_cast<const mx::cu::CudaBuffer*>(in.buffer().ptr());
        pointers[j] = reinterpret_cast<CUdeviceptr>(buffer->data) + in.offset() + a.offset;
        params[j] = &pointers[j];
        // the encoder orders this node after the last writer of every buffer it touches, and
        // records it as the writer of those it writes
        if (a.written) {
          encoder.set_output_array(in);
        } else {
          encoder.set_input_array(in);
        }
      }
      encoder.add_kernel_node_raw(l.kernel->fn, l.grid, l.block, dim3(1, 1, 1), l.shared_memory, params.data());
    }
  }

  const char* name() const override { return "LaunchPlan"; }

 private:
  std::shared_ptr<Plan> plan_;
};

using LaunchSpec = std::tuple<std::shared_ptr<Kernel>, std::tuple<int, int, int>, std::tuple<int, int, int>, int,
                              std::vector<std::tuple<int, int64_t, bool, nb::bytes>>>;

std::shared_ptr<Plan> make_plan(const std::string& name, const std::vector<LaunchSpec>& launches,
                                      const std::vector<int64_t>& input_bytes, const std::vector<int>& outputs) {
  auto p = std::make_shared<Plan>();
  p->name = name;
  p->input_bytes = input_bytes;
  p->outputs = outputs;
  int n = static_cast<int>(input_bytes.size());
  for (int o : outputs) {
    if (o < 0 || o >= n) {
      throw std::invalid_argument("cuda_ext: an output shares an input the plan does not have");
    }
  }
  for (const auto& [kernel, grid, block, smem, args] : launches) {
    Launch l;
    l.kernel = kernel;
    // MLX's cuda_kernel takes the grid in threads and launches ceil(grid / block) blocks
    auto [gx, gy, gz] = grid;
    auto [bx, by, bz] = block;
    if (bx <= 0 || by <= 0 || bz <= 0 || gx <= 0 || gy <= 0 || gz <= 0) {
      throw std::invalid_argument("cuda_ext: a launch's grid and block must be positive");
    }
    l.block = dim3(std::min(bx, gx), std::min(by, gy), std::min(bz, gz));
    l.grid = dim3((gx + bx - 1) / bx, (gy + by - 1) / by, (gz + bz - 1) / bz);
    l.shared_memory = static_cast<unsigned int>(smem);
    for (const auto& [input, offset, written, value] : args) {
      if (input == -1) {
        if (value.size() == 0) {
          throw std::invalid_argument("cuda_ext: a by-value launch argument without bytes");
        }
        l.args.push_back(Arg{-1, 0, false, std::string(value.c_str(), value.size())});
        continue;
      }
      if (input < 0 || input >= n || offset < 0 || offset >= std::max<int64_t>(input_bytes[input], 1)) {
        throw std::invalid_argument("cuda_ext: a launch argument outside the plan's inputs");
      }
      l.args.push_back(Arg{input, offset, written, {}});
    }
    p->launches.push_back(std::move(l));
  }
  return p;
}

// One call of a plan: the arrays must be the plan's inputs in order, each row-contiguous and at
// least as large as the plan says (checked: a region outside its array would be read or written
// on the device without a word).
std::vector<mx::array> run_plan(const std::shared_ptr<Plan>& plan, const std::vector<mx::array>& inputs) {
  const Plan& p = *plan;
  if (inputs.size() != p.input_bytes.size()) {
    throw std::invalid_argument("cuda_ext: plan " + p.name + " takes " + std::to_string(p.input_bytes.size()) +
                                " inputs, got " + std::to_string(inputs.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const mx::array& a = inputs[i];
    if (static_cast<int64_t>(a.nbytes()) < p.input_bytes[i]) {
      throw std::invalid_argument("cuda_ext: plan " + p.name + "'s input " + std::to_string(i) + " is too small");
    }
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (int o : p.outputs) {
    shapes.push_back(inputs[o].shape());
    dtypes.push_back(inputs[o].dtype());
  }
  mx::Stream s = mx::default_stream(mx::Device::gpu);
  // a view among the inputs must be row-contiguous when it is evaluated (checked there): the
  // kernels read every region as dense rows
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::make_shared<PlanPrimitive>(s, plan),
                                inputs);
}

}  // namespace

NB_MODULE(spruce_cuda_ext, m) {
  nb::class_<Kernel>(m, "Kernel").def_ro("name", &Kernel::name);
  nb::class_<Plan>(m, "Plan")
      .def_ro("name", &Plan::name)
      .def_prop_ro("launches", [](const Plan& p) { return p.launches.size(); });
  m.def("compile_kernel", &compile_kernel, nb::arg("module_name"), nb::arg("source"), nb::arg("name"),
        nb::arg("arch"), nb::arg("options"), nb::arg("shared_memory") = 0,
        "Compile one kernel's whole source with NVRTC and load it.");
  m.def("make_plan", &make_plan, nb::arg("name"), nb::arg("launches"), nb::arg("input_bytes"), nb::arg("outputs"),
        "A launch plan: (kernel, grid in threads, block, shared memory, [(input, byte offset, written, "
        "by-value bytes)]) a launch.");
  m.def("run_plan", &run_plan, nb::arg("plan"), nb::arg("inputs"), "One call of a plan, as one MLX operation.");
  m.def("compute_capability", [] {
    const Driver& d = driver();
    int dev = 0, major = 0, minor = 0;
    if (d.init(0) != 0 || d.device(&dev, 0) != 0 || d.attribute(&major, DEVICE_CC_MAJOR, dev) != 0 ||
        d.attribute(&minor, DEVICE_CC_MINOR, dev) != 0) {
      throw std::runtime_error("cuda_ext: the GPU's compute capability could not be read");
    }
    return std::make_tuple(major, minor);
  }, "The compute capability of CUDA device 0 (MLX's).");
}
