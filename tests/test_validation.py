"""Every bad input of SPEC section 4 raises a clear error and leaves every tensor unchanged."""
import pytest
import torch

from emcl_kernels import functional as F
from emcl_kernels.backends import BackendUnavailableError, available_backends
from emcl_testing import make_case

INF = float("inf")
NAN = float("nan")
INNER = dict(inner_lr=0.1, reg=1.0, gamma=0.3)
META = dict(meta_lr=0.1, reg=1.0, decay=0.9, lr_scale=0.5, lr_mode="recurrent")


def snapshot(case):
    return [t.clone() for lst in (case.params, case.grads, case.anchors, case.importances,
                                  case.meta_lrs) for t in lst]


def assert_unchanged(case, before):
    after = [t for lst in (case.params, case.grads, case.anchors, case.importances,
                           case.meta_lrs) for t in lst]
    for a, b in zip(after, before):
        assert torch.equal(a, b), "a tensor was written although the call was refused"


def call(op, case, params=None, grads=None, anchors=None, importances=None, meta_lrs="case",
         **over):
    lists = [case.params if params is None else params,
             case.grads if grads is None else grads,
             case.anchors if anchors is None else anchors,
             case.importances if importances is None else importances]
    if op == "inner":
        return F.inner_step_(*lists, **{**INNER, **over})
    lrs = case.meta_lrs if meta_lrs == "case" else meta_lrs
    if op == "meta":
        return F.meta_step_(*lists, lrs, **{**META, **over})
    return F.inner_meta_step_(*lists, lrs, **{**INNER, **META, **over})


def refused(op, exc, match, **kw):
    case = make_case([5, 7, 12], torch.float32, seed=11)
    before = snapshot(case)
    build = kw.pop("build", None)
    if build is not None:
        kw.update(build(case))
    with pytest.raises(exc, match=match):
        call(op, case, **kw)
    assert_unchanged(case, before)


OPS = ("inner", "meta", "inner_meta")


@pytest.fixture(autouse=True, params=["native", "python"])
def check_path(request, monkeypatch):
    """Every case with the C++ pass that accepts a plainly valid call
    (``_C.plainly_valid_call``) and with the Python checks alone, as without the extension."""
    if request.param == "python":
        monkeypatch.setattr(F, "_plainly_valid_call", None)
    elif F._plainly_valid_call is None:
        pytest.skip("the extension is not built: the Python checks are the only ones")
    return request.param


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,value,exc,match", [
    ("inner_lr", NAN, ValueError, "inner_lr must be finite"),
    ("inner_lr", -0.1, ValueError, "inner_lr must be in"),
    ("reg", INF, ValueError, "reg must be finite"),
    ("reg", -1.0, ValueError, "reg must be in"),
    ("gamma", -0.5, ValueError, "gamma must be in"),
    ("gamma", "0.3", TypeError, "gamma must be a real number"),
])
def test_bad_inner_hyperparameters(op, name, value, exc, match):
    if op == "meta" and name in ("inner_lr", "gamma"):
        pytest.skip("not a meta-step hyper-parameter")
    refused(op, exc, match, **{name: value})


@pytest.mark.parametrize("op", ("meta", "inner_meta"))
@pytest.mark.parametrize("over,exc,match", [
    (dict(meta_lr=-1.0), ValueError, "meta_lr must be in"),
    (dict(meta_lr=NAN), ValueError, "meta_lr must be finite"),
    (dict(decay=1.5), ValueError, "decay must be in"),
    (dict(decay=-0.1), ValueError, "decay must be in"),
    (dict(lr_scale=INF), ValueError, "lr_scale must be finite"),
    (dict(lr_scale=-2.0), ValueError, "lr_scale must be in"),
    (dict(eps=0.0), ValueError, "eps must be in"),
    (dict(eps=NAN), ValueError, "eps must be finite"),
    (dict(lr_min=-1.0), ValueError, "lr_min must be in"),
    (dict(lr_max=NAN), ValueError, "lr_max must be finite"),
    (dict(lr_min=0.5, lr_max=0.1), ValueError, "lr_max .* must be >= lr_min"),
    (dict(lr_mode="cosine"), ValueError, "lr_mode must be one of"),
    (dict(importance="fisher"), ValueError, "importance must be one of"),
    (dict(meta_lrs=None), ValueError, "lr_mode='recurrent' needs meta_lrs"),
])
def test_bad_meta_arguments(op, over, exc, match):
    refused(op, exc, match, **over)


def test_prox_must_be_bool():
    refused("inner", TypeError, "prox must be a bool", prox=1)


@pytest.mark.parametrize("op", OPS)
def test_mismatched_list_lengths(op):
    refused(op, ValueError, "grads has 2 tensors but params has 3",
            build=lambda c: dict(grads=c.grads[:2]))
    refused(op, ValueError, "importances has 4 tensors but params has 3",
            build=lambda c: dict(importances=c.importances + c.importances[:1]))


@pytest.mark.parametrize("op", OPS)
def test_mismatched_shapes(op):
    refused(op, ValueError, r"grads\[1\] has shape \(8,\) but params\[1\] has shape \(7,\)",
            build=lambda c: dict(grads=[c.grads[0], torch.randn(8), c.grads[2]]))
    refused(op, ValueError, r"anchors\[0\] has shape",
            build=lambda c: dict(anchors=[c.anchors[0].reshape(1, 5)] + c.anchors[1:]))


@pytest.mark.parametrize("op", OPS)
def test_wrong_dtypes(op):
    refused(op, TypeError, r"grads\[2\] has dtype torch.float64, expected torch.float32",
            build=lambda c: dict(grads=c.grads[:2] + [c.grads[2].double()]))
    refused(op, TypeError, r"importances\[0\] has dtype torch.bfloat16",
            build=lambda c: dict(importances=[c.importances[0].bfloat16()] + c.importances[1:]))
    refused(op, TypeError, r"params\[0\] has dtype torch.int64",
            build=lambda c: dict(params=[torch.arange(5)] + c.params[1:]))


def test_bf16_param_needs_fp32_state():
    case = make_case([5, 6], torch.bfloat16, seed=2)
    before = snapshot(case)
    with pytest.raises(TypeError, match=r"anchors\[1\] has dtype torch.bfloat16, expected "
                                        r"torch.float32"):
        F.inner_step_(case.params, case.grads, [case.anchors[0], case.anchors[1].bfloat16()],
                      case.importances, **INNER)
    assert_unchanged(case, before)


@pytest.mark.parametrize("op", OPS)
def test_layout_mismatch(op):
    """A transposed (dense) parameter with contiguous gradient and state: their elements do not
    line up in memory, so the call is refused."""
    refused(op, RuntimeError, r"grads\[2\] has strides \(3, 1\) but params\[2\] has \(1, 4\)",
            build=lambda c: dict(params=c.params[:2] + [c.params[2].t()],
                                 grads=c.grads[:2] + [c.grads[2].t().contiguous()],
                                 anchors=c.anchors[:2] + [c.anchors[2].t().contiguous()],
                                 importances=c.importances[:2]
                                 + [c.importances[2].t().contiguous()],
                                 meta_lrs=c.meta_lrs[:2] + [c.meta_lrs[2].t().contiguous()]))


@pytest.mark.parametrize("op", OPS)
def test_views_with_gaps(op):
    refused(op, RuntimeError, r"params\[1\] is a strided view with gaps",
            build=lambda c: dict(params=c.params[:1] + [torch.randn(14)[::2]] + c.params[2:]))


@pytest.mark.parametrize("op", OPS)
def test_any_dense_layout_shared_by_all_tensors(op):
    """Transposed (or channels_last) tensors are fine when every tensor of the parameter has
    its layout: the result equals the contiguous call's, transposed."""
    case = make_case([5, 7, 12], torch.float32, seed=11)
    flat = [[t.clone() for t in lst] for lst in (case.params, case.grads, case.anchors,
                                                 case.importances, case.meta_lrs)]
    call(op, case)
    moved = [lst[:2] + [lst[2].t().contiguous().t()] for lst in flat]
    trans = make_case([5, 7, 12], torch.float32, seed=11)
    trans.params, trans.grads, trans.anchors, trans.importances, trans.meta_lrs = moved
    assert not trans.params[2].is_contiguous()
    call(op, trans)
    for lst_a, lst_b in ((case.params, trans.params), (case.anchors, trans.anchors),
                         (case.importances, trans.importances)):
        for a, b in zip(lst_a, lst_b):
            assert torch.equal(a, b)


@pytest.mark.parametrize("op", OPS)
def test_mixed_devices(op):
    refused(op, RuntimeError, r"grads\[0\] is on meta but params\[0\] is on cpu",
            build=lambda c: dict(grads=[torch.empty(5, device="meta")] + c.grads[1:]))


@pytest.mark.parametrize("op", OPS)
def test_sparse_grad(op):
    refused(op, RuntimeError, "sparse gradients are not supported",
            build=lambda c: dict(grads=[c.grads[0].to_sparse()] + c.grads[1:]))


@pytest.mark.parametrize("op", OPS)
def test_same_parameter_twice(op):
    refused(op, ValueError, r"(params|grads)\[0\] and \1\[2\] are the same memory",
            build=lambda c: dict(params=[c.params[0], c.params[1], c.params[0]],
                                 grads=[c.grads[0], c.grads[1], c.grads[0]],
                                 anchors=[c.anchors[0], c.anchors[1], c.anchors[0].clone()],
                                 importances=[c.importances[0], c.importances[1],
                                              c.importances[0].clone()],
                                 meta_lrs=[c.meta_lrs[0], c.meta_lrs[1],
                                           c.meta_lrs[0].clone()]))


def test_not_a_list():
    case = make_case([5], torch.float32, seed=1)
    with pytest.raises(TypeError, match="params must be a list or tuple of tensors"):
        F.inner_step_(case.params[0], case.grads, case.anchors, case.importances, **INNER)
    with pytest.raises(TypeError, match=r"grads\[0\] must be a tensor"):
        F.inner_step_(case.params, [1.0], case.anchors, case.importances, **INNER)
    with pytest.raises(TypeError, match=r"params\[0\] must be a tensor"):
        F.inner_step_([1.0], case.grads, case.anchors, case.importances, **INNER)
    with pytest.raises(TypeError, match=r"anchors\[0\] must be a tensor"):
        F.inner_step_(case.params, case.grads, ["anchor"], case.importances, **INNER)


def test_unknown_and_unavailable_backends():
    refused("inner", ValueError, "unknown backend 'fastest'", backend="fastest")
    if "cuda" not in available_backends():
        refused("meta", BackendUnavailableError, "backend 'cuda' is not available",
                backend="cuda")
    refused("inner", TypeError, "backend must be a string", backend=None)


def test_bad_flags():
    refused("inner", TypeError, "found_inf must be None or a one-element",
            found_inf=torch.zeros(2))
    refused("meta", TypeError, "grad_scale must be None or a one-element", grad_scale=2.0)


def test_empty_lists_are_a_no_op():
    F.inner_step_([], [], [], [], **INNER)
    F.meta_step_([], [], [], [], [], **META)


def test_remembered_hyperparameters_still_reject_bad_values():
    """check_hyperparameters remembers sets that passed (an optimizer repeats them every step);
    a value that only looks equal (1 == 1.0 == True) or a bad one is still checked and refused."""
    good = dict(inner_lr=0.1, reg=1.0, gamma=0.5, prox=True)
    assert F.check_hyperparameters(**good) == F.check_hyperparameters(**good)
    with pytest.raises(TypeError, match="prox"):
        F.check_hyperparameters(**dict(good, prox=1))
    with pytest.raises(TypeError, match="gamma"):
        F.check_hyperparameters(**dict(good, gamma=True))
    with pytest.raises(ValueError, match="inner_lr"):
        F.check_hyperparameters(**dict(good, inner_lr=float("nan")))
    out = F.check_hyperparameters(**dict(good, reg=2))
    assert out["reg"] == 2.0 and type(out["reg"]) is float
    out["reg"] = -1.0  # the caller's copy: the remembered one is unchanged
    assert F.check_hyperparameters(**dict(good, reg=2))["reg"] == 2.0


@pytest.mark.parametrize("op", OPS)
def test_errors_after_many_good_calls(op):
    """The fast path of the tensor checks (the common case) hands anything unusual to the full
    checks: a call that goes wrong after many good ones still raises before writing."""
    case = make_case([5, 7, 12], torch.float32, seed=3)
    for _ in range(3):
        call(op, case)
    before = snapshot(case)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(4,\) but params\[1\]"):
        call(op, case, grads=[case.grads[0], case.grads[1][:4], case.grads[2]])
    with pytest.raises(RuntimeError, match=r"importances\[2\] has strides"):
        call(op, case, importances=case.importances[:2] + [case.importances[2].t().contiguous().t()])
    with pytest.raises(ValueError, match="are the same memory"):
        call(op, case, params=[case.params[0], case.params[0], case.params[2]],
             grads=[case.grads[0], case.grads[0], case.grads[2]],
             anchors=[case.anchors[0], case.anchors[0], case.anchors[2]],
             importances=[case.importances[0], case.importances[0], case.importances[2]],
             **({} if op == "inner" else {"meta_lrs": [case.meta_lrs[0], case.meta_lrs[0], case.meta_lrs[2]]}))
    assert_unchanged(case, before)


@pytest.mark.parametrize("op", OPS)
def test_size_one_dimensions_may_have_any_stride(op):
    """(1, 12) with strides (12, 1) and (1, 1) are the same memory order: accepted."""
    case = make_case([5, 7, 12], torch.float32, seed=11)
    case.params[2] = case.params[2].reshape(1, 12)
    case.grads[2] = torch.as_strided(case.grads[2].reshape(-1).clone(), (1, 12), (1, 1))
    for lst in (case.anchors, case.importances, case.meta_lrs):
        lst[2] = lst[2].reshape(1, 12)
    call(op, case)


def test_the_native_pass_accepts_only_plainly_valid_calls(check_path):
    """``_C.plainly_valid_call`` says True only for plain contiguous tensors that go together
    and share no memory; every other call goes to the Python checks (which raise, naming the
    tensor, or accept a layout the C++ pass leaves to them)."""
    if check_path != "native":
        pytest.skip("the C++ pass itself")
    ok = F._plainly_valid_call
    plain = F.PLAIN_TENSORS
    case = make_case([5, 7, 12], torch.float32, seed=3)
    lists = [case.params, case.grads, case.anchors, case.importances]
    assert ok(plain, *lists, case.meta_lrs) and ok(plain, *lists, [])
    assert ok(plain, [], [], [], [], [])

    def with_(k, i, t, meta=case.meta_lrs):
        changed = [list(lst) for lst in lists]
        changed[k][i] = t
        return ok(plain, *changed, meta)

    p0 = case.params[0]
    assert not with_(1, 0, p0)                                   # a gradient is the param
    assert not with_(2, 2, case.anchors[1])                      # one anchor twice
    storage = torch.randn(40)
    changed = [list(lst) for lst in lists]
    changed[2][0], changed[3][0] = storage[:5], storage[3:8]     # overlapping views
    assert not ok(plain, *changed, case.meta_lrs)
    changed[3][0] = storage[5:10]                                # adjacent, apart
    assert ok(plain, *changed, case.meta_lrs)
    assert not with_(1, 1, case.grads[1].double())               # dtype
    assert not with_(2, 1, case.anchors[1].to(torch.bfloat16))
    assert not with_(1, 0, torch.randn(6))                       # shape
    assert not with_(0, 2, torch.randn(24)[::2])                 # gaps: Python decides
    assert not with_(0, 0, torch.empty(5, device="meta"))
    assert not with_(1, 0, torch.randn(5).to_sparse())

    class Sub(torch.Tensor):
        pass
    assert not with_(1, 0, case.grads[0].as_subclass(Sub))
    assert not with_(0, 0, [1.0]) and not with_(1, 0, 2.0)
    assert not ok(plain, *lists, case.meta_lrs[:2])              # meta_lrs too short
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert not ok(plain, [cl], [torch.randn_like(cl)], [torch.randn_like(cl)],
                  [torch.rand_like(cl)], [])                     # channels_last: Python's
    bf = torch.randn(5).to(torch.bfloat16)
    assert ok(plain, [bf], [torch.randn(5).to(torch.bfloat16)], [torch.randn(5)],
              [torch.rand(5)], [])                               # fp32 state of a bf16 param
    with pytest.raises(TypeError, match="takes lists"):
        ok(plain, tuple(case.params), case.grads, case.anchors, case.importances, [])
