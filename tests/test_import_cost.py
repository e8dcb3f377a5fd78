"""What ``import emcl_kernels`` costs beyond ``import torch``.

``torch.distributed.tensor`` alone takes about 0.6 s to import, more than the rest of the
package; ``emcl_kernels.integration`` recognises DTensor parameters without importing it
([note: DTensor looked up lazily]). These tests run fresh interpreters, so what an earlier test
imported does not hide an eager import.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh(code: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "python"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_does_not_load_torch_distributed_tensor():
    out = _fresh("import sys, emcl_kernels, emcl_kernels.functional, emcl_kernels.optimizer\n"
                 "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor')"
                 " or m.startswith('torch.distributed._tensor')))")
    assert out == "[]", f"import emcl_kernels imported {out}"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_dtensor_is_recognised_once_the_user_imported_it():
    out = _fresh(
        "import os, sys, tempfile, torch, emcl_kernels\n"
        "from emcl_kernels.integration import is_dtensor\n"
        "assert not is_dtensor(torch.ones(2))\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.tensor import DTensor, Replicate, distribute_tensor\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "f = tempfile.mktemp()\n"
        "dist.init_process_group('gloo', init_method='file://' + f, rank=0, world_size=1)\n"
        "mesh = init_device_mesh('cpu', (1,))\n"
        "d = distribute_tensor(torch.ones(4), mesh, [Replicate()])\n"
        "print(is_dtensor(d), is_dtensor(torch.ones(2)))\n"
        "dist.destroy_process_group()\n")
    assert out == "True False"
