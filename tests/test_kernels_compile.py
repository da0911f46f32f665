"""Every kernels_cu/*.cu compiles with nvcc for sm_80 and sm_90 (the arch-specific ones for their
own target, e.g. sm_90a), every listed template instantiated (CPU only: catches syntax and type
errors without a GPU); common.cuh's erf GELU coefficients meet the accuracy its comment states."""

import importlib.util
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ftengine.backends.cuda.families import FAMILIES, MODULE_KERNELS, SHARED, sections
from ftengine.backends.cuda.kernels import (ARCH_SPECIFIC, CUDA_TYPES, SHARED_KEY, _owner, all_instantiations, groups,
                                            instantiations, source)
from ftengine.backends.cuda import kernel_dir

NVCC = shutil.which("nvcc")


def test_every_cu_file_is_listed():
    assert sorted(p.name for p in kernel_dir().glob("*.cu")) == sorted(FAMILIES)
    assert set(SHARED) <= set(FAMILIES)


def test_every_kernel_lies_in_one_module_of_its_file():
    """groups() splits each file's instantiations into modules of at most MODULE_KERNELS[file]
    kernels (all of them in one where unlisted), in order, each kernel in exactly one, no module
    across two sections (BY_WIDTH's files: one a vector width, widest first), and the launchers'
    lookup (_owner) finds it there."""
    for file in FAMILIES:
        for key in (*CUDA_TYPES.values(), SHARED_KEY):
            names, modules = instantiations(file, key), groups(file, key)
            parts = [names] if key == SHARED_KEY else sections(file, key)
            assert [n for m in modules for n in m] == names == [n for part in parts for n in part]
            size = MODULE_KERNELS.get(file, len(names)) or 1
            assert all(0 < len(m) <= size for m in modules)
            assert len(modules) == sum(-(-len(part) // size) for part in parts)
            assert all(any(set(m) <= set(part) for part in parts) for m in modules)
            for index, m in enumerate(modules):
                assert all(_owner(file, n) == (key, index) for n in m)
    assert len(groups("attention_varlen.cu", "__half")) == len(instantiations("attention_varlen.cu", "__half")) > 1
    assert [len(part) for part in sections("decoder.cu", "__half")] == [15, 9, 9, 9]
    assert all(f", {v}, " in n for v, part in zip((8, 4, 2, 1), sections("gemv.cu", "__half")) for n in part
               if n.startswith("gemv<"))


def test_every_kernel_waits_for_the_kernel_before_it_first():
    """Kernels captured into a graph launch as programmatic dependent launches on sm_90+ (they may
    start while the kernel before them runs): each must call wait_for_previous() (or
    wait_then_launch_next(), which calls it first) before anything else."""
    kernels = 0
    for path in sorted(kernel_dir().glob("*.cu")):
        text = path.read_text()
        for match in re.finditer(r"__global__([^{]*)\{", text):
            signature = re.sub(r"__launch_bounds__\([^)]*\)", "", match.group(1))
            name = re.search(r"(\w+)\s*\(", signature).group(1)
            body = text[match.end():].lstrip()
            assert body.startswith(("wait_for_previous();", "wait_then_launch_next();")), f"{path.name}: {name}"
            kernels += 1
    assert kernels >= 36


def test_threads_asking_for_one_module_compile_it_once_and_get_it_loaded(monkeypatch):
    """kernels.module under eight threads at once: one module built (compiled or read from the
    cache) once, and loaded (its first get_function) before any thread gets it. Stands in for
    CachedModule, so that this runs without a GPU."""
    from ftengine.backends.cuda import kernels
    built = []

    class CachedModule:
        def __init__(self, code, names, options):
            time.sleep(0.05)  # a compile: threads that found no module would each compile it
            self.names, self.arch, self.loaded = names, options[-1], 0
            built.append(self)

        def get_function(self, name):
            self.loaded += 1
            return name

    monkeypatch.setattr(kernels, "CachedModule", CachedModule)
    monkeypatch.setattr(kernels, "options", lambda file: ("--std=c++17", "--gpu-architecture=sm_90"))
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_compile_locks", {})
    start = threading.Barrier(8)

    def ask():
        start.wait()
        found = kernels.module("pooling.cu", "__half", 0)
        return found, found.loaded

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: ask(), range(8)))
    assert len(built) == 1 and built[0].loaded == 1
    assert all(m is built[0] and loaded == 1 for m, loaded in got)
    assert built[0].names == list(groups("pooling.cu", "__half")[0]) and built[0].arch == "--gpu-architecture=sm_90"


@pytest.mark.parametrize("rows, widths", [((768, 64, 3072), (8,)), ((768, 64, 3070), (8, 2)), ((36, 12, 144), (8, 4)),
                                           (None, (8, 4, 2, 1))])
def test_a_runner_prepares_the_vector_widths_of_its_rows_only(monkeypatch, rows, widths):
    """prepare_kernels(rows=) compiles, of the files whose kernels take a vector width, the modules
    of the widths rows of those lengths are read in (runtime._vec: the widest that divides) and of
    the widest (which holds the kernels without a width): all of those kernels, nothing else."""
    from ftengine.backends.cuda import families, kernels
    from ftengine.models.gpt2 import KERNEL_FILES
    asked = []
    monkeypatch.setattr(families, "runs_wgmma", lambda: False)
    monkeypatch.setattr(families, "prepare", lambda files, types, only: asked.extend(kernels.modules_of(files, types, only=only)))
    families.prepare_kernels(KERNEL_FILES + ("embedding.cu", "layernorm.cu", "attention.cu"), "fp16", head_dims=(64,),
                             rows=rows)
    for file, width_kernels in families.BY_WIDTH.items():
        wanted = {n for v in widths for n in width_kernels("__half", v)}
        got = {n for f, key, index in asked if f == file and key == "__half" for n in kernels.groups(f, key)[index]}
        assert got == wanted, file
    shared = {(f, SHARED_KEY, 0) for f in ("sampling.cu", "activation.cu", "prefetch.cu")}
    assert shared | {("convert.cu", "__half", 0)} <= set(asked)


@pytest.mark.parametrize("dtype, norm_product, wanted", [
    ("fp16", (512, True), ["gemv_norm<__half, __half, 1, __half, 8, 2, 2, 1>", "gemv_norm<__half, float, 2, __half, 8, 4, 2, 1>"]),
    ("fp32", (200, False), ["gemv_norm<float, float, 1, float, 4, 2, 2, 0>", "gemv_norm<float, float, 1, float, 4, 4, 2, 0>"]),
    ("fp16", (1024, False), []), (None, None, [])])
def test_a_runner_prepares_the_norm_products_of_its_rows_only(monkeypatch, dtype, norm_product, wanted):
    """prepare_kernels(norm_product=(row length, post)) compiles the gemv_norm kernels norm_matmul
    launches for rows of that length and that LayerNorm placement (each product form and column
    group), nothing else of gemv_norm.cu; none for rows longer than gemv_norm takes, or without it."""
    from ftengine.backends.cuda import families, kernels
    asked = []
    monkeypatch.setattr(families, "runs_wgmma", lambda: False)
    monkeypatch.setattr(families, "prepare", lambda files, types, only: asked.extend(kernels.modules_of(files, types, only=only)))
    families.prepare_kernels(("gemv.cu",), dtype or "fp16", head_dims=(64,), norm_product=norm_product)
    got = {n for f, key, index in asked if f == "gemv_norm.cu" for n in kernels.groups(f, key)[index]}
    assert set(wanted) <= got and len(got) == (6 if dtype == "fp16" and wanted else 2 if wanted else 0)
    assert all(n.endswith(f", {int(norm_product[1])}>") for n in got)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("file", sorted(FAMILIES))
def test_compiles_for_sm80_and_sm90(tmp_path, file):
    names = all_instantiations(file)
    unit = tmp_path / file
    unit.write_text(source(file) + "\nvoid* const* ftengine_instantiate_all() {\n    static void* kernels[] = {\n"
                    + "".join(f"        (void*)&{n},\n" for n in names) + "    };\n    return kernels;\n}\n")
    targets = [ARCH_SPECIFIC[file][0][3:]] if file in ARCH_SPECIFIC else ["80", "90"]
    proc = subprocess.run(
        [NVCC, "-std=c++17", "-c", str(unit), "-o", str(tmp_path / "out.o"),
         *(a for t in targets for a in ("-gencode", f"arch=compute_{t},code=sm_{t}")), "-Werror", "all-warnings"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_erf_gelu_coefficients_meet_their_bounds():
    """common.cuh's erf GELU (a fitted 2^q(z) for erfc), evaluated as the kernel does, against the
    exact GELU (math.erfc): the bounds its comment states (bench/experiments/gelu_fit.py, CPU only)."""
    spec = importlib.util.spec_from_file_location("gelu_fit", Path(__file__).resolve().parents[1] / "bench" / "experiments" / "gelu_fit.py")
    gelu_fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gelu_fit)
    assert gelu_fit.check(gelu_fit.shipped()) == 0
