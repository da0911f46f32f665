"""The wgmma attention (attention_sm90.cu, head dim 64) against the designs it was chosen over, in
one run on an sm_90 GPU: the mma.sync kernel it replaces there (varlen_attention_mma; also its
general form, run with a window past every sequence, which the wgmma kernel does not take), and
variants built from its source here: its O += P V step on mma.sync (V fragments by ldmatrix.trans:
the shipped kernel until 2026-11-25, but for the query fragments read each tile) and as a
shared-memory wgmma (P stored in the 128-byte swizzle first), 128-key tiles, 5 blocks an SM. Each is
checked against NumPy (fp16, single sequences of 40 to 300 tokens: one key tile and several; plain
and causal), then timed against torch SDPA on the encoder benchmark's shapes.

Measured on the H100 (2026-11-23): the register-A variant is wrong from the second key tile on
(up to 0.5 abs at 65+ tokens, with a fresh accumulator too) though 10% faster at 64 x 512; the
shared-memory one is right and no faster than the shipped S-on-wgmma, P V-on-mma.sync kernel.

Measured on the H100 (2026-11-25), two more variants, both right (max abs err within the shipped
kernel's), us against shipped (torch SDPA in brackets):
- 128-key tiles (S as two m64n64k16 products per 16 dims, 75 KB of shared memory: 3 blocks an SM):
  64 x 512 210.4 against 190.1 (131.9), 256 x 128 141.7 against 106.1 (71.4), 16 x 2048 663.4
  against 618.6 (438.4); 32 x 128 and shorter unchanged. Slower.
- 5 blocks an SM (__launch_bounds__(128, 5): 96 registers, 8 bytes spilled, against 123 and 4
  blocks): 256 x 128 98.4 against 106.6 (71.8), 32 x 128 causal 13.4 against 14.3, but 64 x 512
  197.2 against 189.4, 16 x 2048 684.2 against 613.4, 1 x 128 4.9 against 4.5, 1 x 512 causal 10.0
  against 8.4; 32 x 128 unchanged. Occupancy helps many short sequences only (0.1 ms of BERT-base
  256 x 128's 12.8 ms), too little for a second instantiation and its routing.
Not run: S of the next key tile issued before this tile's softmax and P V (FA3's overlap within a
warpgroup; two score register sets, the loop unrolled by two, both K/V buffers filled from the
start). ptxas (CUDA 13.0) serialised its wgmma ("C7515 ... non wgmma instructions defining
accumulator registers of a wgmma between start and end of the pipeline stage") whether the next
product was issued conditionally or always; it needs the loop restructured so that no register copy
of either score set falls inside a product's stage.

Measured on the H100 (2026-11-25, later), us:
- --probe, the kernel then shipped (P V on mma.sync) with parts of it taken out (outputs wrong,
  timing only; 4 blocks an SM each), at 64 x 512 / 256 x 128 / 16 x 2048: as shipped 192.5 / 106.6 /
  615.2; without the exp2 (an FMUL instead) 189.3 / 106.4 / 620.5; without S 185.0 / 103.4 / 564.6;
  without the P V products 185.1 / 104.0 / 585.2; without the V ldmatrix 191.5 / 105.8 / 637.4;
  without the K/V copies past tile 0 180.1 / 109.5 / 555.2; without the proxy fence 186.4 / 106.8 /
  608.6; without the loop's barriers 185.7 / 105.6 / 607.7; without S, P V, exp2 and the V ldmatrix
  150.4 / 99.3 / 438.0; without all of these, copies and barriers too, 124.7 / 97.2 / 311.4. No part
  of the loop bounds it alone; and with the whole loop gone, 256 x 128 (two key tiles a block) kept
  91% of its time: a block's fixed part (about 5-6 us a block, fitting time = blocks / (4 x 132) x
  (fixed + tiles x per tile) to the three shapes) was the larger cost there. Its largest piece was
  the query staging, a 16-byte load, add and store at a time (the compiler kept each load behind the
  last store): loading all of a thread's query chunks first, then adding and storing them (what
  attention_varlen.cu stage_queries does now), two runs each, against the kernel before: 64 x 512
  179.9 / 190.8 against 192.6 / 192.1, 256 x 128 83.5 / 86.2 against 107.4 / 106.7, 32 x 128 13.5 /
  13.1 against 15.8 / 16.0, 1 x 128 4.1 / 4.0 against 4.9 / 4.9, 4 x 1,024 causal 40.2 / 39.0
  against 40.3 / 41.2, 16 x 2,048 659.8 / 657.4 against 645.0 / 622.1 (about 3% slower; this shape's
  spread between runs is 5%). The mma.sync kernels (the same helper): plain 256 x 128 94.7 / 97.7
  against 114.6 / 120.9, 32 x 128 14.9 / 15.6 against 18.4 / 18.3; general (a window past every
  sequence, now also asking for 4 blocks an SM, as the plain one does: 128 registers, 16 bytes
  spilled, against 142 registers and 3 blocks without) 256 x 128 103.7 / 101.5 against 120.3 /
  124.9, 64 x 512 287.7 / 281.6 against 288.1 / 315.7, 16 x 2,048 1176.9 / 1209.8 against 1187.5 /
  1191.8. The same staging through cp.async (copies beside tile 0's, the bias added in place once
  they land) was as fast at 256 x 128 but took 132 registers (3 blocks an SM) or, held to 128,
  slowed 16 x 2,048 by 5-12%.
- Two 16-row query tiles a warp (128 queries a block: both tiles' S committed apart, so that the
  first one's softmax runs while the second computes, each V fragment feeding both P V products;
  238 registers, 2 blocks an SM), right at every length, slower but at 16 x 2,048: 64 x 512 207.1
  against 190.8, 256 x 128 106.0 against 86.2, 32 x 128 15.7 against 13.1, 1 x 128 5.7 against
  4.0, 4 x 1,024 causal 41.6 against 39.0, 16 x 2,048 630.8 against 657.4. Not kept.

Measured on the H100 (2026-11-25, last): why the register-A P V was wrong. In its SASS, ptxas gave
P the registers that held the query fragments (the A operands of S's wgmma, loaded once before the
key loop and read by S in every iteration): the S of the second tile on multiplied P by K. Reading
the query fragments from shared memory again at each tile (4 ldmatrix a warp) leaves ptxas nothing
to overwrite: right at every length (max abs err 0.001-0.003 as the mma.sync kernel's; GPU suite
1073 passed) and now the shipped kernel, 106 registers. us, against the mma.sync P V kernel of the
run before (torch SDPA of this run in brackets): 64 x 512 164.3 against 176.0 (130.7: 0.80x),
16 x 2,048 547.5 against 646.6 (449.4: 0.82x), 4 x 1,024 causal 32.3 against 34.5 (28.4: 0.88x),
4 x 512 13.3 against 14.1, 256 x 128 82.0 against 82.1 (71.4: 0.87x), 32 x 128 12.2 against 12.1,
1 x 128 3.9 against 3.7.

Measured on the H100 (2026-11-25, after that), two restructurings of the shipped kernel, both right
(max abs err 0.0039 against NumPy on single and ragged batches of 1 to 520 tokens, plain and causal,
as the shipped kernel's), neither kept; scratch A/B builds in one run, us, shipped first:
- Two warpgroups a block (128 queries sharing each K/V tile, 256 threads, 2 blocks an SM: the same
  four warpgroups an SM, half the K/V copies): 64 x 512 164.8 against 175.6, 256 x 128 82.7 against
  88.4, 16 x 2,048 543.6 against 577.0, 1 x 128 3.9 against 5.1, 4 x 1,024 causal 32.4 against 38.2.
  Slower everywhere, as on the first kernel (2026-11-23): the two warpgroups wait for each other at
  every tile's barrier, and the K/V copies were not what bounds it.
- FA3's overlap within a warpgroup: S of tile j and P V of tile j - 1 issued together, tile j's
  softmax while P V multiplies (the output rescaled once it is done: attention_varlen.cu's softmax
  split into the weights and the rescale), K j + 1 and V j copied during step j into the halves that
  steps j - 1 and j - 2 read (two stages still), tile 0's S and the last P V in steps of their own.
  ptxas (CUDA 13.0) serialised nothing this time (no C7515: no register of a product in flight is
  written before its wait); 122 registers, 4 blocks an SM. 64 x 512 166.0 / 166.2 against 167.8 /
  168.5, 256 x 128 82.3 / 82.5 against 93.3 / 93.3, 16 x 2,048 585.3 / 558.5 against 554.7 / 548.3,
  32 x 128 12.5 / 12.4 against 13.2 / 13.3, 4 x 1,024 causal 32.6 / 32.4 against 32.3 / 32.7 (two
  rounds). No faster but at 16 x 2,048 (within that shape's spread), slower at two key tiles a block
  (the extra step). Four independent warpgroups an SM already overlap one's softmax with another's
  products; what is left is each warpgroup's chain of waits (copies, barrier, S, softmax, P V) with
  only four of them to hide it.
- (2026-11-25, a later session.) A producer warp copying each K/V tile with TMA into a ring of
  mbarrier stages for two consumer warpgroups of 64 queries (128 queries sharing each tile: half the
  L2 reads, no block-wide barrier; the --probe above puts the loop's copies and barriers at about
  SDPA's whole time at 64 x 512). Two such 288-thread blocks an SM (the sixteen consumer warps an SM
  of today's four blocks) get about 85 registers a thread (three of a block's warps share a quarter
  of the register file with three of the other's): ptxas (CUDA 13.0) spilled 48 bytes and
  serialised the wgmmas (C7512). A producer warpgroup with setmaxnreg (384 threads, 24 registers
  for it) does not fit either: the consumers need 112, which two blocks an SM cannot pool (the
  kernel hung at its first setmaxnreg.inc; at 104 ptxas spilled and serialised again). At one block
  an SM (clean build) it matched NumPy (0 failed checks, ragged and causal) but with eight consumer
  warps an SM it ran slower, us, against the shipped kernel (torch SDPA): 64 x 512 216.0 against
  164.0 (131.7), 256 x 128 121.5 against 82.7 (71.3), 16 x 2,048 625.5 against 546.2 (431.6), 32 x
  128 15.3 against 12.4, 1 x 128 5.3 against 4.0, 4 x 1,024 causal 37.4 against 32.6 (two or three
  stages alike). What it would take: more consumer warpgroups a block (three or four, 192-256
  queries sharing each K/V tile, which short sequences would leave idle) or clusters of blocks
  sharing tiles by TMA multicast.
- The kernel at head dim 32 (D = 32: 64-byte rows, wgmma's 64-byte swizzle, P V as m64n32k16), same
  session: 256 x 128 tokens, 12 heads, 51.8 us against 59.9 for the mma.sync kernel (torch SDPA
  52.5); 64 x 512, 24 heads, 215.9 against 271.5 (SDPA 250.2); 16 x 2,048 739.6 against 875.7 (SDPA
  837.8). The patches here are written for head dim 64 (use_patched builds that instantiation alone).

Measured on the H100 (2026-11-26): what the kernel lost to torch SDPA was instructions, not the
designs above: ncu at 64 x 512 counted 90.2 M warp instructions against cuDNN's 56.3 M for the same
floating-point work, about 120 of the loop's 390 a key tile spent on the cp.async copies' and the
query fragments' addresses. The package's attention_sm90.cu varlen_attention_wgmma_tma (one thread
copying each K/V tile by TMA, S from the queries in shared memory) runs 64 x 512 at 0.97x SDPA
(figures there); this script times the cp.async kernel's variants only.

    PYTHONPATH=. python3 bench/experiments/attention_wgmma.py [--out results.json] [--probe]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from ftengine.backends.cuda import families, runtime  # noqa: E402

SHAPES = [(64, 512, False), (256, 128, False), (16, 2048, False), (32, 128, False), (8, 128, False), (1, 128, False),
          (4, 512, False), (1, 512, True), (32, 128, True), (4, 1024, True)]
LENGTHS = (40, 64, 65, 128, 129, 300)

SHIPPED_PV = """        unsigned pa[KN / 16][4];
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk) weight_fragment<T, KN>(pa[kk], s, kk);
        float (&o_flat)[D / 2] = reinterpret_cast<float (&)[D / 2]>(o);
        fence_registers(o_flat);
        fence_registers(pa);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk)
            WgmmaRS<T, D>::template run<1, 1>(o_flat, pa[kk], swizzled_desc<ROW_BYTES>(vs + 16 * ROW_BYTES * kk));
        wgmma_commit();
        wgmma_wait_all();
        fence_registers(o_flat);
"""
# P V on mma.sync, V fragments by ldmatrix.trans from the swizzled rows (the kernel before 2026-11-25)
PV_MMA = """        const int lm = lane >> 3, lr = lane & 7;
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk) {
            unsigned pa[4];
            weight_fragment<T, KN>(pa, s, kk);
            const unsigned row = vs + (kk * 16 + (lm & 1) * 8 + lr) * 128;
            #pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                unsigned vb[4];  // b0, b1 of dims j*8.., then of (j+1)*8..
                ldmatrix_x4_trans(vb, row + (((j + (lm >> 1)) ^ lr) << 4));
                MmaOp<T>::run(o[j], pa, vb[0], vb[1]);
                MmaOp<T>::run(o[j + 1], pa, vb[2], vb[3]);
            }
        }
"""
# a wgmma of 64 x 16 P from shared memory by an MN-major 16 x 64 V tile (trans-b)
PV_WGMMA = """
#define PV_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \\
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PV_OUT(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \\
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \\
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \\
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
__device__ __forceinline__ void pv_ss(float (&d)[32], unsigned long long a, unsigned long long b) {
    asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %34, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " PV_ACC ", %32, %33, p, 1, 1, 0, 1;\\n}\\n"
                 : PV_OUT(d) : "l"(a), "l"(b), "r"(1));
}
"""
PV_SHARED = """        const unsigned pt = tiles + 4 * TILE_BYTES;  // P (64 x 64, K-major, 128-byte swizzle)
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk) {
            unsigned pa[4];
            weight_fragment<T, KN>(pa, s, kk);
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = warp * 16 + (lane >> 2) + (e & 1) * 8, c = 2 * kk + (e >> 1);
                asm volatile("st.shared.u32 [%0], %1;\\n" :: "r"(pt + r * 128 + ((c ^ (r & 7)) << 4) + 4 * (lane & 3)),
                             "r"(pa[e]) : "memory");
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
        __syncthreads();
        float (&o_flat)[32] = reinterpret_cast<float (&)[32]>(o);
        fence_registers(o_flat);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < KN / 16; ++kk)
            pv_ss(o_flat, swizzled_desc<128>(pt + 32 * kk), swizzled_desc<128>(vs + 2048 * kk));
        wgmma_commit();
        wgmma_wait_all();
        fence_registers(o_flat);
"""
KERNEL = "template <typename T, int D>\n__global__ void __launch_bounds__(128) varlen_attention_wgmma("
QS = "T* qs = reinterpret_cast<T*>(smem_raw + (tiles - raw) + 4 * TILE_BYTES);"
SHIPPED_S = """        WgmmaRS<T, KN>::template run<0>(s_flat, qa[0], swizzled_desc<ROW_BYTES>(ks));
        #pragma unroll
        for (int kk = 1; kk < D / 16; ++kk)
            WgmmaRS<T, KN>::template run<1>(s_flat, qa[kk], swizzled_desc<ROW_BYTES>(ks + 32 * kk));
"""
# S for key tiles of a multiple of 64 keys: an m64n64k16 product per 64 keys (K tile rows of 128 bytes:
# keys 64 half.. from 8192 half bytes on), into the score fragments of those keys (s[8 half]..)
S_HALVES = """        #pragma unroll
        for (int half = 0; half < KN / 64; ++half) {
            float (&sh)[32] = reinterpret_cast<float (&)[32]>(s[8 * half]);
            WgmmaRS<T, 64>::template run<0>(sh, qa[0], swizzled_desc<ROW_BYTES>(ks + 8192 * half));
            #pragma unroll
            for (int kk = 1; kk < D / 16; ++kk)
                WgmmaRS<T, 64>::template run<1>(sh, qa[kk], swizzled_desc<ROW_BYTES>(ks + 8192 * half + 32 * kk));
        }
"""
KN_DEFINE = "#define VARLEN_WG_KN 64"
VARIANTS = {  # name -> source patches (None: the mma.sync kernel; GENERAL: its general form)
    "mma.sync kernel": None,
    "mma.sync general kernel (a window past every sequence)": None,
    "shipped": [],
    "P V on mma.sync": [(SHIPPED_PV, PV_MMA)],
    "P V shared wgmma": [(SHIPPED_PV, PV_SHARED), (KERNEL, PV_WGMMA + KERNEL),
                         (QS, QS.replace("4 * TILE_BYTES", "4 * TILE_BYTES + 8192"))],
    "128-key tiles": [(KN_DEFINE, KN_DEFINE.replace("64", "128")), (SHIPPED_S, S_HALVES)],
    # at most 96 registers (123 shipped), so that 5 blocks fit an SM (4 shipped) as their shared memory allows
    "5 blocks an SM": [(KERNEL, KERNEL.replace("__launch_bounds__(128)", "__launch_bounds__(128, 5)"))],
}
EXTRA_SMEM = {"P V shared wgmma": 8192, "128-key tiles": 2 * 2 * 64 * 64 * 2}  # bytes past the shipped kernel's
GENERAL = "mma.sync general kernel (a window past every sequence)"


# --probe: the shipped kernel with parts taken out (timing only: the outputs are wrong), to see what
# each part costs on the critical path
PROBE_SHAPES = [(64, 512, False), (256, 128, False), (16, 2048, False)]
FENCE = 'asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");  // this thread\'s copies, to wgmma'
PARTS = {  # a part of the kernel -> the patches that take it out
    "exp2": [('asm("ex2.approx.ftz.f32 %0, %1;\\n" : "=f"(y) : "f"(x));', "y = x * 0.5f;")],  # an FMUL instead
    "S": [("WgmmaRS<T, KN>::template run<0>(s_flat, qa[0], swizzled_desc<ROW_BYTES>(ks));", ""),
          ("WgmmaRS<T, KN>::template run<1>(s_flat, qa[kk], swizzled_desc<ROW_BYTES>(ks + 32 * kk));", ";")],
    "PV": [("WgmmaRS<T, D>::template run<1, 1>(o_flat, pa[kk], swizzled_desc<ROW_BYTES>(vs + 16 * ROW_BYTES * kk));",
            ";")],
    "copies": [("loader.load(next, k_head, next_row, len, row_stride);", ""),  # K/V copies past tile 0
               ("loader.load(next + tile_bytes, v_head, next_row, len, row_stride);", "")],
    "proxy fence": [(FENCE, "")],
    "barriers": [(FENCE + "\n        __syncthreads();", ""),
                 ("                                                 int row_stride) {\n    __syncthreads();",
                  "                                                 int row_stride) {")],
}
PROBES = [("exp2",), ("S",), ("PV",), ("copies",), ("proxy fence",), ("barriers",), ("S", "PV"), ("S", "PV", "exp2"),
          ("copies", "barriers"), ("S", "PV", "exp2", "copies", "barriers")]


def time_shape(rng, b, s, causal, window=0):
    """GPU ms of varlen_attention on b sequences of s tokens, 12 heads of 64 (random fp16 operands)."""
    from bench.bench_encoder import graph_ms
    from ftengine.backends.cuda import ops as cu
    t = b * s
    qkv = cu.to_device(rng.standard_normal((t, 3 * 768)).astype(np.float32), np.float16)
    bias = cu.to_device(0.1 * rng.standard_normal(3 * 768).astype(np.float32), np.float16)
    seqlens = cu.to_device(np.arange(0, t + 1, s, dtype=np.int32))
    out = cu.empty((t, 768), np.float16)
    return graph_ms(lambda: cu.varlen_attention(out, qkv, bias, seqlens, heads=12, max_seqlen=s, causal=causal,
                                                window=window))


def use_patched(patches, extra_smem=0):
    """From here on, ops builds attention_sm90.cu from its source with `patches` ((old, new) pairs)
    applied and launches it with `extra_smem` more bytes of shared memory a block; the function it
    returns puts the shipped source and launch back."""
    from ftengine.backends.cuda import kernels
    from ftengine.backends.cuda import ops as cu
    shipped_source, shipped_launch = kernels.source, runtime._launch

    def source(file):
        text = shipped_source(file)
        if file == "attention_sm90.cu":
            for old, new in patches:
                assert old in text, old[:60]
                text = text.replace(old, new)
        return text

    def launch(file, name, grid, block, largs, shared_mem=0, cluster=None):
        extra = extra_smem if file == "attention_sm90.cu" else 0
        return shipped_launch(file, name, grid, block, largs, shared_mem=shared_mem + extra, cluster=cluster)

    # the patches are written for head dim 64: the patched module holds that instantiation alone
    shipped_family = families.FAMILIES["attention_sm90.cu"]

    def patched_family(ctype):
        return [name for name in shipped_family(ctype) if name.endswith(", 64>")]

    def install(source, launch, family):  # and drop the module and kernels built from the other source
        kernels.source, runtime._launch = source, launch
        families.FAMILIES["attention_sm90.cu"] = family
        kernels._modules.pop(("attention_sm90.cu", "__half"), None)
        kernels.kernel.cache_clear()
    install(source, launch, patched_family)
    return lambda: install(shipped_source, shipped_launch, shipped_family)


def probe():
    """Times the shipped wgmma kernel with each of PROBES' sets of PARTS taken out, each at 4 blocks an
    SM (8 KB more shared memory a block: a part taken out may free registers for a fifth)."""
    rng = np.random.default_rng(0)
    probes = {"as shipped": []}
    probes.update({"no " + " + ".join(parts): [p for part in parts for p in PARTS[part]] for parts in PROBES})
    for label, patches in probes.items():
        reset = use_patched(patches, 8192)
        row = {f"{b}x{s}": round(1e3 * time_shape(rng, b, s, causal), 1) for b, s, causal in PROBE_SHAPES}
        print(f"{label}: " + ", ".join(f"{k} {v} us" for k, v in row.items()), flush=True)
        reset()


def main():
    import torch
    from ftengine.backends import numpy_ops as ref
    from ftengine.backends.cuda import ops as cu

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--probe", action="store_true", help="time the shipped kernel with parts taken out instead")
    args = parser.parse_args()
    if args.probe:
        return probe()
    ctx = cu.context()
    assert ctx.wgmma, "needs a compute capability 9.0 GPU"
    rng = np.random.default_rng(0)
    results = {}
    for label, patches in ((v, VARIANTS[v]) for v in args.variants):
        reset = use_patched(patches or (), EXTRA_SMEM.get(label, 0))
        ctx.wgmma = patches is not None
        window = 1 << 20 if label == GENERAL else 0
        worst = {}
        for length in LENGTHS:
            for causal in (False, True):
                qkv = cu.to_device(rng.standard_normal((length, 192)).astype(np.float32), np.float16)
                bias = cu.to_device(0.5 * rng.standard_normal(192).astype(np.float32), np.float16)
                seqlens = np.array([0, length], np.int32)
                out = cu.empty((length, 64), np.float16)
                cu.varlen_attention(out, qkv, bias, cu.to_device(seqlens), heads=1, max_seqlen=length, causal=causal,
                                    window=window)
                expected = np.empty((length, 64), np.float32)
                ref.varlen_attention(expected, cu.to_host(qkv), cu.to_host(bias), seqlens, heads=1, max_seqlen=length,
                                     causal=causal, window=window)
                worst[f"{length}{' causal' if causal else ''}"] = round(float(np.abs(cu.to_host(out) - expected).max()), 4)
        row = {"max_abs_err": worst}
        for b, s, causal in SHAPES:
            row[f"{b}x{s}{' causal' if causal else ''} ms"] = time_shape(rng, b, s, causal, window)
        results[label] = row
        print(label, json.dumps(row), flush=True)
        reset()
    ctx.wgmma = True
    sdpa_ms = {}
    for b, s, causal in SHAPES:
        tq, tk, tv = (torch.randn(b, 12, s, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        graph = torch.cuda.CUDAGraph()
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(20):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        graph.replay()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 20)
        key = f"{b}x{s}{' causal' if causal else ''}"
        sdpa = float(np.median(times))
        flops = 4 * b * 12 * s * s * 64 / (2 if causal else 1)
        print(f"{key}: sdpa {sdpa * 1e3:.1f} us ({flops / sdpa / 1e9:.0f} TFLOP/s); "
              + "; ".join(f"{label} {r[key + ' ms'] * 1e3:.1f} us ({sdpa / r[key + ' ms']:.2f}x)"
                          for label, r in results.items()), flush=True)
        sdpa_ms[key + " ms"] = sdpa
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**results, "torch sdpa": sdpa_ms}, f, indent=1)


if __name__ == "__main__":
    main()
