"""emcl-kernels: EMCL (Zou & Lin) as a fused multi-tensor PyTorch optimizer.

    from emcl_kernels import FusedEMCLOptimizer, available_backends
    opt = FusedEMCLOptimizer(model.parameters(), lr=0.075, meta_lr=0.1, reg=50.0, gamma=0.1)

``emcl_kernels.functional`` holds the same updates as functions over tensor lists,
``emcl_kernels.reference`` the readable per-tensor oracle they are all tested against.
"""
from emcl_kernels import functional, reference
from emcl_kernels.backends import BackendUnavailableError, available_backends, backend_status
from emcl_kernels.optimizer import FusedEMCLOptimizer, NonFiniteGradientWarning
from emcl_kernels.zeros import ZeroParameterWarning, zero_aware_groups

__version__ = "0.1.0"

__all__ = ["FusedEMCLOptimizer", "functional", "reference", "available_backends",
           "backend_status", "BackendUnavailableError", "NonFiniteGradientWarning",
           "ZeroParameterWarning", "zero_aware_groups",
           "__version__"]
