"""Compile every Triton kernel of fastdp.kernels for Hopper (sm_90) without a GPU.

Run as a script in a process without TRITON_INTERPRET (interpreted kernels cannot be
compiled). Each kernel module lists its kernels in ``hopper_compile_specs()`` as (kernel,
signature, constexprs[, launch options such as num_warps, as its launcher passes them]), and
may name PTX that a kernel must not contain in ``hopper_ptx_absent()`` (approximate square
roots and divisions where the backends must agree bitwise) and PTX that variants must contain in
``hopper_ptx_present()`` ({kernel: [(constexprs the variant has, regex)]}: 128-bit vector loads
where the launcher promises 16-byte alignment). Every variant must compile without
register spills (no stack frame, ``cuobjdump -res-usage``), except those a module lists with
the reason in ``hopper_known_spills()``. Prints one line per kernel variant and exits non-zero
on the first failure.
"""

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tempfile

import fastdp.kernels
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def stack_bytes(cubin: bytes) -> int | None:
    """The kernel's stack frame in bytes (register spills land there; the kernels use no local arrays), from
    ``cuobjdump -res-usage`` of its cubin; None where triton ships no cuobjdump."""
    if not os.path.exists(CUOBJDUMP):
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return max(int(v) for v in re.findall(r"STACK:(\d+)", out))


def main() -> int:
    count = 0
    for info in pkgutil.iter_modules(fastdp.kernels.__path__):
        module = importlib.import_module(f"fastdp.kernels.{info.name}")
        absent = getattr(module, "hopper_ptx_absent", dict)()
        present = getattr(module, "hopper_ptx_present", dict)()
        known = getattr(module, "hopper_known_spills", dict)()
        for fn, signature, constexprs, *options in getattr(module, "hopper_compile_specs", list)():
            full = {**signature, **{name: "constexpr" for name in constexprs}}
            keys = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
            opts = options[0] if options else {}  # the launch options the launcher uses (num_warps)
            kernel = triton.compile(ASTSource(fn, full, constexprs=keys), target=TARGET, options=opts)
            assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
            for text in absent.get(fn.__name__, ()):
                assert text not in kernel.asm["ptx"], f"{fn.__name__} {constexprs}: its PTX has {text!r}"
            for required, pattern in present.get(fn.__name__, ()):
                if all(constexprs.get(name) == value for name, value in required.items()):
                    assert re.search(pattern, kernel.asm["ptx"]), f"{fn.__name__} {constexprs}: no {pattern!r} in PTX"
            stack = stack_bytes(kernel.asm["cubin"])
            if fn.__name__ in known:
                assert stack != 0, f"{fn.__name__} no longer spills: remove it from hopper_known_spills()"
                print(f"KNOWN SPILL {info.name}.{fn.__name__} {constexprs} {opts}: {stack} B, {known[fn.__name__]}")
            else:
                assert not stack, f"{fn.__name__} {constexprs} {opts}: {stack} bytes of stack (register spills)"
            print(f"ok {info.name}.{fn.__name__} {constexprs} {opts} stack {stack}")
            count += 1
    print(f"compiled {count} kernel variants for sm_90")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())
