// The fused glance of an MLP (emcl_kernels/glance.py): the op's schema and the argument checks
// that its CPU (emcl_glance_cpu.cpp) and CUDA (emcl_glance_cuda.cu) kernels run before anything
// is written. The arithmetic's order is [note: glance order] in emcl_kernels/glance.py.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace emcl {
namespace glance {

// params, anchors, importances: per layer a weight [R, out, in] and a bias [R, out], fp32,
// contiguous; x [R, n, in0] fp32; y [R, n] int64; mask [R, n, classes] bool or None;
// hyper [R, 3] fp64 (inner_lr, reg, gamma); losses [R, n] fp32 and skipped [R] int64 (outputs).
constexpr const char* kSchema =
    "mlp_glance_(Tensor(a!)[] params, Tensor[] anchors, Tensor[] importances, Tensor x, "
    "Tensor y, Tensor? mask, Tensor hyper, bool prox, bool check_finite, Tensor(b!) losses, "
    "Tensor(c!) skipped) -> ()";

constexpr int kLanes = 16;  // partial sums of a forward dot product

// The checked shape of a call.
struct Shape {
  int64_t runs = 0;
  int64_t samples = 0;
  int64_t layers = 0;
  std::vector<int64_t> widths;  // widths[0] = inputs, widths[l + 1] = outputs of layer l
};

inline void check_dense(const char* role, size_t i, const at::Tensor& t, at::ScalarType dtype,
                        const at::Device& device) {
  TORCH_CHECK(t.defined(), "mlp_glance_: ", role, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "mlp_glance_: ", role, "[", i, "] must be strided");
  TORCH_CHECK(t.scalar_type() == dtype, "mlp_glance_: ", role, "[", i, "] must be ", dtype,
              ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, "mlp_glance_: ", role, "[", i, "] is on ", t.device(),
              ", params[0] on ", device);
  TORCH_CHECK(t.is_contiguous(), "mlp_glance_: ", role, "[", i, "] must be contiguous");
}

inline Shape check_call(const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& anchors,
                        const std::vector<at::Tensor>& importances, const at::Tensor& x,
                        const at::Tensor& y, const c10::optional<at::Tensor>& mask,
                        const at::Tensor& hyper, const at::Tensor& losses,
                        const at::Tensor& skipped) {
  Shape s;
  TORCH_CHECK(!params.empty() && params.size() % 2 == 0,
              "mlp_glance_: params must hold a weight and a bias per layer, got ",
              params.size(), " tensors");
  TORCH_CHECK(anchors.size() == params.size() && importances.size() == params.size(),
              "mlp_glance_: ", params.size(), " params but ", anchors.size(), " anchors and ",
              importances.size(), " importances");
  TORCH_CHECK(params[0].defined(), "mlp_glance_: params[0] is undefined");
  const at::Device device = params[0].device();
  s.layers = static_cast<int64_t>(params.size() / 2);
  TORCH_CHECK(params[0].dim() == 3, "mlp_glance_: params[0] must be a weight [R, out, in]");
  s.runs = params[0].size(0);
  for (int64_t l = 0; l < s.layers; ++l) {
    const at::Tensor& w = params[2 * l];
    const at::Tensor& b = params[2 * l + 1];
    check_dense("params", 2 * l, w, at::kFloat, device);
    check_dense("params", 2 * l + 1, b, at::kFloat, device);
    TORCH_CHECK(w.dim() == 3 && b.dim() == 2 && w.size(0) == s.runs && b.size(0) == s.runs &&
                    b.size(1) == w.size(1) && w.size(1) > 0 && w.size(2) > 0,
                "mlp_glance_: layer ", l, " must be a weight [R, out, in] and a bias [R, out] "
                "with R = ", s.runs, ", got ", w.sizes(), " and ", b.sizes());
    if (l == 0) {
      s.widths.push_back(w.size(2));
    } else {
      TORCH_CHECK(w.size(2) == s.widths.back(), "mlp_glance_: layer ", l, " takes ",
                  w.size(2), " inputs, layer ", l - 1, " gives ", s.widths.back());
    }
    s.widths.push_back(w.size(1));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    check_dense("anchors", i, anchors[i], at::kFloat, device);
    check_dense("importances", i, importances[i], at::kFloat, device);
    TORCH_CHECK(anchors[i].sizes() == params[i].sizes() &&
                    importances[i].sizes() == params[i].sizes(),
                "mlp_glance_: anchors[", i, "] and importances[", i, "] must have params[", i,
                "]'s shape ", params[i].sizes());
  }
  // nothing the glance writes may share memory with anything it reads
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto* list : {&params, &anchors, &importances}) {
    for (const auto& t : *list) {
      const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
      spans.emplace_back(start, start + static_cast<uintptr_t>(t.numel()) * sizeof(float));
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    TORCH_CHECK(spans[i].first >= spans[i - 1].second,
                "mlp_glance_: two of the params/anchors/importances share memory");
  }
  check_dense("x", 0, x, at::kFloat, device);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == s.runs && x.size(2) == s.widths[0],
              "mlp_glance_: x must be [R=", s.runs, ", n, ", s.widths[0], "], got ", x.sizes());
  s.samples = x.size(1);
  check_dense("y", 0, y, at::kLong, device);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == s.runs && y.size(1) == s.samples,
              "mlp_glance_: y must be [R, n] = [", s.runs, ", ", s.samples, "], got ",
              y.sizes());
  const int64_t classes = s.widths.back();
  if (mask.has_value() && mask->defined()) {
    check_dense("mask", 0, *mask, at::kBool, device);
    TORCH_CHECK(mask->dim() == 3 && mask->size(0) == s.runs && mask->size(1) == s.samples &&
                    mask->size(2) == classes,
                "mlp_glance_: mask must be [R, n, classes] = [", s.runs, ", ", s.samples, ", ",
                classes, "], got ", mask->sizes());
  }
  TORCH_CHECK(hyper.defined() && hyper.scalar_type() == at::kDouble && hyper.dim() == 2 &&
                  hyper.size(0) == s.runs && hyper.size(1) == 3 && hyper.is_contiguous() &&
                  hyper.device() == device,
              "mlp_glance_: hyper must be a contiguous fp64 [R, 3] tensor (inner_lr, reg, "
              "gamma) on ", device);
  check_dense("losses", 0, losses, at::kFloat, device);
  TORCH_CHECK(losses.dim() == 2 && losses.size(0) == s.runs && losses.size(1) == s.samples,
              "mlp_glance_: losses must be [R, n], got ", losses.sizes());
  check_dense("skipped", 0, skipped, at::kLong, device);
  TORCH_CHECK(skipped.dim() == 1 && skipped.size(0) == s.runs,
              "mlp_glance_: skipped must be [R], got ", skipped.sizes());
  return s;
}

}  // namespace glance
}  // namespace emcl
