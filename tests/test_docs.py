"""The README and docs/ against the code: every command shown exists with every option it uses,
every link resolves, and the op table of docs/gpu-internals.md names each op's real places."""

from __future__ import annotations

import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftengine.backends import numpy_ops
from ftengine.backends.cuda import ops as cuda_ops
from ftengine.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(subcommand, its words) of each `ftengine SUBCOMMAND ...` in the page's shell blocks and
    inline code (continued lines joined, comments and pipes cut off)."""
    found = []
    text = page.read_text()
    inline = re.findall(r"(?<!`)`((?:\S*/)?ftengine [a-z][^`]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in [*shell_blocks(text), *inline]:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("|"):
                part = part.split(" #")[0]
                match = re.search(r"(?:^|\s)(?:\S*/)?ftengine\s+([a-z-]+)(.*)", part)
                if match:
                    found.append((match.group(1), shlex.split(match.group(2).replace("[", "").replace("]", ""))))
    return found


def test_readme_is_a_short_guide():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; its depth belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_option_shown_exists(page):
    runner = CliRunner()
    helps = {}
    shown = commands(page)
    for sub, words in shown:
        if sub not in helps:
            result = runner.invoke(main, [sub, "--help"])
            assert result.exit_code == 0, f"{page.name}: `ftengine {sub}` is not a command: {result.output}"
            helps[sub] = result.output
        for word in words:
            option = word.split("=")[0]
            if option.startswith("-") and option != "-":
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[sub]), \
                    f"{page.name}: `ftengine {sub}` has no option {option}"
    if page.name in ("README.md", "command-line.md"):
        assert shown, f"{page.name} shows no ftengine command"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"[a-z]+:", target):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def kernel_files(fn, seen) -> set[str]:
    """The kernels_cu/ files (and cuBLAS / cuBLASLt) a CUDA launcher reaches, through the routing
    helpers of the launcher modules it calls."""
    if fn in seen:
        return set()
    seen.add(fn)
    source = inspect.getsource(fn)
    found = set(re.findall(r'"(\w+\.cu)"', source))
    if "ctx.lt.matmul" in source:
        found.add("cuBLASLt")
    if ".blas.gemm" in source:
        found.add("cuBLAS")
    module = sys.modules[fn.__module__]
    for name in re.findall(r"(?<![.\w])(_?[a-z]\w*)\(", source):
        called = getattr(module, name, None)
        if (inspect.isfunction(called) and called.__module__.startswith("ftengine.backends.cuda.")
                and not called.__module__.endswith(".runtime")):
            found |= kernel_files(called, seen)
    return found


def op_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "gpu-internals.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (\w+\.py) \| (\w+\.py) \|$", text, flags=re.M)
    return {name: [files, cuda, reference] for name, files, cuda, reference in rows}


def test_op_table_names_each_ops_kernels_launcher_and_twin():
    table = op_table()
    ops = sorted(n for n in set(cuda_ops.__all__) & set(numpy_ops.__all__) - {"prepare_kernels", "prepare_wordpiece"}  # compile only
                 if inspect.isfunction(getattr(cuda_ops, n)) and kernel_files(getattr(cuda_ops, n), set()))
    assert sorted(table) == ops
    for name, (files, cuda, reference) in table.items():
        launcher, twin = getattr(cuda_ops, name), getattr(numpy_ops, name)
        assert launcher.__module__ == f"ftengine.backends.cuda.{cuda[:-3]}", name
        assert twin.__module__ == f"ftengine.backends.reference.{reference[:-3]}", name
        assert set(files.split(", ")) == kernel_files(launcher, set()), name
        for file in files.split(", "):
            assert not file.endswith(".cu") or (ROOT / "kernels_cu" / file).is_file(), file


def test_code_points_to_measurements_that_exist():
    """Each 'measurements: docs/gpu-internals.md, MODULE NAME' comment in the CUDA launchers has
    its section there."""
    headings = set(re.findall(r"^### `(\w+\.py)`: (\w+)", (ROOT / "docs" / "gpu-internals.md").read_text(), re.M))
    pointers = []
    for path in sorted((ROOT / "ftengine" / "backends" / "cuda").glob("*.py")):
        text = re.sub(r"\n\s*#\s*", " ", path.read_text())
        pointers += re.findall(r"docs/gpu-internals\.md, (\w+\.py) (\w+)", text)
    assert pointers
    assert not set(pointers) - headings
