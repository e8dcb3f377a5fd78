r"""The gradient projections of GEM and A-GEM.

GEM (Lopez-Paz & Ranzato 2017, eq. 10-13) projects the current gradient :math:`g` onto the
cone :math:`\{\tilde g : G \tilde g \ge 0\}` spanned by the past tasks' memory gradients
(rows of :math:`G \in \mathbb{R}^{t \times p}`):

.. math::
    \min_{\tilde g} \tfrac12 \|g - \tilde g\|^2 \quad \text{s.t.}\quad G \tilde g \ge 0 .

It is solved through its small dual (t variables),

.. math::
    \min_{v} \tfrac12 v^\top (G G^\top + \epsilon I) v + (G g)^\top v \quad \text{s.t.}\quad v \ge m,
    \qquad \tilde g = G^\top v + g,

where the margin :math:`m` (the GEM code's ``memory_strength``) biases the solution towards
gradients that improve the past tasks, and :math:`\epsilon` (1e-3 in the GEM code) keeps the
matrix positive definite. With :math:`u = v - m \ge 0` and the Cholesky factor
:math:`P = G G^\top + \epsilon I = L L^\top` the dual is the non-negative least-squares problem
:math:`\min_{u \ge 0} \tfrac12\|L^\top u + L^{-1} b\|^2` with :math:`b = P m + G g`, which
``scipy.optimize.nnls`` (Lawson-Hanson active set) solves exactly, in finitely many steps.
The GEM code calls ``quadprog`` for the same dual; quadprog is not installed here.

A-GEM (Chaudhry et al. 2019, eq. 11) has the closed form
:math:`\tilde g = g - \frac{g^\top g_{ref}}{g_{ref}^\top g_{ref}} g_{ref}` when
:math:`g^\top g_{ref} < 0`, else :math:`\tilde g = g`.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.optimize
import torch
from torch import Tensor

__all__ = ["solve_gem_dual", "gem_project", "agem_project"]


def solve_gem_dual(G: np.ndarray, g: np.ndarray, margin: float = 0.0, eps: float = 1e-3) -> np.ndarray:
    """Exact solution ``v`` of GEM's dual QP (float64 arrays; ``G`` is t x p, ``g`` is p)."""
    G = np.asarray(G, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64).reshape(-1)
    if G.ndim != 2 or G.shape[1] != g.shape[0]:
        raise ValueError(f"GEM dual: G must be (t, {g.shape[0]}), got {G.shape}")
    if margin < 0 or eps < 0:
        raise ValueError(f"GEM dual: margin and eps must be >= 0, got {margin}, {eps}")
    t = G.shape[0]
    P = G @ G.T
    P = 0.5 * (P + P.T) + eps * np.eye(t)
    b = P @ np.full(t, float(margin)) + G @ g
    try:
        L = scipy.linalg.cholesky(P, lower=True)
    except np.linalg.LinAlgError as exc:  # only reachable with eps == 0 and rank-deficient G
        raise ValueError("GEM dual: G G^T is singular; use eps > 0") from exc
    rhs = -scipy.linalg.solve_triangular(L, b, lower=True)
    u, _ = scipy.optimize.nnls(L.T, rhs, maxiter=50 * max(t, 1))
    return u + margin


def gem_project(g: Tensor, G: Tensor, margin: float = 0.0, eps: float = 1e-3) -> Tensor:
    """GEM's projected gradient ``G^T v + g`` (returned in ``g``'s dtype and device)."""
    v = solve_gem_dual(G.detach().double().cpu().numpy(), g.detach().double().cpu().numpy(), margin, eps)
    v_t = torch.from_numpy(v).to(device=g.device, dtype=torch.float64)
    out = G.detach().double().T @ v_t + g.detach().double()
    return out.to(g.dtype)


def agem_project(g: Tensor, g_ref: Tensor) -> Tensor:
    """A-GEM's projection: remove the component of ``g`` against ``g_ref`` when they conflict."""
    if g.shape != g_ref.shape:
        raise ValueError(f"A-GEM: gradient shapes differ: {tuple(g.shape)} vs {tuple(g_ref.shape)}")
    dot = torch.dot(g, g_ref)
    if dot >= 0:
        return g.clone()
    denom = torch.dot(g_ref, g_ref)
    if denom <= 0:
        return g.clone()
    return g - (dot / denom) * g_ref
