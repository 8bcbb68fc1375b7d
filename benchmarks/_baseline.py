"""Another version of one of genserve's kernel sources, built beside the checkout's, so a benchmark
can time the two on the same operands in the same run (the machine's speed moves by up to 2×
between hours, so a figure from another run is no baseline), or built for another target (e.g.
`-march=x86-64-v3`, the AVX2 code paths on a host with AVX512), so the tests and benchmarks can
run code this host's own build does not contain.

The source (e.g. the previous commit's, `git show REV:engine/kernels/csrc/q4q8_linear.cpp >
/tmp/old.cpp`) is edited by plain string replacements so that its ops register in another library
(e.g. `genserve_baseline`) instead of `genserve`, then compiled with the flags of `engine.kernels`
(or for another `-march`) against the checkout's headers in engine/kernels/csrc.
"""

from __future__ import annotations

import pathlib
import tempfile
import zlib

CSRC = pathlib.Path(__file__).resolve().parent.parent / "engine" / "kernels" / "csrc"


def build_baseline(path: str | pathlib.Path, renames: list[tuple[str, str]],
                   march: str | None = None) -> None:
    """Compile the kernel source at `path`, after `renames` ((old, new) string replacements, each
    of which must occur), as a torch extension whose ops are then registered under the library
    the renames give it (e.g. `torch.ops.genserve_baseline.*`), with `engine.kernels.CFLAGS`, or
    with `march` for `-march=<march>` instead of this host (`march_flags`).

    Raises:
        ValueError: a replacement's `old` text is not in the source.
        RuntimeError: the build failed (from torch.utils.cpp_extension), e.g. an unknown `march`
            or a library name already registered in this process by another source.
    """
    from torch.utils import cpp_extension

    from engine import kernels

    src = pathlib.Path(path).read_text()
    for old, new in renames:
        if old not in src:
            raise ValueError(f"{path}: no {old!r} to rename")
        src = src.replace(old, new)
    flags = march_flags(march) if march else kernels.CFLAGS
    tag = zlib.crc32(src.encode() + " ".join(flags).encode()
                     + b"".join(f.read_bytes() for f in sorted(CSRC.glob("*.h"))))
    out = pathlib.Path(tempfile.gettempdir()) / f"genserve_baseline_{tag:08x}.cpp"
    out.write_text(src)
    kernels.put_ninja_on_path()
    cpp_extension.load(name=f"genserve_baseline_{tag:08x}", sources=[str(out)],
                       extra_cflags=flags, extra_include_paths=[str(CSRC)],
                       is_python_module=False, verbose=False)


def march_flags(march: str) -> list[str]:
    """`engine.kernels.CFLAGS` (a new list) with `-march=native` replaced by `-march=<march>`: e.g.
    "x86-64-v3" compiles the AVX2 code paths (AVX2, FMA, F16C, no AVX512) on a host that has
    AVX512, so they can be run and timed there. An unknown `march` fails only at the build
    (`build_baseline` raises RuntimeError)."""
    from engine import kernels

    return [f"-march={march}" if flag == "-march=native" else flag for flag in kernels.CFLAGS]
