// The update kernels of the "cuda" backend for fp32 parameters ([note: one file per dtype] in
// emcl_cuda_step.cuh).
#define EMCL_CUDA_STEP_DEFINE
#include "emcl_cuda_step.cuh"

namespace emcl {
namespace cuda {

template void launch_step_modes<float>(const Lists&, const StepArgs&, bool, Importance, LrMode,
                                       int, cudaStream_t);

}  // namespace cuda
}  // namespace emcl
