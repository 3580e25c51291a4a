"""Build, load, launch and time CUDA kernels from Python.

- build:    nvcc / NVRTC -> cubin, cached on disk by sha256(source, options, arch, compiler version)
- driver:   the CUDA driver API through ctypes (module load, TMA maps, launch): the one launch path
- launch:   pre-launch argument checks (LaunchError) and LoadedKernel, a cubin entry launched
            through the driver on the current torch stream
- timing:   the one timing protocol used for our kernels and every baseline
- fa2_sm80: Config + Fa2Sm80, the Python face of ref_kernels/fa2_sm80/kernel.cu

Nothing here needs a GPU at import time: the checks and the nvcc path work on a CPU machine. CuPy
is used only by build.py, for its NVRTC binding (compiler="nvrtc"); nothing launches through it.
"""
from cubridge.runtime.build import CompileResult, cache_key, compile_cubin
from cubridge.runtime.launch import AttnShape, check_attention_args

__all__ = ["AttnShape", "CompileResult", "cache_key", "check_attention_args", "compile_cubin"]
