"""Compile kernels_cu/*.cu with cupy.RawModule: modules of a file's kernels per element type, on demand.

common.cuh is prepended to each source (not #included) so that CuPy's compile cache key
covers it. families.py lists each file's template instantiations, in one place, and how many of
them share a module (NVRTC's time grows with a module's kernels; modules compile in parallel). A
runner calls `prepare` with the files and types it uses, which compiles them in parallel.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from . import kernel_dir

# numpy storage dtype name -> CUDA element type (bf16 is stored as uint16 words)
CUDA_TYPES = {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16"}

# files of arch-specific instructions (sm_90a: wgmma), which run on that exact architecture only:
# file -> (NVRTC's target, the compute capability it runs on). They are compiled by NVRTC for that
# target (CuPy's RawModule targets the plain sm_XY of the device) and used on GPUs of that compute
# capability alone.
ARCH_SPECIFIC = {"attention_sm90.cu": ("sm_90a", (9, 0)), "gemm_sm90.cu": ("sm_90a", (9, 0))}
# file -> the files its source follows (after common.cuh): the device code it shares with others
FOLLOWS = {"attention_sm90.cu": ("attention_varlen.cu", "sm90.cuh"), "gemm_sm90.cu": ("sm90.cuh",),
           "sampling.cu": ("sampling.cuh",), "sampling_levels.cu": ("sampling.cuh",),
           "sampling_cluster.cu": ("sampling.cuh",), "beam.cu": ("sampling.cuh",)}
SHARED_KEY = "shared"


def compile_options() -> tuple[str, ...]:
    options = ["--std=c++17", "-DNDEBUG"]
    include = "/usr/local/cuda/include"  # NVRTC may not find the toolkit headers on its own
    if os.path.isdir(include):
        options.append(f"-I{include}")
    return tuple(options)


def source(file: str) -> str:
    """common.cuh, then the files the file's source follows, then the file."""
    folder = kernel_dir()
    parts = ("common.cuh", *FOLLOWS.get(file, ()), file)
    return "\n".join((folder / part).read_text() for part in parts)


def instantiations(file: str, ctype: str) -> list[str]:
    """The kernels of `file` in the module for element type `ctype`, or SHARED_KEY's (families.py's
    tables; imported here, at first use, since they take their constants from the launchers)."""
    from .families import FAMILIES, SHARED
    return SHARED.get(file, []) if ctype == SHARED_KEY else FAMILIES[file](ctype)


def all_instantiations(file: str) -> list[str]:
    return [n for t in (*CUDA_TYPES.values(), SHARED_KEY) for n in instantiations(file, t)]


def groups(file: str, key: str) -> list[tuple[str, ...]]:
    """The modules of `file` for `key` (an element type or SHARED_KEY), each as the kernels it
    holds: the instantiations in groups of families.MODULE_KERNELS[file] (one group where unlisted)."""
    from .families import MODULE_KERNELS
    names = instantiations(file, key)
    size = MODULE_KERNELS.get(file, len(names)) or 1
    return [tuple(names[at:at + size]) for at in range(0, len(names), size)]


@lru_cache(maxsize=None)
def _owner(file: str, name: str) -> tuple[str, int]:
    """The module (element type or SHARED_KEY, group) that holds kernel `name` of `file`."""
    for key in (*CUDA_TYPES.values(), SHARED_KEY):
        for index, names in enumerate(groups(file, key)):
            if name in names:
                return key, index
    raise KeyError(f"{file} lists no kernel {name!r}")


_compile_locks: dict = {}
_modules: dict = {}
_modules_lock = threading.Lock()


def kernel_cache_dir() -> str:
    """CuPy's on-disk kernel cache, where the arch-specific modules are kept beside CuPy's own."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


class ArchKernel:
    """A kernel of an ArchModule, with the part of CuPy's RawKernel that the launchers use: `kernel` (the
    loaded function; launched through launch_ex) and `max_dynamic_shared_size_bytes`."""

    def __init__(self, function):
        self.kernel = function

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy.cuda import driver
        return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, size: int):
        from cupy.cuda import driver
        driver.funcSetAttribute(self.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, size)


class ArchModule:
    """`names` (template instantiations) of `code` compiled by NVRTC for the arch-specific target
    `arch` (e.g. sm_90a) and loaded; the cubin is kept in the kernel cache, keyed by the source,
    names, options and NVRTC's version."""

    def __init__(self, code: str, names, arch: str):
        from cupy.cuda import function
        from cupy_backends.cuda.libs import nvrtc
        options = (*compile_options(), f"--gpu-architecture={arch}")
        key = json.dumps([code, sorted(names), options, list(nvrtc.getVersion())])
        path = os.path.join(kernel_cache_dir(), f"ftengine_{arch}_{hashlib.sha256(key.encode()).hexdigest()}.cubin")
        try:
            with open(path, "rb") as f:
                header, cubin = f.read().split(b"\n", 1)
            lowered = json.loads(header)
        except (OSError, ValueError):
            lowered, cubin = self._compile(nvrtc, code, names, options)
            os.makedirs(kernel_cache_dir(), exist_ok=True)
            part = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
            with open(part, "wb") as f:
                f.write(json.dumps(lowered).encode() + b"\n" + cubin)
            os.replace(part, path)
        self._module = function.Module()
        self._module.load(cubin)
        self._lowered = lowered

    @staticmethod
    def _compile(nvrtc, code: str, names, options) -> tuple[dict, bytes]:
        program = nvrtc.createProgram(code, "kernels.cu", [], [])
        try:
            for n in names:
                nvrtc.addNameExpression(program, n)
            try:
                nvrtc.compileProgram(program, list(options))
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"NVRTC failed for {options[-1]}: {e}\n{nvrtc.getProgramLog(program)}") from None
            return {n: nvrtc.getLoweredName(program, n) for n in names}, nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)

    def get_function(self, name: str) -> ArchKernel:
        return ArchKernel(self._module.get_function(self._lowered[name]))


def module(file: str, ctype: str, index: int = 0):
    """One compiled module per (file, element type, group of groups()), compiled (or read from the
    disk cache) and loaded before it is returned: a run compiles only the types it uses.
    Thread-safe; two threads asking for one module compile it once (CuPy's RawModule compiles at
    its first get_function, so that call is made here, under the module's lock)."""
    key = (file, ctype, index)
    found = _modules.get(key)
    if found is not None:
        return found
    with _modules_lock:
        lock = _compile_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _modules:
            import cupy
            names = list(groups(file, ctype)[index])
            if file in ARCH_SPECIFIC:
                built = ArchModule(source(file), names, ARCH_SPECIFIC[file][0])
            else:
                built = cupy.RawModule(code=source(file), options=compile_options(), name_expressions=names)
                built.get_function(names[0])
            _modules[key] = built
    return _modules[key]


def modules_of(files, ctypes, *, only: dict | None = None) -> list[tuple[str, str, int]]:
    """The modules (file, element type or SHARED_KEY, group) of `files` for element types `ctypes`
    and their shared kernels. only: file -> the kernels of that file a run launches; of such a
    file, only the modules holding one."""
    return [(f, t, i) for f in files for t in (*dict.fromkeys(ctypes), SHARED_KEY) for i, names in enumerate(groups(f, t))
            if only is None or f not in only or not set(names).isdisjoint(only[f])]


def prepare(files, ctypes, *, only: dict | None = None):
    """Compile (or load from CuPy's disk cache) the modules of `files` for element types
    `ctypes`, and their shared kernels (modules_of), in parallel threads: NVRTC runs without the
    GIL, so a cold start costs far less than their sum (modules compiled at once slow each other
    down: docs/performance.md, Cold start)."""
    import cupy
    keys = modules_of(files, ctypes, only=only)
    device = cupy.cuda.Device().id

    def build(key):
        with cupy.cuda.Device(device):
            module(*key).get_function(groups(*key[:2])[key[2]][0])  # loads the module into the context

    with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, len(keys)))) as pool:
        list(pool.map(build, keys))


@lru_cache(maxsize=None)
def kernel(file: str, name: str):
    """A compiled kernel, e.g. kernel("layernorm.cu", "add_bias_residual_layernorm<__half, __half, 1, 8, 1>")."""
    return module(file, *_owner(file, name)).get_function(name)
