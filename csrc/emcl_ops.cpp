// The emcl:: torch operators: schemas, argument checks, and the Python module stub.
//
// The CPU kernels register themselves in emcl_cpu.cpp, the CUDA kernels in emcl_cuda.cu; the
// fake (meta) implementations that let torch.compile trace a step live in Python
// (emcl_kernels/backends/extension.py, torch.library.register_fake).
#include <Python.h>

#include <torch/library.h>

#include "emcl_ops.h"

namespace emcl {

std::atomic<int64_t> g_launch_count{0};

StepArgs make_args(Op op, bool prox, c10::string_view importance, c10::string_view lr_mode,
                   double inner_lr, double meta_lr, double reg, double gamma, double decay,
                   double lr_scale, double lr_min, double lr_max, double eps) {
  StepArgs a{};
  a.op = op;
  a.prox = prox;
  if (importance == "taylor") {
    a.importance = Importance::kTaylor;
  } else if (importance == "si") {
    a.importance = Importance::kSI;
  } else {
    TORCH_CHECK_VALUE(false, "importance must be 'taylor' or 'si', got '", importance, "'");
  }
  if (lr_mode == "recurrent") {
    a.lr_mode = LrMode::kRecurrent;
  } else if (lr_mode == "inverse") {
    a.lr_mode = LrMode::kInverse;
  } else if (lr_mode == "constant") {
    a.lr_mode = LrMode::kConstant;
  } else {
    TORCH_CHECK_VALUE(false, "lr_mode must be 'recurrent', 'inverse' or 'constant', got '",
                      lr_mode, "'");
  }
  a.inner_lr = inner_lr;
  a.meta_lr = meta_lr;
  a.reg = reg;
  a.gamma = gamma;
  a.decay = decay;
  a.lr_scale = lr_scale;
  a.lr_min = lr_min;
  a.lr_max = lr_max;
  a.eps = eps;
  return a;
}

namespace {

bool is_param_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

void check_flag(const char* name, const OptTensor& t, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->numel() == 1,
                   name, " must be a one-element float32 tensor, got ", t->scalar_type(),
                   " with ", t->numel(), " elements");
  TORCH_CHECK(t->device() == device, name, " is on ", t->device(),
              " but the tensors are on ", device);
}

}  // namespace

void check_call(const Lists& l, const StepArgs& args, const OptTensor& grad_scale,
                const OptTensor& found_inf) {
  const size_t n = l.params.size();
  const bool need_lrs = has_meta(args.op) && args.lr_mode == LrMode::kRecurrent;
  TORCH_CHECK_VALUE(l.grads.size() == n && l.anchors.size() == n && l.importances.size() == n,
                    "params, grads, anchors and importances must have one tensor each; got ", n,
                    ", ", l.grads.size(), ", ", l.anchors.size(), ", ", l.importances.size());
  TORCH_CHECK_VALUE(l.meta_lrs.size() == (need_lrs ? n : 0),
                    need_lrs ? "lr_mode='recurrent' needs one meta_lrs tensor per param"
                             : "meta_lrs must be empty unless lr_mode='recurrent'",
                    "; got ", l.meta_lrs.size(), " for ", n, " params");
  if (n == 0) return;
  const at::Device device = l.params[0].device();
  const at::ScalarType dtype = l.params[0].scalar_type();
  TORCH_CHECK_TYPE(is_param_dtype(dtype), "params must be float32, float64, bfloat16 or "
                   "float16, got ", dtype);
  const at::ScalarType state = dtype == at::kDouble ? at::kDouble : at::kFloat;
  auto check = [&](const char* role, size_t i, const at::Tensor& t, at::ScalarType want,
                   const at::Tensor& p) {
    TORCH_CHECK(t.defined(), role, "[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, role, "[", i, "] must be a dense tensor");
    TORCH_CHECK(t.device() == device, role, "[", i, "] is on ", t.device(),
                " but params[0] is on ", device, "; a call takes tensors of one device");
    TORCH_CHECK_TYPE(t.scalar_type() == want, role, "[", i, "] has dtype ", t.scalar_type(),
                     ", expected ", want);
    TORCH_CHECK_VALUE(t.numel() == p.numel(), role, "[", i, "] has ", t.numel(),
                      " elements but params[", i, "] has ", p.numel());
    TORCH_CHECK(t.is_contiguous(), role, "[", i, "] is not contiguous");
  };
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = l.params[i];
    check("params", i, p, dtype, p);
    check("grads", i, l.grads[i], dtype, p);
    check("anchors", i, l.anchors[i], state, p);
    check("importances", i, l.importances[i], state, p);
    if (need_lrs) check("meta_lrs", i, l.meta_lrs[i], state, p);
  }
  check_flag("grad_scale", grad_scale, device);
  check_flag("found_inf", found_inf, device);
}

namespace {
int64_t launch_count() { return g_launch_count.load(); }
}  // namespace

}  // namespace emcl

// [note: schemas] The steps update their tensor lists in place and return nothing, like torch's
// _fused_adam_. Every list that a step writes carries its own alias set so functionalization
// (torch.compile) knows which inputs are mutated: the inner step writes params only; the meta
// steps write params, anchors, importances and meta_lrs (empty unless lr_mode='recurrent').
TORCH_LIBRARY(emcl, m) {
  m.def(
      "inner_step_(Tensor(a!)[] params, Tensor[] grads, Tensor[] anchors, "
      "Tensor[] importances, *, float inner_lr, float reg, float gamma, bool prox, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  m.def(
      "meta_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] anchors, "
      "Tensor(c!)[] importances, Tensor(d!)[] meta_lrs, *, float meta_lr, float reg, "
      "float decay, float lr_scale, str lr_mode, float lr_min, float lr_max, float eps, "
      "str importance, Tensor? grad_scale=None, "
      "Tensor? found_inf=None) -> ()");
  m.def(
      "inner_meta_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] anchors, "
      "Tensor(c!)[] importances, Tensor(d!)[] meta_lrs, *, float inner_lr, float meta_lr, "
      "float reg, float gamma, float decay, float lr_scale, str lr_mode, float lr_min, "
      "float lr_max, float eps, str importance, bool prox, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // CUDA kernel launches of this library so far (tests check one launch per group and step).
  m.def("launch_count() -> int", &emcl::launch_count);
}

// `import emcl_kernels._C` loads the library above; the module itself is empty.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
