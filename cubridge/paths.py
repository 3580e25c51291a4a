"""Where the repository's data lives: reference kernels and built-in specs."""
from __future__ import annotations

from pathlib import Path

from cubridge.errors import CubridgeError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
REF_KERNELS_DIR = REPO_DIR / "ref_kernels"


def ref_kernel_names() -> list[str]:
    if not REF_KERNELS_DIR.is_dir():
        return []
    return sorted(p.name for p in REF_KERNELS_DIR.iterdir() if (p / "kernel.cuir").is_file())


def ref_kernel_dir(name: str) -> Path:
    """The folder of a reference kernel (kernel.cu, kernel.cuir, README.md)."""
    d = REF_KERNELS_DIR / name
    if not (d / "kernel.cuir").is_file():
        raise CubridgeError(f"unknown reference kernel {name!r}", where=str(REF_KERNELS_DIR),
                            hint=f"known reference kernels: {', '.join(ref_kernel_names()) or 'none'}")
    return d
