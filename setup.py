"""The one build step pyproject.toml cannot declare: the top-level ref_kernels/ (kernel sources,
CuIR, headers, notes) goes into the wheel as cubridge/ref_kernels/, so a non-editable install can
lower, compile and tune. An editable install reads them from the checkout (cubridge/paths.py)."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNEL_FILES = ("*.cu", "*.cuh", "*.cuir", "*.md", "*.py")


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for kernel in sorted(p for p in (ROOT / "ref_kernels").iterdir() if (p / "kernel.cuir").is_file()):
            dest = Path(self.build_lib) / "cubridge" / "ref_kernels" / kernel.name
            dest.mkdir(parents=True, exist_ok=True)
            for pattern in KERNEL_FILES:
                for f in kernel.glob(pattern):
                    shutil.copy2(f, dest / f.name)


setup(cmdclass={"build_py": BuildPyWithKernels})
