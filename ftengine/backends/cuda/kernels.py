"""Compile kernels_cu/*.cu with NVRTC: modules of a file's kernels per element type, on demand,
kept in the kernel cache and loaded as CuPy RawModules.

common.cuh is prepended to each source (not #included) so that the cache key covers it.
families.py lists each file's template instantiations, in one place, and how many of them share a
module (NVRTC's time grows with a module's kernels; modules compile in parallel). A runner calls
`prepare` with the files and types it uses, which compiles them in parallel.
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
# file -> (NVRTC's target, the compute capability it runs on). They are compiled for that target
# (the others for the device's plain sm_XY: device_target) and used on GPUs of that compute
# capability alone.
ARCH_SPECIFIC = {"attention_sm90.cu": ("sm_90a", (9, 0)), "gemm_sm90.cu": ("sm_90a", (9, 0))}
# file -> the files its source follows (after common.cuh): the device code it shares with others
FOLLOWS = {"attention_sm90.cu": ("attention_varlen.cu", "sm90.cuh"), "gemm_sm90.cu": ("sm90.cuh",),
           "sampling.cu": ("sampling.cuh",), "sampling_levels.cu": ("sampling.cuh",),
           "sampling_cluster.cu": ("sampling.cuh",), "beam.cu": ("sampling.cuh",), "gemv_norm.cu": ("gemv.cu",)}
SHARED_KEY = "shared"


@lru_cache(maxsize=None)
def compile_options() -> tuple[str, ...]:
    """NVRTC's options for every module: C++17, and the folders of the CUDA headers the kernels
    include (NVRTC has no mma.h of its own): the toolkit's where CuPy finds one, and those of pip's
    CUDA wheels, which CuPy's own compiles add."""
    import cupy
    import cupy._environment
    from cupy_backends.cuda.libs import nvrtc
    folders = [os.path.join(cupy.cuda.get_cuda_path() or "/usr/local/cuda", "include")]
    wheels = getattr(cupy._environment, "_get_include_dir_from_conda_or_wheel", None)  # private: may go
    if wheels is not None:
        folders += wheels(*nvrtc.getVersion())
    return ("--std=c++17", "-DNDEBUG", *(f"-I{f}" for f in dict.fromkeys(folders) if os.path.isdir(f)))


# what CuPy's RawModule adds to a compile's options (NVRTC 12+), with which the files other than the
# ARCH_SPECIFIC ones were compiled through it: flush-to-zero, and functions (e.g. lambdas in device
# code) device functions unless annotated
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def options(file: str) -> tuple[str, ...]:
    """NVRTC's options for `file` on the current device, its target last."""
    return (*compile_options(), *(() if file in ARCH_SPECIFIC else CUPY_OPTIONS), f"--gpu-architecture={target(file)}")


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
    holds: the instantiations in groups of families.MODULE_KERNELS[file] (one group where unlisted),
    each group within one of families.sections (e.g. the kernels of one vector width)."""
    from .families import MODULE_KERNELS, sections
    parts = [instantiations(file, key)] if key == SHARED_KEY else sections(file, key)
    size = MODULE_KERNELS.get(file, sum(map(len, parts))) or 1
    return [tuple(names[at:at + size]) for names in parts for at in range(0, len(names), size)]


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
    """CuPy's on-disk kernel cache directory, where ftengine keeps its compiled modules."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


@lru_cache(maxsize=None)
def device_target(capability: int) -> str:
    """NVRTC's target for a GPU of compute capability `capability` (e.g. 90): its own SASS where NVRTC
    knows the architecture; else PTX of the newest architecture below it, which the driver compiles."""
    from cupy_backends.cuda.libs import nvrtc
    supported = [int(a) for a in nvrtc.getSupportedArchs()]
    if capability in supported:
        return f"sm_{capability}"
    return f"compute_{max(a for a in supported if a <= capability)}"


def target(file: str) -> str:
    """The NVRTC target `file` is compiled for on the current device: its own for ARCH_SPECIFIC files."""
    if file in ARCH_SPECIFIC:
        return ARCH_SPECIFIC[file][0]
    import cupy
    return device_target(int(cupy.cuda.Device().compute_capability))


class CachedModule:
    """`names` (template instantiations) of `code` compiled by NVRTC with `options` (the last one
    the target, --gpu-architecture= sm_XY, sm_90a or compute_XY) and kept in the kernel cache (the
    binary, and beside it the names' lowered forms), keyed by the source, names, options and NVRTC's
    version. Kernels come as CuPy RawKernels of the binary loaded from there. CuPy's own RawModule
    cache runs an NVRTC preprocessing pass in every process before its first lookup; this one reads
    two files."""

    def __init__(self, code: str, names, options: tuple[str, ...]):
        import cupy
        from cupy_backends.cuda.libs import nvrtc
        arch = options[-1].split("=", 1)[1]
        key = json.dumps([code, sorted(names), options, list(nvrtc.getVersion())])
        stem = os.path.join(kernel_cache_dir(), f"ftengine_{arch}_{hashlib.sha256(key.encode()).hexdigest()}")
        binary = f"{stem}.{'ptx' if arch.startswith('compute_') else 'cubin'}"
        try:
            with open(f"{stem}.json") as f:  # written after the binary: its presence means both are whole
                self._lowered = json.load(f)
            os.stat(binary)
        except (OSError, ValueError):
            self._lowered, built = self._compile(nvrtc, code, names, options)
            os.makedirs(kernel_cache_dir(), exist_ok=True)
            _write_atomically(binary, built)
            _write_atomically(f"{stem}.json", json.dumps(self._lowered))
        self._module = cupy.RawModule(path=binary)

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
            built = nvrtc.getPTX(program) if "=compute_" in options[-1] else nvrtc.getCUBIN(program)
            return {n: nvrtc.getLoweredName(program, n) for n in names}, built
        finally:
            nvrtc.destroyProgram(program)

    def get_function(self, name: str):
        """The kernel `name` (one of the names compiled), loaded on the current device."""
        return self._module.get_function(self._lowered[name])


def _write_atomically(path: str, data: bytes | str):
    part = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
    with open(part, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(part, path)


def module(file: str, ctype: str, index: int = 0) -> CachedModule:
    """One compiled module per (file, element type, group of groups()), compiled (or read from the
    disk cache) and loaded before it is returned: a run compiles only the types it uses.
    Thread-safe; two threads asking for one module compile it once (under the module's lock; the
    first get_function loads it)."""
    key = (file, ctype, index)
    found = _modules.get(key)
    if found is not None:
        return found
    with _modules_lock:
        lock = _compile_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _modules:
            names = list(groups(file, ctype)[index])
            built = CachedModule(source(file), names, options(file))
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
    """Compile (or load from the disk cache) the modules of `files` for element types
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
