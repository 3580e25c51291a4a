"""Where the package's data lives: reference kernels and built-in specs.

The reference kernels stay in the repository's top-level ref_kernels/ (the layout fixes it); a
wheel carries them as cubridge/ref_kernels/ (setup.py's build step copies them in). So a checkout
or an editable install finds them beside the package, and a wheel install inside it.
"""
from __future__ import annotations

from pathlib import Path

from cubridge.errors import CubridgeError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


def _ref_kernels_dir() -> Path:
    packaged = PACKAGE_DIR / "ref_kernels"          # a wheel install
    return packaged if packaged.is_dir() else REPO_DIR / "ref_kernels"


REF_KERNELS_DIR = _ref_kernels_dir()


def ref_kernel_names() -> list[str]:
    if not REF_KERNELS_DIR.is_dir():
        return []
    return sorted(p.name for p in REF_KERNELS_DIR.iterdir() if (p / "kernel.cuir").is_file())


def ref_kernel_dir(name: str) -> Path:
    """The folder of a reference kernel (kernel.cu, kernel.cuir, README.md)."""
    d = REF_KERNELS_DIR / name
    if not (d / "kernel.cuir").is_file():
        raise CubridgeError(f"unknown reference kernel {name!r}", where=str(REF_KERNELS_DIR),
                            hint=f"known reference kernels: {', '.join(ref_kernel_names()) or 'none'} (a wheel "
                                 "built without setup.py's build step lacks cubridge/ref_kernels/)")
    return d
