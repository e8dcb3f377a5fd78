// The emcl:: torch operators: their schemas (generated into emcl_interface.h from
// emcl_kernels/interface.py), the argument checks every implementation runs first, the small
// informational ops, and the Python module stub.
//
// The CPU kernels register themselves in emcl_cpu.cpp, the CUDA kernels in emcl_cuda.cu; the
// fake (meta) implementations that let torch.compile trace a step live in Python
// (emcl_kernels/backends/extension.py, torch.library.register_fake).
#include <Python.h>

#include <algorithm>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <bitset>

#include "emcl_interface.h"
#include "emcl_ops.h"

namespace emcl {

std::atomic<int64_t> g_launch_count{0};
std::atomic<uint64_t> g_cpu_threads_mask{0};

namespace {

bool is_param_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

at::ScalarType compute_dtype(at::ScalarType param) {
  return param == at::kDouble ? at::kDouble : at::kFloat;
}

// Tensor `t` is laid out like param `p`: the same sizes, and the same strides on every
// dimension of more than one element (a size-1 dimension's stride moves nothing; autograd's
// layout contract lets a gradient differ from its parameter there). Together with "dense and
// non-overlapping" this makes element k of `t`'s memory the same index as element k of `p`'s.
bool same_layout(const at::Tensor& t, const at::Tensor& p) {
  const auto ts = t.sizes(), ps = p.sizes();
  if (ts != ps) return false;
  const auto tst = t.strides(), pst = p.strides();
  for (size_t d = 0; d < ts.size(); ++d) {
    if (ts[d] != 1 && tst[d] != pst[d]) return false;
  }
  return true;
}

// One tensor of the lists: defined, strided, on `device`, of dtype `want`, laid out like `p`,
// and dense non-overlapping (so a kernel may treat it as numel() elements from data_ptr()).
void check_tensor(const char* role, size_t i, const at::Tensor& t, at::ScalarType want,
                  const at::Tensor& p, const at::Device& device) {
  TORCH_CHECK(t.defined(), role, "[", i, "] is undefined (None); every list needs a tensor "
              "per parameter");
  TORCH_CHECK(t.layout() == at::kStrided, role, "[", i, "] is ", t.layout(),
              "; the EMCL kernels take dense (strided) tensors only");
  TORCH_CHECK(t.device() == device, role, "[", i, "] is on ", t.device(), " but the call's "
              "tensors are on ", device, "; a call takes the tensors of one device");
  TORCH_CHECK_TYPE(t.scalar_type() == want, role, "[", i, "] has dtype ", t.scalar_type(),
                   " but ", want, " is expected (params and grads share the parameter dtype; "
                   "the state is float32, float64 for float64 parameters)");
  if (&t != &p) {
    TORCH_CHECK_VALUE(same_layout(t, p), role, "[", i, "] has shape ", t.sizes(),
                      " and strides ", t.strides(), " but params[", i, "] has shape ",
                      p.sizes(), " and strides ", p.strides(),
                      "; every tensor must be laid out like its parameter");
  }
  TORCH_CHECK(t.numel() == 0 || t.is_non_overlapping_and_dense(), role, "[", i,
              "] is not dense (strides ", t.strides(), " for shape ", t.sizes(),
              "); pass a contiguous (or channels_last, or other dense) tensor");
}

// A one-dimensional contiguous tensor of `count` elements of `dtype` on `device`.
void check_vector(const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t count,
                  const at::Device& device, const char* what) {
  TORCH_CHECK(t.defined(), name, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, " (", what,
                   "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.numel() == count, name, " must be one-dimensional with ",
                    count, " elements (", what, "), got shape ", t.sizes());
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), name, " must be a contiguous "
              "dense tensor (", what, ")");
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the call's tensors are "
              "on ", device);
}

void check_flag(const char* name, const OptTensor& t, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->defined(), name, " is undefined; pass None instead");
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " must be float32 (as "
                   "torch.amp.GradScaler makes it), got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->numel() == 1, name, " must have one element, got shape ", t->sizes());
  TORCH_CHECK(t->layout() == at::kStrided, name, " must be a dense tensor");
  TORCH_CHECK(t->device() == device, name, " is on ", t->device(), " but the call's tensors "
              "are on ", device);
}

void check_runs(int64_t runs) {
  TORCH_CHECK_VALUE(runs >= 1, "runs must be >= 1 (the runs of an array; 1: no array), got ",
                    runs);
}

void check_counters(const at::Tensor& counters, const at::Device& device, int64_t runs) {
  check_vector("counters", counters, at::kLong, counters_size(runs), device,
               runs == 1 ? "the device's step counters, emcl_kernels.interface.COUNTER_FIELDS"
                         : "the device's step counters, emcl_kernels.interface.COUNTER_FIELDS, "
                           "then a found flag and a skip count per run: "
                           "emcl_kernels.interface.counters_size(runs)");
}

// hyper: contiguous fp64 on `device`, one row of hyper::kCount raw values per run (1-d for a
// single run; [runs, kCount] or 1-d of runs * kCount for an array).
void check_hyper(const at::Tensor& hyper, const at::Device& device, int64_t runs) {
  if (runs == 1) {
    check_vector("hyper", hyper, at::kDouble, hyper::kCount, device,
                 "the raw hyper-parameters, emcl_kernels.interface.HYPER_FIELDS");
    return;
  }
  TORCH_CHECK(hyper.defined(), "hyper is undefined");
  TORCH_CHECK_TYPE(hyper.scalar_type() == at::kDouble, "hyper must be float64 (the raw "
                   "hyper-parameters), got ", hyper.scalar_type());
  TORCH_CHECK_VALUE(hyper.numel() == runs * hyper::kCount &&
                        (hyper.dim() == 1 || (hyper.dim() == 2 && hyper.size(0) == runs)),
                    "hyper must hold one row of ", hyper::kCount, " raw hyper-parameters "
                    "(emcl_kernels.interface.HYPER_FIELDS) per run: shape [", runs, ", ",
                    hyper::kCount, "] (or ", runs * hyper::kCount, " elements in one "
                    "dimension) for runs=", runs, ", got shape ", hyper.sizes());
  TORCH_CHECK(hyper.layout() == at::kStrided && hyper.is_contiguous(), "hyper must be a "
              "contiguous dense tensor (the raw hyper-parameters, one row per run)");
  TORCH_CHECK(hyper.device() == device, "hyper is on ", hyper.device(), " but the call's "
              "tensors are on ", device);
}

// Every tensor of an array of `runs` runs holds numel / runs elements of each run.
void check_divisible(const char* role, size_t i, const at::Tensor& t, int64_t runs) {
  TORCH_CHECK_VALUE(t.numel() % runs == 0, role, "[", i, "] has ", t.numel(), " elements, "
                    "not a multiple of runs=", runs, "; every tensor of an array of runs "
                    "holds the same number of elements of each run (the run is its leading "
                    "dimension)");
}

}  // namespace

StepCall check_step_call(const Lists& l, const at::Tensor& steps, const at::Tensor& hyper,
                         const at::Tensor& counters, int64_t op, bool prox, int64_t importance,
                         int64_t lr_mode, int64_t meta_every, const OptTensor& grad_scale,
                         const OptTensor& found_inf, int64_t runs) {
  check_runs(runs);
  TORCH_CHECK_VALUE(op >= 0 && op <= static_cast<int64_t>(Op::kCadence), "op must be one of "
                    "emcl_kernels.interface.OP (0 inner, 1 meta, 2 inner_meta, 3 cadence), "
                    "got ", op);
  TORCH_CHECK_VALUE(importance >= 0 && importance <= static_cast<int64_t>(Importance::kSI),
                    "importance must be one of emcl_kernels.interface.IMPORTANCE (0 taylor, "
                    "1 si), got ", importance);
  TORCH_CHECK_VALUE(lr_mode >= 0 && lr_mode <= static_cast<int64_t>(LrMode::kConstant),
                    "lr_mode must be one of emcl_kernels.interface.LR_MODE (0 recurrent, "
                    "1 inverse, 2 constant), got ", lr_mode);
  TORCH_CHECK_VALUE(meta_every >= 1, "meta_every must be >= 1, got ", meta_every);

  const size_t n = l.params.size();
  TORCH_CHECK_VALUE(l.grads.size() == n && l.anchors.size() == n && l.importances.size() == n,
                    "params, grads, anchors and importances must have one tensor each per "
                    "parameter; got ", n, ", ", l.grads.size(), ", ", l.anchors.size(), ", ",
                    l.importances.size());
  const bool alpha = static_cast<LrMode>(lr_mode) == LrMode::kRecurrent;
  TORCH_CHECK_VALUE(l.meta_lrs.size() == (alpha ? n : 0),
                    alpha ? "lr_mode=recurrent needs one meta_lrs tensor per parameter"
                          : "meta_lrs must be empty unless lr_mode is recurrent",
                    "; got ", l.meta_lrs.size(), " for ", n, " parameters");

  TORCH_CHECK(counters.defined(), "counters is undefined");
  const at::Device device = n > 0 && l.params[0].defined() ? l.params[0].device()
                                                           : counters.device();
  const at::ScalarType dtype = n > 0 && l.params[0].defined() ? l.params[0].scalar_type()
                                                              : at::kFloat;
  TORCH_CHECK_TYPE(is_param_dtype(dtype), "params must be float32, float64, bfloat16 or "
                   "float16, got ", dtype);
  check_counters(counters, device, runs);
  check_hyper(hyper, device, runs);
  TORCH_CHECK(steps.defined(), "steps is undefined; pass an empty float32 tensor when the "
              "meta steps are not counted");
  TORCH_CHECK_TYPE(steps.scalar_type() == at::kFloat, "steps must be float32 (the step of each "
                   "parameter's optimizer state), got ", steps.scalar_type());
  TORCH_CHECK_VALUE(steps.numel() == 0 || (steps.dim() == 1 && static_cast<size_t>(
                    steps.numel()) == n * static_cast<size_t>(runs)),
                    "steps must be empty or one-dimensional with ",
                    runs == 1 ? "one element per parameter (" : "runs elements per parameter, "
                    "param-major (", n * static_cast<size_t>(runs), "), got shape ",
                    steps.sizes());
  TORCH_CHECK(steps.layout() == at::kStrided && steps.is_contiguous(), "steps must be a "
              "contiguous dense tensor");
  TORCH_CHECK(steps.numel() == 0 || steps.device() == device, "steps is on ", steps.device(),
              " but the call's tensors are on ", device);

  const at::ScalarType state = compute_dtype(dtype);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = l.params[i];
    check_tensor("params", i, p, dtype, p, device);
    check_tensor("grads", i, l.grads[i], dtype, p, device);
    check_tensor("anchors", i, l.anchors[i], state, p, device);
    check_tensor("importances", i, l.importances[i], state, p, device);
    if (alpha) check_tensor("meta_lrs", i, l.meta_lrs[i], state, p, device);
    // the other lists have p's sizes (checked above)
    if (runs > 1) check_divisible("params", i, p, runs);
  }
  check_flag("grad_scale", grad_scale, device);
  check_flag("found_inf", found_inf, device);
  return StepCall{static_cast<Op>(op),
                  prox,
                  static_cast<Importance>(importance),
                  static_cast<LrMode>(lr_mode),
                  meta_every,
                  alpha,
                  device,
                  dtype,
                  runs};
}

at::Device check_finite_call(at::TensorList grads, const at::Tensor& counters, int64_t runs) {
  check_runs(runs);
  TORCH_CHECK(counters.defined(), "counters is undefined");
  const at::Device device = counters.device();
  check_counters(counters, device, runs);
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.defined(), "grads[", i, "] is undefined (None)");
    TORCH_CHECK_TYPE(is_param_dtype(g.scalar_type()), "grads[", i, "] has dtype ",
                     g.scalar_type(), "; gradients must be float32, float64, bfloat16 or "
                     "float16");
    check_tensor("grads", i, g, g.scalar_type(), g, device);
    if (runs > 1) check_divisible("grads", i, g, runs);
  }
  return device;
}

namespace {

int64_t launch_count() { return g_launch_count.load(std::memory_order_relaxed); }

int64_t cpu_threads_used() {
  return static_cast<int64_t>(
      std::bitset<64>(g_cpu_threads_mask.load(std::memory_order_relaxed)).count());
}

std::string interface_layout() { return kLayout; }

}  // namespace
}  // namespace emcl

TORCH_LIBRARY(emcl, m) {
  // [note: schemas] in emcl_kernels/interface.py: the ops update their tensors in place and
  // return nothing; every written list has its own alias set.
  m.def(emcl::kStepSchema);
  m.def(emcl::kCheckFiniteSchema);
  // The interface layout this library was built with (Python compares it with
  // emcl_kernels.interface.layout_string() and refuses a stale build).
  m.def("interface() -> str", &emcl::interface_layout);
  // CUDA kernel launches of this library so far, both kinds (finite check and update).
  m.def("launch_count() -> int", &emcl::launch_count);
  // How many intra-op threads ran a piece of the last pass of the CPU kernels.
  m.def("cpu_threads_used() -> int", &emcl::cpu_threads_used);
}

// ---------------------------------------------------------------------------------------------
// [note: direct entry points] emcl_kernels._C.step and _C.check_finite call the operators with
// the positional arguments of their schemas, from Python, without torch.ops' generic argument
// parsing: that path matches every argument against the schema by name and type and costs
// about 10 us per step_ call on the 2-core test machine (18 us for a call with empty lists
// against 8 us for an op without arguments), a fifth of an MLP step. These functions only
// unpack the arguments (a list of tensors is a few pointer copies per tensor) and call the same
// operator through the dispatcher (c10::TypedOperatorHandle::call), so everything the dispatcher
// does for torch.ops (the device's kernel, profiler records, dispatch modes, Python subclasses
// with __torch_dispatch__) happens just the same; the GIL is released while the operator runs,
// as torch's own bindings do. backends/extension.py uses them outside torch.compile (which
// traces torch.ops.emcl.* instead).
// ---------------------------------------------------------------------------------------------
namespace emcl {
namespace {

using StepFn = void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                    at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    int64_t, bool, int64_t, int64_t, int64_t, bool, bool, const OptTensor&,
                    const OptTensor&, int64_t);
using CheckFiniteFn = void(at::TensorList, const at::Tensor&, int64_t);

// The arguments' positions in kStepSchema. The last one, runs, has a default (1): the entry
// points take the arguments with or without it.
const char* const kStepArgs[] = {"params", "grads", "anchors", "importances", "meta_lrs",
                                 "steps", "hyper", "counters", "op", "prox", "importance",
                                 "lr_mode", "meta_every", "check", "finalize", "grad_scale",
                                 "found_inf", "runs"};
constexpr Py_ssize_t kStepNargs = sizeof(kStepArgs) / sizeof(kStepArgs[0]);

std::vector<at::Tensor> unpack_list(PyObject* obj, const char* name) {
  TORCH_CHECK_TYPE(PyList_Check(obj) || PyTuple_Check(obj), name,
                   " must be a list of tensors, got ", Py_TYPE(obj)->tp_name);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    TORCH_CHECK_TYPE(THPVariable_Check(items[i]), name, "[", i, "] must be a tensor, got ",
                     Py_TYPE(items[i])->tp_name);
    out.push_back(THPVariable_Unpack(items[i]));
  }
  return out;
}

const at::Tensor& unpack_tensor(PyObject* obj, const char* name) {
  TORCH_CHECK_TYPE(THPVariable_Check(obj), name, " must be a tensor, got ",
                   Py_TYPE(obj)->tp_name);
  return THPVariable_Unpack(obj);
}

OptTensor unpack_optional(PyObject* obj, const char* name) {
  if (obj == Py_None) return std::nullopt;
  return unpack_tensor(obj, name);
}

int64_t unpack_int(PyObject* obj, const char* name) {
  TORCH_CHECK_TYPE(PyLong_Check(obj) && !PyBool_Check(obj), name, " must be an int, got ",
                   Py_TYPE(obj)->tp_name);
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    TORCH_CHECK_VALUE(false, name, " does not fit in 64 bits");
  }
  return static_cast<int64_t>(v);
}

bool unpack_bool(PyObject* obj, const char* name) {
  TORCH_CHECK_TYPE(PyBool_Check(obj), name, " must be a bool, got ", Py_TYPE(obj)->tp_name);
  return obj == Py_True;
}

// Releases the GIL for its lifetime.
class WithoutGil {
 public:
  WithoutGil() : state_(PyEval_SaveThread()) {}
  ~WithoutGil() { PyEval_RestoreThread(state_); }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

PyObject* py_step(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == kStepNargs || nargs == kStepNargs - 1, "emcl_kernels._C.step "
                   "takes the ", kStepNargs, " arguments of torch.ops.emcl.step_ by position "
                   "(runs may be left out), got ", nargs);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("emcl::step_", "")
                             .typed<StepFn>();
  const auto params = unpack_list(args[0], kStepArgs[0]);
  const auto grads = unpack_list(args[1], kStepArgs[1]);
  const auto anchors = unpack_list(args[2], kStepArgs[2]);
  const auto importances = unpack_list(args[3], kStepArgs[3]);
  const auto meta_lrs = unpack_list(args[4], kStepArgs[4]);
  const at::Tensor& steps = unpack_tensor(args[5], kStepArgs[5]);
  const at::Tensor& hyper = unpack_tensor(args[6], kStepArgs[6]);
  const at::Tensor& counters = unpack_tensor(args[7], kStepArgs[7]);
  const int64_t op_code = unpack_int(args[8], kStepArgs[8]);
  const bool prox = unpack_bool(args[9], kStepArgs[9]);
  const int64_t importance = unpack_int(args[10], kStepArgs[10]);
  const int64_t lr_mode = unpack_int(args[11], kStepArgs[11]);
  const int64_t meta_every = unpack_int(args[12], kStepArgs[12]);
  const bool check = unpack_bool(args[13], kStepArgs[13]);
  const bool finalize = unpack_bool(args[14], kStepArgs[14]);
  const OptTensor grad_scale = unpack_optional(args[15], kStepArgs[15]);
  const OptTensor found_inf = unpack_optional(args[16], kStepArgs[16]);
  const int64_t runs = nargs == kStepNargs ? unpack_int(args[17], kStepArgs[17]) : 1;
  {
    const WithoutGil released;
    op.call(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, op_code,
            prox, importance, lr_mode, meta_every, check, finalize, grad_scale, found_inf,
            runs);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// emcl_kernels._C.check_step_call: the argument checks of torch.ops.emcl.step_ alone
// (check_step_call above), for a launcher outside this library (the Triton backend) that walks
// the same raw addresses: a C++ pass over the lists instead of one Python call per tensor and
// property. Raises what step_ would raise; returns None.
PyObject* py_check_step_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == kStepNargs || nargs == kStepNargs - 1,
                   "emcl_kernels._C.check_step_call takes the ", kStepNargs, " arguments of "
                   "torch.ops.emcl.step_ by position (runs may be left out), got ", nargs);
  const auto params = unpack_list(args[0], kStepArgs[0]);
  const auto grads = unpack_list(args[1], kStepArgs[1]);
  const auto anchors = unpack_list(args[2], kStepArgs[2]);
  const auto importances = unpack_list(args[3], kStepArgs[3]);
  const auto meta_lrs = unpack_list(args[4], kStepArgs[4]);
  const Lists lists{params, grads, anchors, importances, meta_lrs};
  check_step_call(lists, unpack_tensor(args[5], kStepArgs[5]),
                  unpack_tensor(args[6], kStepArgs[6]), unpack_tensor(args[7], kStepArgs[7]),
                  unpack_int(args[8], kStepArgs[8]), unpack_bool(args[9], kStepArgs[9]),
                  unpack_int(args[10], kStepArgs[10]), unpack_int(args[11], kStepArgs[11]),
                  unpack_int(args[12], kStepArgs[12]),
                  unpack_optional(args[15], kStepArgs[15]),
                  unpack_optional(args[16], kStepArgs[16]),
                  nargs == kStepNargs ? unpack_int(args[17], kStepArgs[17]) : 1);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_check_finite(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 2 || nargs == 3, "emcl_kernels._C.check_finite takes (grads, "
                   "counters[, runs]), got ", nargs, " arguments");
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("emcl::check_finite_", "")
                             .typed<CheckFiniteFn>();
  const auto grads = unpack_list(args[0], "grads");
  const at::Tensor& counters = unpack_tensor(args[1], "counters");
  const int64_t runs = nargs == 3 ? unpack_int(args[2], "runs") : 1;
  {
    const WithoutGil released;
    op.call(grads, counters, runs);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// emcl_kernels._C.plan_grads(sources, key, like): the per-step half of [note: plan keys]
// (emcl_kernels/plan.py) for one plan, in one C++ pass instead of a dozen Python passes of one
// attribute each (about 0.5 ms a step for 1,000 parameters). Returns (grads, grad_ptrs), the
// gradients of `sources` and their addresses, when every parameter is still the tensor the
// plan was built for and every gradient matches it exactly: the data_ptr, sizes and strides
// recorded in `key` (int64, per parameter: data_ptr, ndim, sizes..., strides...), the dtype
// and device of `like`, strided layouts, and each gradient with its parameter's sizes and
// strides. Returns None on any difference, without saying which: the caller then takes its
// Python path, which decides (a gradient may differ in the stride of a size-1 dimension) and
// names what changed. It accepts only what that path accepts.
class ListRef {  // a new reference, released unless handed on
 public:
  explicit ListRef(Py_ssize_t n) : obj_(PyList_New(n)) {
    if (obj_ == nullptr) throw python_error();
  }
  ~ListRef() { Py_XDECREF(obj_); }
  ListRef(const ListRef&) = delete;
  ListRef& operator=(const ListRef&) = delete;
  PyObject* get() const { return obj_; }
  PyObject* release() {
    PyObject* out = obj_;
    obj_ = nullptr;
    return out;
  }

 private:
  PyObject* obj_;
};

int64_t address(const at::Tensor& t) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
}

// The entries of a key argument (plan_grads', layouts_are's): a contiguous 1-d int64 CPU tensor.
const int64_t* key_entries(PyObject* arg, int64_t* count) {
  const at::Tensor& key = unpack_tensor(arg, "key");
  TORCH_CHECK_VALUE(key.device().is_cpu() && key.scalar_type() == at::kLong &&
                        key.dim() == 1 && key.is_contiguous(),
                    "key must be a contiguous 1-d int64 CPU tensor");
  *count = key.numel();
  return key.const_data_ptr<int64_t>();
}

PyObject* py_plan_grads(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 3, "emcl_kernels._C.plan_grads takes (sources, key, like), got ",
                   nargs, " arguments");
  PyObject* sources = args[0];
  TORCH_CHECK_TYPE(PyList_Check(sources), "sources must be a list, got ",
                   Py_TYPE(sources)->tp_name);
  int64_t klen = 0;
  const int64_t* k = key_entries(args[1], &klen);
  const at::Tensor& like = unpack_tensor(args[2], "like");
  const at::ScalarType dtype = like.scalar_type();
  const at::Device device = like.device();
  const Py_ssize_t n = PyList_GET_SIZE(sources);
  ListRef grads(n), ptrs(n);
  int64_t pos = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(sources, i);
    if (!THPVariable_Check(item) || pos + 2 > klen) Py_RETURN_NONE;
    const at::Tensor& p = THPVariable_Unpack(item);
    const int64_t ndim = k[pos + 1];
    if (!p.defined() || p.layout() != at::kStrided || p.scalar_type() != dtype ||
        p.device() != device || p.dim() != ndim || pos + 2 + 2 * ndim > klen ||
        address(p) != k[pos]) {
      Py_RETURN_NONE;
    }
    const auto sizes = p.sizes();
    const auto strides = p.strides();
    for (int64_t d = 0; d < ndim; ++d) {
      if (sizes[d] != k[pos + 2 + d] || strides[d] != k[pos + 2 + ndim + d]) Py_RETURN_NONE;
    }
    pos += 2 + 2 * ndim;
    const at::Tensor& g = p.grad();
    if (!g.defined() || g.layout() != at::kStrided || g.scalar_type() != dtype ||
        g.device() != device || g.sizes() != sizes || g.strides() != strides) {
      Py_RETURN_NONE;
    }
    PyObject* wrapped = THPVariable_Wrap(g);
    if (wrapped == nullptr) throw python_error();
    PyList_SET_ITEM(grads.get(), i, wrapped);
    PyObject* ptr = PyLong_FromLongLong(static_cast<long long>(address(g)));
    if (ptr == nullptr) throw python_error();
    PyList_SET_ITEM(ptrs.get(), i, ptr);
  }
  if (pos != klen) Py_RETURN_NONE;
  PyObject* out = PyTuple_New(2);
  if (out == nullptr) throw python_error();
  PyTuple_SET_ITEM(out, 0, grads.release());
  PyTuple_SET_ITEM(out, 1, ptrs.release());
  return out;
  END_HANDLE_TH_ERRORS
}

// emcl_kernels._C.identical(a, b): lists `a` and `b` hold the same objects in the same order
// (`is`, not ==); _C.items_are(dicts, key, values): dicts[i].get(key) is values[i] for every i.
// The rest of the per-step key ([note: plan keys]): a pointer comparison per element where
// `all(map(operator.is_, a, b))` makes a Python call per element.
PyObject* py_identical(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 2 && PyList_Check(args[0]) && PyList_Check(args[1]),
                   "emcl_kernels._C.identical takes two lists");
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  if (PyList_GET_SIZE(args[1]) != n) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_ITEM(args[0], i) != PyList_GET_ITEM(args[1], i)) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_items_are(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 3 && PyList_Check(args[0]) && PyList_Check(args[2]),
                   "emcl_kernels._C.items_are takes (dicts: list, key, values: list)");
  const Py_ssize_t n = PyList_GET_SIZE(args[0]);
  if (PyList_GET_SIZE(args[2]) != n) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PyList_GET_ITEM(args[0], i);
    if (!PyDict_Check(d)) Py_RETURN_FALSE;
    PyObject* v = PyDict_GetItemWithError(d, args[1]);  // borrowed
    if (v == nullptr && PyErr_Occurred()) throw python_error();
    if ((v == nullptr ? Py_None : v) != PyList_GET_ITEM(args[2], i)) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// emcl_kernels._C.plainly_valid_call(plain_types, params, grads, anchors, importances,
// meta_lrs): True when a functional call's lists pass every check of
// emcl_kernels.functional.check_lists in the common case, in one C++ pass: every tensor of an
// exact type in `plain_types` (torch.Tensor, nn.Parameter); every parameter contiguous, of a
// parameter dtype, with data; its gradient of its dtype and its state of the state dtype,
// each with its device, sizes and strides; and no two non-empty tensors sharing memory.
// False means "run the Python checks", which raise with a message naming the tensor, or pass
// (a channels_last parameter, say). The lists have equal lengths (checked by the caller);
// meta_lrs may be empty.
bool is_plain(PyObject* obj, PyObject* plain_types) {
  const Py_ssize_t n = PyTuple_GET_SIZE(plain_types);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) == PyTuple_GET_ITEM(plain_types, i)) {
      return true;
    }
  }
  return false;
}

struct Span {
  int64_t device;  // type * 2**16 + index + 1
  int64_t start, end;
  bool operator<(const Span& o) const {
    return device != o.device ? device < o.device : start < o.start;
  }
};

PyObject* py_plainly_valid_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 6 && PyTuple_Check(args[0]),
                   "emcl_kernels._C.plainly_valid_call takes (plain_types: tuple, params, "
                   "grads, anchors, importances, meta_lrs)");
  PyObject* plain = args[0];
  PyObject* lists[5];
  for (int j = 0; j < 5; ++j) {
    lists[j] = args[1 + j];
    TORCH_CHECK_TYPE(PyList_Check(lists[j]), "plainly_valid_call takes lists");
  }
  const Py_ssize_t n = PyList_GET_SIZE(lists[0]);
  const int n_lists = PyList_GET_SIZE(lists[4]) == 0 ? 4 : 5;
  for (int j = 1; j < n_lists; ++j) {
    if (PyList_GET_SIZE(lists[j]) != n) Py_RETURN_FALSE;
  }
  std::vector<Span> spans;
  spans.reserve(static_cast<size_t>(n) * n_lists);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* pobj = PyList_GET_ITEM(lists[0], i);
    if (!is_plain(pobj, plain)) Py_RETURN_FALSE;
    const at::Tensor& p = THPVariable_Unpack(pobj);
    const at::ScalarType dtype = p.scalar_type();
    if (!is_param_dtype(dtype) || p.layout() != at::kStrided || p.device().is_meta() ||
        !p.is_contiguous()) {
      Py_RETURN_FALSE;
    }
    const at::ScalarType state = compute_dtype(dtype);
    for (int j = 0; j < n_lists; ++j) {
      PyObject* obj = PyList_GET_ITEM(lists[j], i);
      if (j > 0 && !is_plain(obj, plain)) Py_RETURN_FALSE;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (j > 0 && (t.scalar_type() != (j == 1 ? dtype : state) ||
                    t.layout() != at::kStrided || t.device() != p.device() ||
                    t.sizes() != p.sizes() || t.strides() != p.strides())) {
        Py_RETURN_FALSE;
      }
      const int64_t numel = t.numel();
      if (numel == 0) continue;
      const int64_t start = address(t);
      spans.push_back({static_cast<int64_t>(t.device().type()) * 65536 + t.device().index() + 1,
                       start, start + numel * static_cast<int64_t>(t.element_size())});
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    // sorted by start within a device, and each tensor dense: a start before the previous
    // end is an overlap
    if (spans[k].device == spans[k - 1].device && spans[k].start < spans[k - 1].end) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// emcl_kernels._C.layout_key(lists) and layouts_are(lists, key): what the Triton launcher keeps
// of a call whose checks passed ([note: checked plans] in emcl_kernels/backends/triton.py), and
// the comparison of a later call with it, each in one C++ pass. `lists` is a list of lists of
// tensors; the key holds, per tensor in order, its address, dtype, device, ndim, sizes and
// strides (everything check_step_call's per-tensor checks look at), and per list its length.
// layouts_are is False on any difference (or anything that is not a tensor), never raising
// for one: the caller then runs the checks, which name what is wrong.
int64_t device_code(const at::Device& d) {
  return static_cast<int64_t>(d.type()) * 65536 + d.index() + 1;
}

template <typename Visit>
bool visit_lists(PyObject* lists, Visit&& visit) {
  if (!PyList_Check(lists)) return false;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(lists); ++j) {
    PyObject* list = PyList_GET_ITEM(lists, j);
    if (!PyList_Check(list)) return false;
    const Py_ssize_t n = PyList_GET_SIZE(list);
    if (!visit(nullptr, static_cast<int64_t>(n))) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyList_GET_ITEM(list, i);
      if (!THPVariable_Check(item)) return false;
      const at::Tensor& t = THPVariable_Unpack(item);
      if (!t.defined() || t.layout() != at::kStrided) return false;
      if (!visit(&t, 0)) return false;
    }
  }
  return true;
}

PyObject* py_layout_key(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 1 && PyList_Check(args[0]),
                   "emcl_kernels._C.layout_key takes one list of lists of tensors");
  std::vector<int64_t> key;
  const bool ok = visit_lists(args[0], [&](const at::Tensor* t, int64_t count) {
    if (t == nullptr) {
      key.push_back(count);
      return true;
    }
    key.insert(key.end(), {address(*t), static_cast<int64_t>(t->scalar_type()),
                           device_code(t->device()), t->dim()});
    key.insert(key.end(), t->sizes().begin(), t->sizes().end());
    key.insert(key.end(), t->strides().begin(), t->strides().end());
    return true;
  });
  TORCH_CHECK_TYPE(ok, "emcl_kernels._C.layout_key takes a list of lists of defined dense "
                   "tensors");
  at::Tensor out = at::empty({static_cast<int64_t>(key.size())}, at::kLong);
  std::copy(key.begin(), key.end(), out.mutable_data_ptr<int64_t>());
  return THPVariable_Wrap(out);
  END_HANDLE_TH_ERRORS
}

PyObject* py_layouts_are(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 2, "emcl_kernels._C.layouts_are takes (lists, key)");
  int64_t klen = 0;
  const int64_t* k = key_entries(args[1], &klen);
  int64_t pos = 0;
  const bool same = visit_lists(args[0], [&](const at::Tensor* t, int64_t count) {
    if (t == nullptr) return pos < klen && k[pos++] == count;
    const int64_t ndim = t->dim();
    if (pos + 4 + 2 * ndim > klen || k[pos] != address(*t) ||
        k[pos + 1] != static_cast<int64_t>(t->scalar_type()) ||
        k[pos + 2] != device_code(t->device()) || k[pos + 3] != ndim) {
      return false;
    }
    const auto sizes = t->sizes();
    const auto strides = t->strides();
    for (int64_t d = 0; d < ndim; ++d) {
      if (k[pos + 4 + d] != sizes[d] || k[pos + 4 + ndim + d] != strides[d]) return false;
    }
    pos += 4 + 2 * ndim;
    return true;
  });
  if (same && pos == klen) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef kMethods[] = {
    {"step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_step)),
     METH_FASTCALL,
     "step(params, grads, anchors, importances, meta_lrs, steps, hyper, counters, op, prox, "
     "importance, lr_mode, meta_every, check, finalize, grad_scale, found_inf[, runs]): "
     "torch.ops.emcl.step_ with its arguments by position, without torch.ops' argument "
     "parsing."},
    {"check_step_call",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_check_step_call)),
     METH_FASTCALL,
     "check_step_call(<the 18 arguments of step, runs optional>): the argument checks of "
     "torch.ops.emcl.step_ alone (raises what it would raise), for the Triton launcher."},
    {"plan_grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_plan_grads)),
     METH_FASTCALL,
     "plan_grads(sources, key, like): (grads, grad_ptrs) of a plan's parameters when they and "
     "their gradients are exactly what the plan's key records, else None "
     "([note: plan keys] in emcl_kernels/plan.py)."},
    {"identical", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_identical)),
     METH_FASTCALL, "identical(a, b): lists a and b hold the same objects in the same order."},
    {"items_are", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_items_are)),
     METH_FASTCALL,
     "items_are(dicts, key, values): dicts[i].get(key) is values[i] for every i."},
    {"layout_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_layout_key)),
     METH_FASTCALL,
     "layout_key(lists): per tensor of a list of lists, its address, dtype, device, sizes and "
     "strides (and each list's length), as one int64 tensor."},
    {"layouts_are", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_layouts_are)),
     METH_FASTCALL,
     "layouts_are(lists, key): the tensors of lists are exactly what layout_key recorded."},
    {"plainly_valid_call",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_plainly_valid_call)),
     METH_FASTCALL,
     "plainly_valid_call(plain_types, params, grads, anchors, importances, meta_lrs): True "
     "when a functional call's lists pass every check of check_lists in the common case; "
     "False: run the Python checks."},
    {"check_finite", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_check_finite)),
     METH_FASTCALL,
     "check_finite(grads, counters[, runs]): torch.ops.emcl.check_finite_, without "
     "torch.ops' "
     "argument parsing."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace emcl

// `import emcl_kernels._C` loads the library above (registering torch.ops.emcl.*); the module
// holds the direct entry points ([note: direct entry points]).
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                                          emcl::kMethods};
  return PyModule_Create(&module_def);
}
