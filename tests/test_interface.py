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
