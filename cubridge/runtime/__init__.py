"""Build, load, launch and time CUDA kernels from Python.

- build:    nvcc / NVRTC -> cubin, cached on disk by sha256(source, options, arch, compiler version)
- launch:   pre-launch argument checks (LaunchError) and CuPy-based loading / launching on the
            current torch stream
- timing:   the one timing protocol used for our kernels and every baseline
- fa2_sm80: Config + Fa2Sm80, the Python face of ref_kernels/fa2_sm80/kernel.cu

Nothing here imports CuPy at import time: the checks and the nvcc path work on a CPU machine.
"""
from cubridge.runtime.build import CompileResult, cache_key, compile_cubin
from cubridge.runtime.launch import AttnShape, check_attention_args

__all__ = ["AttnShape", "CompileResult", "cache_key", "check_attention_args", "compile_cubin"]
