"""The layout of python/emcl_continual stays as DEVELOPERS.md draws it: sub-packages that import
one way (tools/import_graph.py's ``LAYERS``), no import cycle, the commands at the top level under
the names the docs and the results files give them."""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
import_graph = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = import_graph
_spec.loader.exec_module(import_graph)

GRAPH = import_graph.build_graph()
GROUPS = import_graph.layout_groups(GRAPH)

# The top level holds the package, its commands and the Avalanche integration, nothing else.
COMMANDS = ("selection", "sweep_diff", "tables", "compare", "ablation")
TOP_LEVEL = {"", "__main__", "cli", "avalanche", *COMMANDS}


def test_no_import_cycle_between_modules():
    assert import_graph.strongly_connected(GRAPH) == []


def test_every_import_goes_down_the_layers():
    """A group imports itself and the groups before it in LAYERS, at module level or in a function."""
    assert set(GROUPS.values()) <= set(import_graph.LAYERS), set(GROUPS.values()) - set(import_graph.LAYERS)
    bad = import_graph.violations(GRAPH, GROUPS)
    assert not bad, "imports against the layers " + " <- ".join(import_graph.LAYERS) + ":\n" + "\n".join(bad)


def test_the_leaves_stay_leaves():
    for leaf in ("core.errors", "core.schema", "core.fileio", "core.presets"):
        assert set(GRAPH[leaf]) <= {"core.errors"}, (leaf, GRAPH[leaf])


def test_the_top_level_is_the_commands():
    """A new module belongs in a sub-package; a command module only hands its arguments to one."""
    top = {m for m, g in GROUPS.items() if g == import_graph.TOP}
    assert top == TOP_LEVEL, f"top-level modules {sorted(top - TOP_LEVEL)} belong in a sub-package"
    for name in COMMANDS:
        (target,) = GRAPH[name]  # one import: the sub-package module whose main() it runs
        assert GROUPS[target] in ("sweep", "reports"), (name, target)


@pytest.mark.parametrize("name", ("",) + COMMANDS)
def test_every_command_runs_under_its_name(name, monkeypatch, capsys):
    """``python -m emcl_continual[.NAME] --help`` (the names the docs and results files carry)."""
    module = "emcl_continual" + (f".{name}" if name else "")
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exc.value.code == 0
    assert f"python -m {module}" in capsys.readouterr().out


def test_setup_installs_every_sub_package():
    text = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    subs = sorted({m.split(".")[0] for m in GRAPH if "." in m})
    assert [s for s in subs if f'"{s}"' not in text] == []


def test_the_tool_finds_a_cycle_and_an_import_up_the_layers(tmp_path):
    """The guard is not vacuous: a package with an upward import and a cycle is caught."""
    pkg = tmp_path / "emcl_continual"
    for folder in ("core", "data"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "errors.py").write_text("def f():\n    from ..data import streams\n")
    (pkg / "data" / "streams.py").write_text(textwrap.dedent("""\
        from ..core import errors
        from . import sources
    """))
    (pkg / "data" / "sources.py").write_text("from .streams import x\n")
    graph = import_graph.build_graph(str(pkg))
    assert graph["core.errors"] == {"data.streams": "function"}
    assert graph["data.streams"] == {"core.errors": "top", "data.sources": "top"}
    assert import_graph.strongly_connected(graph) == [["core.errors", "data.sources", "data.streams"]]
    bad = import_graph.violations(graph, import_graph.layout_groups(graph))
    assert bad == ["core.errors -> data.streams (core imports the later data, function)"]
