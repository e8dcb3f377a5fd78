#!/usr/bin/env python3
"""After an install: which backends work, and is the compiled one there?

Prints ``emcl_kernels.backend_status()`` and where ``emcl_kernels`` and ``emcl_kernels._C`` were
imported from. Fails (exit 1) when the compiled ``cpu`` backend is not available, unless the
install asked for pure Python (``EMCL_NO_EXTENSION=1``): an install that ends without the
compiled backends is an error. Run it from outside the checkout so that the import goes
through the installed package, not the current folder (``make setup`` and CI do).

Options:
  --from DIR        emcl_kernels must be imported from DIR (an editable install of DIR)
  --cuda-kernels    the library must hold CUDA kernels (built with nvcc; no GPU needed)
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", help="the checkout emcl_kernels must come from")
    parser.add_argument("--cuda-kernels", action="store_true",
                        help="require CUDA kernels in emcl_kernels._C")
    args = parser.parse_args(argv)

    import emcl_kernels
    from emcl_kernels import available_backends, backend_status

    where = os.path.realpath(emcl_kernels.__file__)
    status = backend_status()
    print(f"emcl_kernels from {os.path.dirname(where)}")
    for name, state in status.items():
        print(f"  {name:10s} {state}")
    if args.source:
        src = os.path.realpath(args.source)
        if not where.startswith(src + os.sep):
            print(f"FAIL: emcl_kernels was imported from {where}, not from {src}", file=sys.stderr)
            return 1
    if os.environ.get("EMCL_NO_EXTENSION", "").strip().lower() in ("1", "true", "yes", "on"):
        print("EMCL_NO_EXTENSION is set: pure Python install, no compiled backend expected")
        return 0
    if "cpu" not in available_backends():
        print("FAIL: the install ended without the compiled 'cpu' backend: "
              f"{status['cpu']}\n(EMCL_NO_EXTENSION=1 asks for a pure-Python install)",
              file=sys.stderr)
        return 1
    import emcl_kernels._C as ext
    print(f"emcl_kernels._C from {ext.__file__}")
    if args.cuda_kernels:
        import torch
        ops = [op for op in torch._C._dispatch_get_all_op_names() if op.startswith("emcl::")]
        cuda = [op for op in ops if torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
        print(f"emcl ops with a CUDA kernel: {', '.join(sorted(cuda)) or 'none'}")
        if not cuda:
            print("FAIL: emcl_kernels._C was built without its CUDA kernels", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
