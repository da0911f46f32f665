"""An experiment, not used by the package: GPT-2's whole decode step (embedding, every layer, the
LM head) in one cooperative kernel (bench/experiments/decode_step.cu), checked against the
layer-by-layer decode and the NumPy reference, then timed against the layer-by-layer decode's
step graph.

Design: one block per SM, grid barriers (a growing counter) between the five dependent parts of a
layer; each block keeps the residual stream in shared memory and computes the LayerNorms itself;
the products are split by output columns, each block's weight slices streamed ahead into a ring
of shared-memory buffers (the tensor memory accelerator on sm_90) while it waits at barriers.

Measured on the H100 (2026-11-24, GPT-2 small shapes, fp16, cache position 32, us per step):
every check passes (errors against NumPy fp32 equal to the layer-by-layer decode's, at 1-4 rows,
fp16 and bf16, and three threads decoding at once give the results of one), but the step is
slower than the layer-by-layer graph it would replace:

    version                                              batch 1   batch 4
    layer-by-layer decode (the package)                   278.6     346.7
    first version (cp.async ring, warp-per-row LN)        489.0     602.4
    + the layer's small parameters in shared memory       496.0
    + the tensor memory accelerator for the ring          585.6     691.0
    + no divisions on the path, LN over all warps,
      two products a warp in flight (this file)           384.2     513.3
    this file's own timing, a later run                   383.0     514.0   (layer by layer 309.6, 374.7)
    the products through one helper (no change meant)     398.1     529.3   (layer by layer 301.8, 372.7)

A globaltimer trace of the first version (per block, at each barrier): a barrier costs 0.8 us from
the last arrival, but the parts between barriers take 2-9 us each on the critical path (attention
5.8 on the 12 busy blocks, the fc part 7.9, the q/k/v part 8.6), where a kernel of the
layer-by-layer decode takes about 3.4 us; the LM head streamed at about 1.3 TB/s (3.7 us a 24-column
chunk). The ring's depth (2-4 buffers) changed nothing. The same trace of this file's version
(batch 1, median over layers, critical path from the first block leaving a barrier to the last one
arriving at the next): attention 5.7 us, output projection 2.0, LayerNorm + fc 5.4, proj 4.0,
LayerNorm + q/k/v 5.2, and 0.8 us a barrier: 26 us a layer against about 21 for the layer-by-layer
kernels. Without the barrier's fence (unsafe, measured only) 358 us: the fence is 0.5 us of each
barrier; cp.async instead of the tensor memory accelerator 399 us; the bulk copies issued by
another thread than the barrier's, no change. So even the cheapest part (stage the attention
output from L2, 6 columns' products, store, barrier) costs 2 us: five dependent parts a layer put
the floor of this design near 10 us a layer (120 us a step before the LM head). To get there:
the attention's last combine over 32 key groups (a serial loop) and its cache reads ahead of the
barrier, the LayerNorm + product parts' latency (now 3 us over the cheapest part), the LM head
streamed at full bandwidth (it reaches about 1.3 TB/s through the ring).

    PYTHONPATH=. python3 bench/experiments/decode_step.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from ftengine.backends.cuda import activation, runtime  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEP_ROWS, STEP_THREADS, STEP_WARPS, STEP_SLOTS, STEP_RING_MAX, STEP_MAX_WIDTH = 4, 256, 8, 14, 4, 2048
NAMES = ("ln1_gamma", "ln1_beta", "qkv_weight", "qkv_bias", "attn_out_weight", "attn_out_bias", "ln2_gamma",
         "ln2_beta", "fc_weight", "fc_bias", "proj_weight", "proj_bias")


def module():
    import cupy
    from ftengine.backends.cuda import kernel_dir
    from ftengine.backends.cuda.kernels import compile_options
    folder = kernel_dir()
    code = "\n".join([*((folder / f).read_text() for f in ("common.cuh", "decoder.cu")),
                      (Path(__file__).resolve().parent / "decode_step.cu").read_text()])
    return cupy.RawModule(code=code, options=compile_options(),
                          name_expressions=["decode_step<__half>", "decode_step<__nv_bfloat16>"])


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def plan(runner):
    """The kernel's launch plan for a layer-by-layer GPT2Runner's weights, caches and workspace."""
    from ftengine.backends.cuda import ops
    ctx, c = ops.context(), runner.config
    e, inner, v, d, sv = c.n_embd, c.n_inner, c.vocab_size, c.head_dim, 8
    assert e % sv == 0 and inner % sv == 0 and d % sv == 0 and d // sv <= 32 and e <= STEP_MAX_WIDTH
    g = ctx.sm_count
    products = ((3 * e, e), (e, e), (inner, e), (e, inner))
    slice_ = max(-(-n // g) * k for n, k in products)
    lm_chunk = slice_ // e
    per_key = 1 << max(0, (d // sv - 1).bit_length())
    most_cols = max(lm_chunk, *(-(-n // g) for n, _ in products))
    x_offset = _align16(STEP_ROWS * e * 4)
    red_offset = x_offset + _align16(max(STEP_ROWS * max(e, inner) * 2, STEP_THREADS // 32 * (d + 2) * 4))
    params_offset = red_offset + _align16(STEP_ROWS * max(STEP_WARPS, most_cols) * 4)
    params_size = 9 * e + -(-(-(-inner // g) + sv - 1) // sv) * sv
    ring_offset = params_offset + 2 * params_size * 2
    fits = (ctx.shared_mem_optin - 256 - ring_offset) // (slice_ * 2)
    nbuf = next(n for n in (STEP_RING_MAX, 2) if n <= fits)
    table = np.array([[w[n].data.ptr for n in NAMES] + [k.data.ptr, vc.data.ptr]
                      for w, (k, vc) in zip(runner.layers, [runner._caches(i) for i in range(c.n_layer)])], np.uint64)
    barrier = ops.to_device(np.zeros(1, np.uint64))
    return dict(table=ops.to_device(table), barrier=barrier, grid=g, slice=slice_, nbuf=nbuf, lm_chunk=lm_chunk,
                per_key=per_key, x_offset=x_offset, red_offset=red_offset, params_offset=params_offset,
                params_size=params_size, ring_offset=ring_offset, shared_mem=ring_offset + nbuf * slice_ * 2)


def launch(mod, runner, p, b: int):
    """One step of b rows from the runner's next_ids / next_pos, logits into its workspace."""
    from ftengine.backends.cuda import ops
    from ftengine.backends.cuda.launch import launch_ex
    c, ws = runner.config, runner.ws
    e = c.n_embd
    k = mod.get_function(f"decode_step<{runtime._ctype(runner.wte)}>")
    if k.max_dynamic_shared_size_bytes < p["shared_mem"]:
        k.max_dynamic_shared_size_bytes = p["shared_mem"]
    ids, pos = ws.view("next_ids", (b,)), ws.view("next_pos", (b,))
    args = (ws.view("logits", (b, c.vocab_size)), ws.view("qkv", (b, 3 * e)), ws.view("ctx", (b, e)),
            ws.view("proj", (b, e)), ws.view("inter", (b, c.n_inner)), p["barrier"], p["table"], runner.wte,
            runner.wpe, *runner.ln_f, runner.lm_head, ids, pos, pos, np.int32(5), np.int32(b), np.int32(c.n_layer),
            np.int32(c.n_head), np.int32(e), np.int32(c.n_inner), np.int32(c.vocab_size), np.int32(runner.max_len),
            np.int32(p["per_key"]), np.int32(p["slice"]), np.int32(p["nbuf"]), np.int32(p["lm_chunk"]),
            np.int32(p["x_offset"]), np.int32(p["red_offset"]), np.int32(p["params_offset"]),
            np.int32(p["params_size"]), np.int32(p["ring_offset"]), np.float32(c.layer_norm_epsilon),
            np.int32(activation._gelu_form(c.gelu)), np.float32(1.0 / np.sqrt(c.head_dim)))
    launch_ex(k, (p["grid"],), (STEP_THREADS,), args, p["shared_mem"], ops.context().stream.ptr,
              dependent=ops.context().stream.is_capturing(), cooperative=True)


def _checkpoint(folder: Path, **config_args) -> Path:
    from safetensors.numpy import save_file
    from weights.fixtures import gpt2_config, random_gpt2_tensors
    folder.mkdir(parents=True, exist_ok=True)
    config = gpt2_config(**config_args)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(random_gpt2_tensors(config, seed=3), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _runner(path, ops, dtype, b):
    from ftengine.checkpoint import load_gpt2_weights
    from ftengine.config import load_gpt2_config
    from ftengine.models.gpt2 import GPT2Runner
    config = load_gpt2_config(path)
    return GPT2Runner(config, load_gpt2_weights(path, config), ops, dtype=dtype, max_batch=b,
                      max_len=config.n_positions)


def _steps(runner, prompts, steps, step=None):
    """Logits (steps, rows, V) of steps decode steps after the prompts (random tokens, seed 5), each
    by runner.decode or by step(runner, rows) after the same uploads."""
    runner.prefill(prompts)
    rng = np.random.default_rng(5)
    pos = np.array([len(p) for p in prompts])
    out = []
    for s in range(steps):
        tokens = rng.integers(0, runner.config.vocab_size - 1, len(prompts))
        if step is None:
            runner.decode(tokens, pos + s)
        else:
            runner._upload("next_ids", tokens)
            runner._upload("next_pos", pos + s)
            step(runner, len(prompts))
        out.append(runner.logits(len(prompts)))
    return np.stack(out)


def _error(a, reference) -> float:
    return float(np.abs(a - reference).max() / max(1.0, np.abs(reference).max()))


def check(mod, root: Path):
    """The kernel's logits against the layer-by-layer decode's, both against NumPy fp32: 1-4 rows,
    fp16 and bf16, a small GPT-2 and one of GPT-2 small's widths (the LM head in many chunks); then
    three threads at once."""
    from ftengine.backends import numpy_ops as ref
    from ftengine.backends.cuda import ops as cu
    from tests.tolerances import LOWP_ERROR_FACTOR
    models = {"small": _checkpoint(root / "small", n_embd=256, n_layer=4, n_head=4, n_positions=256),
              "wide": _checkpoint(root / "wide", n_embd=768, n_layer=2, n_head=12, n_positions=256,
                                  vocab_size=50257)}
    for name, path in models.items():
        for rows in (1, 2, 3, 4):
            rng = np.random.default_rng(rows)
            prompts = [rng.integers(0, 256, n).tolist() for n in (5, 17, 3, 40)[:rows]]
            expected = _steps(_runner(path, ref, "fp32", rows), prompts, 3)
            for dtype in ("fp16", "bf16"):
                runner = _runner(path, cu, dtype, rows)
                p = plan(runner)
                ours = _steps(runner, prompts, 3, lambda r, b: launch(mod, r, p, b))
                layered = _steps(_runner(path, cu, dtype, rows), prompts, 3)
                e_ours, e_layered = _error(ours, expected), _error(layered, expected)
                print(f"{name} rows {rows} {dtype}: error {e_ours:.2e}, layer by layer {e_layered:.2e}", flush=True)
                assert e_ours <= LOWP_ERROR_FACTOR * e_layered, (name, rows, dtype)
    path = models["wide"]
    prompts = [[5, 6, 7, 8, 9], list(range(10, 27))]

    def run():
        runner = _runner(path, cu, "fp16", 2)
        p = plan(runner)
        return _steps(runner, prompts, 40, lambda r, b: launch(mod, r, p, b))
    alone, results = run(), {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run())) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and all((results[i] == alone).all() for i in range(3))
    print("three threads at once: the results of one", flush=True)


def timing(mod, root: Path):
    """us per step at cache position 32, GPT-2 small's shapes in fp16, graph replay: the kernel and
    the layer-by-layer decode's step graph."""
    from ftengine.backends.cuda import ops as cu
    path = _checkpoint(root / "gpt2-small", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
    stream = cu.context().stream
    for b in (1, 4):
        runner = _runner(path, cu, "fp16", b)
        runner.prefill([list(range(1, 33))] * b)
        runner.decode(np.ones(b), np.full(b, 32))  # captures the layer-by-layer step
        p = plan(runner)
        launch(mod, runner, p, b)
        stream.begin_capture()
        for _ in range(20):
            launch(mod, runner, p, b)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        figures = {}
        for name, replay in (("one kernel", lambda: [graph.launch(stream=stream) for _ in range(10)]),
                             ("layer by layer", lambda: [runner.graphs.run(("decode", b), None) for _ in range(200)])):
            replay()
            timer = cu.DeviceTimer()
            replay()
            timer.stop()
            figures[name] = timer.seconds() / 200 * 1e6
        print(f"batch {b}: " + ", ".join(f"{k} {v:.1f} us" for k, v in figures.items()), flush=True)


def main():
    mod = module()
    with tempfile.TemporaryDirectory() as tmp:
        check(mod, Path(tmp))
        timing(mod, Path(tmp))


if __name__ == "__main__":
    main()
