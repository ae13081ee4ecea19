"""Our CUDA kernels compiled once per machine: MLX's PTX disk cache, written by us.

MLX (0.32, `mlx/backend/cuda/custom_kernel.cpp`, `jit_module.cpp`) compiles a custom kernel
with NVRTC the first time a process launches it, and before compiling it reads its disk cache:
`<dir>/<module>.ptx` (PTX or a CUBIN) and `<dir>/<module>.txt` (the kernel's name, a tab, its
mangled name), where `<dir>` is `$MLX_PTX_CACHE_DIR` or `<temp>/mlx/<version>/ptx` and
`<module>` is `<kernel name>_<std::hash of the kernel's full source, hex>`. For custom kernels
it never writes that cache, so every process compiles every kernel again (the first decode step
of the pinned geometry: ~25 s on the H200's host, docs/ledger.md).

This module writes those files. `mlx_source` rebuilds the text MLX compiles for one launch
(its wrapper around our header and body, byte for byte), `std_hash` is libstdc++'s hash of it,
and `compile_module` runs NVRTC with MLX's options. `KernelCache` records each launch's
instantiation and, before the launches are evaluated (`ready`), compiles those the directory
lacks, several at once, and writes them; MLX then loads them instead of compiling. A module
whose text or MLX version differs has another name, so a stale file is never read; when the
rebuilt text differs from MLX's own (another MLX), the files are simply never read, which
tests/gpu checks against MLX's printed source.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

CUDA_TYPES = {mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
              mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
              mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
              mx.float64: "double", mx.complex64: "mlx::core::cu::complex64_t"}
# get_type_string (mlx/backend/common/compiled.cpp): a dtype template argument in a kernel's name
TYPE_STRINGS = {mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
                mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
                mx.int64: "int64_t", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float32: "float",
                mx.float64: "double", mx.complex64: "complex64_t"}

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s std::hash<std::string> on a 64-bit target (_Hash_bytes: MurmurHash2, 64-bit)."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * _MUL)) & _MASK
    for p in range(0, aligned, 8):
        word = int.from_bytes(data[p:p + 8], "little")
        h ^= (shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = (shift_mix(h) * _MUL) & _MASK
    return shift_mix(h)


def template_suffix(template: list[tuple]) -> str:
    """MLX's template_arguments_hash: '_<int>', '_t' / '_f', '_<type>' per argument."""
    out = ""
    for _, value in template:
        if isinstance(value, bool):
            out += "_t" if value else "_f"
        elif isinstance(value, int):
            out += f"_{value}"
        else:
            out += "_" + TYPE_STRINGS[value]
    return out


def mlx_source(name: str, header: str, source: str, inputs: list[tuple[str, object, int]],
               outputs: list[tuple[str, object]], template: list[tuple]) -> tuple[str, str]:
    """(kernel name, full source) as MLX's cuda_kernel builds them (build_kernel) for a launch of
    kernel `name` with inputs (name, dtype, ndim), outputs (name, dtype) and template arguments."""
    kernel = f"custom_kernel_{name}{template_suffix(template)}"
    s = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
    s += header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void {kernel}(\n"
    for n, dtype, ndim in inputs:
        s += f"    const {CUDA_TYPES[dtype]}* {n},\n"
        if ndim > 0:
            for suffix, decl in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in source:
                    s += f"    const __grid_constant__ {decl} {n}{suffix},\n"
    s += ",\n".join(f"    {CUDA_TYPES[dtype]}* {n}" for n, dtype in outputs) + ") {\n"
    if template:
        for n, value in template:
            if isinstance(value, bool):
                s += f"  constexpr bool {n} = {'true' if value else 'false'};\n"
            elif isinstance(value, int):
                s += f"  constexpr int {n} = {value};\n"
            else:
                s += f"  using {n} = {CUDA_TYPES[value]};\n"
        s += "\n"
    return kernel, s + source + "\n}\n\n} // namespace mlx::core::cu\n"


def module_name(kernel: str, source: str) -> str:
    return f"{kernel}_{std_hash(source.encode()):x}"


def default_dir() -> Path:
    """Where MLX looks: $MLX_PTX_CACHE_DIR, else <temp>/mlx/<MLX version>/ptx (jit_module.cpp)."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def module_path(directory: Path, module: str) -> Path:
    """MLX's get_ptx_path: names past 245 characters become folders of 245."""
    if len(module) <= 245:
        return directory / (module + ".ptx")
    path, offset = directory, 0
    while len(module) - offset > 245:
        path = path / module[offset:offset + 245]
        offset += 245
    return path / (module[offset:] + ".ptx")


# ---- NVRTC, as MLX calls it (jit_module.cpp: compile) ------------------------------------


# MLX hands NVRTC its device headers from strings inside libmlx, not files; the wheel ships only
# config.h. The one our kernels' text includes (MLX's wrapper does) is utils.cuh, which defines
# helpers in mlx::core::cu that our kernels do not call; for our compiles it is this stand-in with
# the same system includes. tests/gpu checks that kernels compiled this way give bitwise the
# outputs of the ones MLX compiles itself.
UTILS_STAND_IN = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
"""


class Nvrtc:
    """NVRTC through ctypes (the library MLX's CUDA backend loads: pip's nvidia-cuda-nvrtc), with
    the include folders MLX passes (include_path_args) and UTILS_STAND_IN."""

    def __init__(self, lib: ctypes.CDLL, includes: list[Path], capability: tuple[int, int]):
        self.lib, self.includes, self.capability = lib, includes, capability

    @classmethod
    def find(cls, capability: tuple[int, int]) -> "Nvrtc | None":
        """NVRTC and the headers if this machine has them, else None (MLX then compiles as before)."""
        lib = None
        for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            return None
        root = Path(mx.__file__).resolve().parent            # site-packages/mlx (its lib/ holds libmlx)
        includes = [p for p in (root / "include", root / "include" / "cccl") if p.is_dir()]
        cudart = root.parent / "nvidia" / "cu13" / "include"
        if not cudart.is_dir():
            home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
            cudart = Path(home) / "include"
        if not includes or not cudart.is_dir():
            return None
        return cls(lib, includes + [cudart], capability)

    def compile(self, kernel: str, source: str) -> tuple[bytes, str]:
        """(CUBIN, the kernel's mangled name) of `mlx::core::cu::<kernel>` in `source`; raises
        RuntimeError with NVRTC's log when it does not compile."""
        lib, major, minor = self.lib, *self.capability
        prog = ctypes.c_void_p()
        expr = f"mlx::core::cu::{kernel}".encode()
        headers = (ctypes.c_char_p * 1)(UTILS_STAND_IN.encode())
        names = (ctypes.c_char_p * 1)(b"mlx/backend/cuda/device/utils.cuh")
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{kernel}.cu".encode(),
                                           1, headers, names), "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, expr), "nvrtcAddNameExpression")
            opts = [b"--device-as-default-execution-space",
                    f"--gpu-architecture=sm_{major}{minor}{'a' if major >= 9 else ''}".encode()]
            opts += [f"--include-path={p}".encode() for p in self.includes]
            if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile {kernel}: {log.value.decode(errors='replace')[:2000]}")
            mangled = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, expr, ctypes.byref(mangled)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, mangled.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC's {call} failed with status {status}")


class KernelCache:
    """The instantiations a process launches, compiled into MLX's disk cache before MLX needs them.

    `note` (every launch; a dictionary lookup after the first of an instantiation) records a
    module the directory lacks; `ready` (before the launches are evaluated) compiles the recorded
    modules, `workers` at once, and writes each as MLX reads it: the names file first, then the
    binary by an atomic rename, so a reader never sees a binary without its names."""

    def __init__(self, directory: Path, nvrtc: Nvrtc, workers: int | None = None):
        self.directory, self.nvrtc = Path(directory), nvrtc
        self.workers = workers or max(1, min(16, os.cpu_count() or 1))
        self._seen: set = set()
        self._pending: dict[str, tuple[str, str]] = {}
        self.written: list[str] = []
        self.failed: list[str] = []

    def note(self, name: str, header: str, source: str, input_names: list[str], inputs: list,
             output_names: list[str], output_dtypes: list, template: list) -> None:
        key = (name, tuple(template or ()), tuple((a.dtype, a.ndim) for a in inputs), tuple(output_dtypes))
        if key in self._seen:
            return
        self._seen.add(key)
        kernel, text = mlx_source(name, header, source, [(n, a.dtype, a.ndim) for n, a in zip(input_names, inputs)],
                                  list(zip(output_names, output_dtypes)), list(template or ()))
        module = module_name(kernel, text)
        if not module_path(self.directory, module).exists():
            self._pending[module] = (kernel, text)

    def ready(self) -> None:
        if not self._pending:
            return
        jobs, self._pending = list(self._pending.items()), {}
        with ThreadPoolExecutor(min(self.workers, len(jobs))) as pool:
            list(pool.map(self._write, jobs))

    def _write(self, job: tuple[str, tuple[str, str]]) -> None:
        module, (kernel, text) = job
        try:
            binary, mangled = self.nvrtc.compile(kernel, text)
            path = module_path(self.directory, module)
            path.parent.mkdir(parents=True, exist_ok=True)
            names = path.with_suffix(".txt")
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            names.write_text(f"mlx::core::cu::{kernel}\t{mangled}\n")
            tmp.write_bytes(binary)
            os.replace(tmp, path)
            self.written.append(module)
        except (OSError, RuntimeError) as exc:   # MLX compiles it itself, as without the cache
            self.failed.append(f"{module}: {exc}")
