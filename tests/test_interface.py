"""The op interface is written once (emcl_kernels/interface.py): the C++ header is generated from
it and must be current, and the tables agree with each other."""
import os

from emcl_kernels import interface

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_header_is_generated_from_the_table():
    with open(os.path.join(ROOT, "csrc", "emcl_interface.h")) as fh:
        committed = fh.read()
    assert committed == interface.render_header(), (
        "csrc/emcl_interface.h is stale: run "
        "`python3 emcl_kernels/interface.py > csrc/emcl_interface.h`")


def test_tables_are_consistent():
    assert list(interface.HYPER) == list(interface.HYPER_FIELDS)
    assert sorted(interface.HYPER.values()) == list(range(len(interface.HYPER_FIELDS)))
    assert interface.COUNTER["found"] == 0 and interface.COUNTER["done"] == 3
    assert interface.LR_SCALE_FROM_REG < 0  # outside lr_scale's domain (>= 0)
    for name in ("step_", "check_finite_"):
        assert name in (interface.STEP_SCHEMA + interface.CHECK_FINITE_SCHEMA)
    assert str(interface.INTERFACE_VERSION) in interface.layout_string()


def _backend_modules():
    import importlib

    from emcl_kernels.backends import BACKENDS
    mods = {}
    for name, spec in BACKENDS.items():
        try:
            mod = importlib.import_module(spec.module)
        except Exception:  # an optional dependency or the extension is missing here
            continue
        if name in ("cpu", "cuda") and getattr(mod, "LOAD_ERROR", None):
            continue
        mods[spec.module] = mod
    return mods


def test_every_backend_implements_the_step_interface_as_written():
    """The argument list is written once (interface.STEP_ARGS); every backend's ``step`` and
    ``check_finite`` take exactly those arguments, positional and keyword-only as listed."""
    import inspect

    want_step = [name for name, _ in interface.STEP_ARGS]
    want_check = [name for name, _ in interface.CHECK_FINITE_ARGS]
    mods = _backend_modules()
    assert "emcl_kernels.backends.reference" in mods and "emcl_kernels.backends.foreach" in mods
    for module, mod in mods.items():
        for fn_name, want, positional in (("step", want_step, interface.STEP_POSITIONAL),
                                          ("check_finite", want_check, len(want_check))):
            fn = getattr(mod, fn_name)
            params = list(inspect.signature(fn).parameters.values())
            assert [p.name for p in params] == want, f"{module}.{fn_name}"
            kinds = [p.kind == inspect.Parameter.KEYWORD_ONLY for p in params]
            assert kinds == [i >= positional for i in range(len(want))], f"{module}.{fn_name}"
