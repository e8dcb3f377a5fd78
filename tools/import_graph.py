"""The import graph of ``python/emcl_continual``: which module imports which, its cycles, and the
imports between groups of modules (the sub-packages, or a grouping proposed on the command line).

    python tools/import_graph.py                     # the layout as it is: groups = sub-packages
    python tools/import_graph.py --group data=data,streams,models --group core=errors,schema
    python tools/import_graph.py --json              # the same, as one JSON object

Only the standard library (``ast``): nothing of the package is imported. An edge is one module
importing another module of the package; it is ``top`` when the import runs when the module is
imported (module level, including inside ``if``/``try`` there) and ``function`` when it runs only
when a function or method is called. ``from .pkg import name`` is an edge to ``pkg.name`` where
that is a module, else to ``pkg``. A module importing the ``__init__`` of a package it lives in is
left out of the graph (Python imports that ``__init__`` first anyway: it is no cycle of ours).

A *group* is a set of modules. By default it is the module's sub-package (``methods.emcl`` is in
``methods``) and every top-level module is in ``commands``. :data:`LAYERS` is the chosen order:
a group may import its own modules and those of the groups before it, never one after it;
:func:`violations` lists the imports that break that rule (``tests/test_cl_layout.py``).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "python", "emcl_continual")

# The groups in import order: each may import itself and the groups before it.
LAYERS = ("core", "data", "methods", "training", "arrays", "output", "sweep", "reports", "commands")
TOP = "commands"


def modules(package: str = PACKAGE) -> dict:
    """``{dotted name relative to the package: path}``; a package's ``__init__`` is named by the package
    (``methods``), the package's own ``__init__`` is ``""``."""
    out = {}
    for folder, dirs, names in os.walk(package):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for n in sorted(names):
            if not n.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, n), package)[:-3].replace(os.sep, ".")
            if rel == "__init__":
                rel = ""
            elif rel.endswith(".__init__"):
                rel = rel[: -len(".__init__")]
            out[rel] = os.path.join(folder, n)
    return out


def _walk(node: ast.AST, in_function: bool = False):
    """Every import node below ``node``, with whether it runs only inside a function or method."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def imports(path: str, module: str, names: set, package_name: str = "emcl_continual") -> dict:
    """``{target module: "top" | "function"}`` for the module at ``path`` (``top`` wins when both)."""
    is_init = os.path.basename(path) == "__init__.py"
    here = module if is_init else module.rpartition(".")[0]
    out: dict = {}

    def add(target: str, fn: bool) -> None:
        if target == module or target not in names:
            return
        if module == target or (target == "" and module) or module.startswith(target + "."):
            return  # the __init__ of a package this module lives in
        out[target] = "top" if (not fn or out.get(target) == "top") else "function"

    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    for node, fn in _walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".") if here else []
                if node.level - 1 > len(base):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the package")
                base = base[: len(base) - (node.level - 1)]
                target = _join(*base, node.module or "")
            elif node.module == package_name or (node.module or "").startswith(package_name + "."):
                target = node.module[len(package_name) + 1:] if node.module != package_name else ""
            else:
                continue
            named = [_join(target, a.name) for a in node.names if _join(target, a.name) in names]
            for t in named or [target]:
                add(t, fn)
        else:
            for a in node.names:
                if a.name == package_name or a.name.startswith(package_name + "."):
                    add(a.name[len(package_name) + 1:] if a.name != package_name else "", fn)
    return out


def build_graph(package: str = PACKAGE) -> dict:
    """``{module: {target: kind}}`` for every module of the package."""
    files = modules(package)
    names = set(files)
    return {m: imports(p, m, names) for m, p in files.items()}


def strongly_connected(graph: dict) -> list:
    """The strongly connected components of more than one node (the cycles), each sorted (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def layout_groups(graph: dict) -> dict:
    """The groups of the layout as it is: a module's sub-package, or :data:`TOP` at the top level."""
    return {m: (m.split(".")[0] if "." in m or _is_package(m, graph) else TOP) for m in graph}


def _is_package(module: str, graph: dict) -> bool:
    return any(other.startswith(module + ".") for other in graph) if module else False


def proposed_groups(graph: dict, spec: list) -> dict:
    """Groups from ``["name=mod1,mod2", ...]``; a module named by no group is in its own
    sub-package's group, or :data:`TOP`."""
    groups = layout_groups(graph)
    for item in spec:
        name, sep, mods = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--group {item!r}: expected NAME=module,module,...")
        for m in filter(None, (s.strip() for s in mods.split(","))):
            hits = [x for x in graph if x == m or x.startswith(m + ".")]
            if not hits:
                raise ValueError(f"--group {item!r}: no module {m!r} in the package")
            for x in hits:
                groups[x] = name
    return groups


def group_edges(graph: dict, groups: dict) -> Counter:
    """``{(from group, to group, kind): count}`` over the imports between different groups."""
    out = Counter()
    for m, targets in graph.items():
        for t, kind in targets.items():
            if groups[m] != groups[t]:
                out[(groups[m], groups[t], kind)] += 1
    return out


def violations(graph: dict, groups: dict, order=LAYERS) -> list:
    """``["a -> b (group x imports later group y, kind)"]``: every import against ``order``, and
    every import of a group missing from ``order``."""
    rank = {g: i for i, g in enumerate(order)}
    out = []
    for m in sorted(graph):
        for t, kind in sorted(graph[m].items()):
            gm, gt = groups[m], groups[t]
            if gm not in rank or gt not in rank:
                out.append(f"{m or '__init__'} -> {t or '__init__'} ({gm} or {gt} is no layer of {list(order)})")
            elif rank[gt] > rank[gm]:
                out.append(f"{m or '__init__'} -> {t or '__init__'} ({gm} imports the later {gt}, {kind})")
    return out


def _report(graph: dict, groups: dict, order) -> dict:
    group_graph = {}
    for (a, b, _), n in group_edges(graph, groups).items():
        group_graph.setdefault(a, set()).add(b)
    members = {}
    for m, g in groups.items():
        members.setdefault(g, []).append(m or "__init__")
    return {
        "modules": len(graph),
        "edges": {k: sum(1 for ts in graph.values() for v in ts.values() if v == k) for k in ("top", "function")},
        "graph": {m or "__init__": {t or "__init__": k for t, k in sorted(ts.items())}
                  for m, ts in sorted(graph.items())},
        "module_cycles": strongly_connected(graph),
        "groups": {g: sorted(ms) for g, ms in sorted(members.items())},
        "group_edges": [{"from": a, "to": b, "kind": k, "imports": n}
                        for (a, b, k), n in sorted(group_edges(graph, groups).items())],
        "group_cycles": strongly_connected(group_graph),
        "order": list(order),
        "against_order": violations(graph, groups, order),
    }


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/import_graph.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--package", default=PACKAGE, help="the package folder (default: python/emcl_continual)")
    p.add_argument("--group", action="append", default=[], metavar="NAME=MOD,MOD",
                   help="put these modules (a package names all its modules) in group NAME; repeatable")
    p.add_argument("--order", default=",".join(LAYERS),
                   help="the groups in import order, comma-separated (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.package, "__init__.py")):
        p.error(f"--package {args.package}: not a package folder (no __init__.py)")
    graph = build_graph(args.package)
    try:
        groups = proposed_groups(graph, args.group)
    except ValueError as exc:
        p.error(str(exc))
    out = _report(graph, groups, tuple(filter(None, args.order.split(","))))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['modules']} modules, {out['edges']['top']} top-level and {out['edges']['function']} "
          f"function-level imports within the package")
    print("\nmodule -> modules it imports (* = inside a function)")
    for m, ts in out["graph"].items():
        print(f"  {m} [{groups['' if m == '__init__' else m]}] -> "
              + ", ".join(t + ("*" if k == "function" else "") for t, k in ts.items()))
    print("\nmodule cycles:", "; ".join(" ".join(c) for c in out["module_cycles"]) or "none")
    print("\ngroups:")
    for g, ms in out["groups"].items():
        print(f"  {g}: {', '.join(ms)}")
    print("\nimports between groups (from -> to: top-level + function-level):")
    pairs = Counter()
    for e in out["group_edges"]:
        pairs[(e["from"], e["to"])] += 0
        pairs[(e["from"], e["to"], e["kind"])] = e["imports"]
    for a, b in sorted({(e["from"], e["to"]) for e in out["group_edges"]}):
        print(f"  {a} -> {b}: {pairs.get((a, b, 'top'), 0)} + {pairs.get((a, b, 'function'), 0)}")
    print("\ngroup cycles:", "; ".join(" ".join(c) for c in out["group_cycles"]) or "none")
    print(f"imports against the order {' <- '.join(out['order'])}:", len(out["against_order"]))
    for v in out["against_order"]:
        print("  " + v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
