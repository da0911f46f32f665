"""cuBLASLt algorithm choices kept on disk between processes (algos.py times them).

A process times the candidate algorithms of a product shape once (algos._choose_algo: the first
shape of each row bucket, and the bucket's shapes that cuBLASLt cannot run with the first one's
algorithm); this file keeps those choices, the shapes' and the buckets', so that the next process
on the same machine starts with them: its first batches skip the trials (about 0.1 s a bucket),
and it runs each shape that an earlier process ran with the same algorithm, so its results are
the same bit for bit from one run to the next.

One JSON file per fingerprint (the GPU's name, compute capability and SMs, cuBLASLt's version,
the workspace and the number of candidates: what cuBLASLt's heuristic and the trial depend on),
in the folder FTENGINE_ALGO_CACHE names, else beside the compiled kernels in CuPy's kernel
cache; FTENGINE_ALGO_CACHE set to an empty value keeps the choices in memory only. A file that
cannot be read as one of ours, or whose fingerprint differs, counts as empty and is replaced on
the next save; a folder that cannot be written is reported once on stderr, and the choices then
stay in memory. Saving re-reads the file and adds to it, and writes a temporary file renamed over
the old one, so that a reader never sees half a file (two processes saving at once may lose one
of their entries: that shape is timed again later).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

from ...errors import say_once

FORMAT = 1
ENV = "FTENGINE_ALGO_CACHE"
_lock = threading.Lock()


def cache_folder(kernel_cache: str) -> Path | None:
    """The folder of the algorithm files: FTENGINE_ALGO_CACHE's, else `kernel_cache` (CuPy's
    kernel cache); None where FTENGINE_ALGO_CACHE is set empty (in memory only)."""
    chosen = os.environ.get(ENV)
    if chosen is None:
        return Path(kernel_cache)
    return Path(chosen).expanduser() if chosen.strip() else None


def key_text(key: tuple) -> str:
    """A plan key (integers and strings) as the file's entry name."""
    return json.dumps([v if isinstance(v, str) else int(v) for v in key], separators=(",", ":"))


class AlgoCache:
    """The algorithm file of one fingerprint (a dict of JSON values) in `folder` (None: none)."""

    def __init__(self, folder: Path | None, fingerprint: dict):
        self.fingerprint = dict(fingerprint, format=FORMAT)
        digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.path = None if folder is None else folder / f"ftengine-cublaslt-{digest}.json"

    def load(self) -> dict:
        """Entry name -> the algorithm's bytes; empty where there is no file of ours."""
        if self.path is None:
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                content = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            say_once(f"ftengine: ignoring the algorithm cache {self.path} ({e}); it is written again")
            return {}
        try:
            if content["fingerprint"] != self.fingerprint:
                raise ValueError("another fingerprint")
            return {name: bytes.fromhex(value) for name, value in content["algorithms"].items()}
        except (AttributeError, KeyError, TypeError, ValueError):
            say_once(f"ftengine: ignoring the algorithm cache {self.path} (not one of ours); it is written again")
            return {}

    def save(self, new: dict):
        """Add entries (name -> bytes) to what the file holds now, and write the file whole."""
        if self.path is None:
            return
        with _lock:
            entries = {k: v.hex() for k, v in self.load().items()}
            entries.update((k, v.hex()) for k, v in new.items())
            temporary = None
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".ftengine-", suffix=".tmp")
                with os.fdopen(handle, "w", encoding="utf-8") as f:
                    json.dump({"fingerprint": self.fingerprint, "algorithms": entries}, f, indent=1, sort_keys=True)
                os.replace(temporary, self.path)
            except OSError as e:
                if temporary is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(temporary)
                say_once(f"ftengine: cannot keep cuBLASLt algorithm choices in {self.path.parent} ({e}); "
                          f"each process times them again (set {ENV} to another folder)")
