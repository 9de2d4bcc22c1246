"""The CUDA toolchain this install compiles with, and the architectures it can build for.

numba-cuda compiles through the NVRTC and NVVM that ``cuda-bindings`` loads, and refuses a target
below the lowest architecture in NVRTC's own list (``nvrtcGetSupportedArchs``, read by
``numba.cuda.cudadrv.nvrtc.find_closest_arch``). This module reads the same list, so an install is
judged by the toolchain it really loads, whatever pip installed: CUDA 12 (``numqsa[cu12]``) builds
sm_70 (V100) and newer, CUDA 13 (``numqsa[cu13]``) sm_75 and newer. :func:`check_target` turns a
target the toolchain cannot build into a :class:`ToolchainError` that names the install to use,
before the compiler is reached. ``python -m numqsa.toolchain`` prints what this install has.
"""
import functools
import sys
from typing import NamedTuple, Optional, Tuple

__all__ = ["ToolchainError", "INSTALL", "Toolchain", "toolchain", "check_target", "describe"]

#: The install for each CUDA major version (README "Install").
INSTALL = {12: "pip install 'numqsa[cu12]'", 13: "pip install 'numqsa[cu13]'"}


class ToolchainError(RuntimeError):
    """This install's CUDA toolchain cannot build for the requested architecture (or is missing)."""


class Toolchain(NamedTuple):
    nvrtc: Optional[Tuple[int, int]]   # NVRTC's (major, minor), None if none loads
    ccs: Tuple[Tuple[int, int], ...]   # the targets NVRTC lists, ascending
    nvvm: Optional[str]                # the libNVVM numba-cuda loads, None if none is found


@functools.cache
def toolchain():
    """The NVRTC and libNVVM numba-cuda compiles with, found the way it finds them."""
    nvrtc_version, ccs, nvvm = None, (), None
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
        err2, archs = nvrtc.nvrtcGetSupportedArchs()
        if err == err2 == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            nvrtc_version, ccs = (major, minor), tuple(sorted((a // 10, a % 10) for a in archs))
    except Exception:          # no libnvrtc that cuda-bindings can load
        pass
    try:
        from numba.cuda.cuda_paths import _get_nvvm   # numba-cuda 0.30.4's own search
        nvvm = _get_nvvm().abs_path
    except Exception:
        pass
    return Toolchain(nvrtc_version, ccs, nvvm)


def check_target(cc):
    """Raise :class:`ToolchainError` unless this install can build kernels for compute capability ``cc``."""
    t = toolchain()
    if t.nvrtc is None or t.nvvm is None:
        missing = " and ".join(n for n, v in (("NVRTC", t.nvrtc), ("libNVVM", t.nvvm)) if v is None)
        raise ToolchainError(
            f"numba-cuda finds no {missing} in this environment, so no kernel can be built. "
            f"Install a toolchain: {INSTALL[13]} (sm_75 and newer; beside a CUDA 13 PyTorch/CuPy) "
            f"or {INSTALL[12]} (also sm_70, V100)")
    cc = tuple(cc)[:2]
    if t.ccs and cc < t.ccs[0]:
        raise ToolchainError(
            f"this numqsa install compiles with the CUDA {t.nvrtc[0]}.{t.nvrtc[1]} toolchain, which "
            f"cannot build for sm_{cc[0]}{cc[1]} (its lowest target is sm_{t.ccs[0][0]}{t.ccs[0][1]}). "
            f"For sm_70 (V100), install the CUDA 12 variant, in an environment whose PyTorch/CuPy "
            f"(if any) are CUDA 12 builds: {INSTALL[12]}")


def describe():
    """One line each: cuda-bindings, NVRTC and its targets, libNVVM, numqsa's own path."""
    try:
        import cuda.bindings
        lines = [f"cuda-bindings {cuda.bindings.__version__}"]
    except ImportError:
        lines = ["cuda-bindings: not installed"]
    t = toolchain()
    lines.append(f"NVRTC {t.nvrtc[0]}.{t.nvrtc[1]}: sm_{t.ccs[0][0]}{t.ccs[0][1]} to "
                 f"sm_{t.ccs[-1][0]}{t.ccs[-1][1]}" if t.nvrtc and t.ccs else "NVRTC: none loads")
    lines.append(f"libNVVM {t.nvvm}" if t.nvvm else "libNVVM: not found")
    from importlib import metadata
    from pathlib import Path
    try:
        version = metadata.version("numqsa")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    lines.append(f"numqsa {version} {Path(__file__).parent / '__init__.py'}")
    return lines


def main(argv=None):
    """Print :func:`describe`; with ``--expect 12|13`` exit 1 unless NVRTC has that major version."""
    import argparse
    ap = argparse.ArgumentParser(description="Print the CUDA toolchain this numqsa install uses.")
    ap.add_argument("--expect", type=int, choices=sorted(INSTALL),
                    help="exit 1 unless NVRTC's major version is this")
    args = ap.parse_args(argv)
    print("\n".join(describe()))
    t = toolchain()
    if args.expect and (t.nvrtc is None or t.nvrtc[0] != args.expect or t.nvvm is None):
        sys.exit(f"expected the CUDA {args.expect} toolchain (NVRTC and libNVVM), found NVRTC "
                 f"{t.nvrtc} and libNVVM {t.nvvm}")


if __name__ == "__main__":
    main()
