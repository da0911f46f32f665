"""The wgmma product with the bias + GELU epilogue fused (sm_90a: TMA loads by a producer warp, two
consumer warpgroups): the package's kernels_cu/gemm_sm90.cu matmul_wgmma (candidate PRODUCT, which
ops.matmul_bias_gelu takes for the erf form on large batches) beside the experiments it grew from
(bench/experiments/gemm_sm90.cu), checked and timed against cuBLASLt.

Every candidate (gemm_wgmma's 128-column wgmma tiles NI, stages, blocks per SM; PRODUCT; ("pp",
stages): gemm_wgmma_pingpong) is first checked against NumPy (float64) on shapes that are not
multiples of its tiles (rows, columns and K tails), plain and with bias + GELU in both forms, fp16
and bf16, outputs poisoned; then timed on the encoders' products against cuBLASLt (its algorithm
timed once per shape, as ops.matmul chooses it), followed by the bias + GELU pass for the FFN
up-projection.

Measured on the H100 (2026-11-23), the non-persistent kernel: every check passes, but no candidate
beats cuBLASLt + the pass:
BERT-base's up-projection at 32,768 rows 547 us against 382 (product 215 + pass 167); a plain
3072 -> 768 product 252 against 225 us; K = 768 products about 400 TFLOP/s against cuBLASLt's 700.
Non-persistent tiles pay the pipeline's fill and the epilogue per tile (about 0.77 of a K = 768
main loop), and the GELU epilogue is not overlapped with other tiles' products. What would be
needed: a persistent kernel whose producer fills the next tile while the consumers finish one,
epilogues ping-ponged between the consumer warpgroups, larger tiles or TMA multicast.

Measured on the H100 (2026-11-24), after three changes: the persistent kernel (candidates ("p",
stages, cluster): gemm_wgmma_persistent, 128 x 256 tiles, one m64n256k16 accumulator per consumer
warpgroup, the producer running ahead across tiles; cluster 2: pairs of blocks share each weight
tile by TMA multicast), an epilogue in straight-line code reading the bias from shared memory
(it had loaded the bias behind a branch per fragment, which serialised the fragments), and
common.cuh's erf GELU on rcp.approx (its __frcp_rn slow path had serialised every GELU; the
package's bias + GELU pass gained too). Every check passes. BERT-base's up-projection at 32,768
rows, bias + erf GELU fused: ("p", 4, 1) 371 us, ("p", 4, 2) 388, (1, 3, 2) 431, against 346 for
cuBLASLt (204) + the pass (142): 0.93x; at 4,096 rows 51.7 against 45.9; all-MiniLM-L6-v2's
384 -> 1,536 at 32,768 rows 150 against 132. (Before the epilogue and GELU changes the fused
products took 750-950 us.) What is left is the main loop: a plain 32,768 x 2,304 x 768 product
runs 273-281 us (about 420 TFLOP/s) in every candidate, multicast or not, against cuBLASLt's 153-157
(about 750). ncu on ("p", 4, 1) there: compute (SM) throughput 48%, L2 65%, L1 54%; stalls: short
scoreboard 23% (the consumers polling their full barriers), named barriers 23%, wait 13%: the
consumers wait for data. cuBLASLt runs nvjet_sm90_hsh_192x192_64x4_2x1_v_bz_coopB_TNN there
(192 x 192 tiles, K steps of 64, 4 stages, 2 x 1 clusters, 384 threads, 168 registers, 213 KB of
shared memory) at 78% compute throughput. Variants of ("p", 4, 1) built by a scratch script
(32,768 x 2,304 x 768, plain; cuBLASLt 157 us): as is 278 us; the copies alone (no products) 249;
the products alone (the producer arriving without copying) 233; with ("p", 4, 2) 263 / 232 / 248.
So neither half keeps up on its own: the copies of 128 x 256 tiles take about 200 us (the
multicast saves a little), and the products, about 165 us at the tensor cores' rate, come with an
epilogue that no product overlaps (its stores alone, 151 MB, about 50 us). What would be needed:
the epilogue overlapped with the next tile's products (one consumer warpgroup's epilogue while
the other multiplies, or TMA stores from shared memory), and tiles that load less per product
(cuBLASLt's 192 x 192 in 2 x 1 clusters). A main loop at cuBLASLt's speed would make the fused
product about 230 us (the epilogue's share measured here: 371 - 358 for the plain 3,072-column
product), a third less than cuBLASLt + the pass.

Measured on the H100 (2026-11-25), ncu on the plain 32,768 x 2,304 x 768 product (clocks locked by
ncu, one launch each): cuBLASLt (nvjet 192 x 192, 2 x 1 clusters) 210.6 us, L2 reads by the SMs 834
MB, 1.21 GB delivered to the SMs, 56 MB from DRAM, tensor pipes active 78% of the time; ("p", 4, 1)
314.6 us, 1.27 GB, 1.36 GB, 55 MB, 48.7%; ("p", 4, 2) 316.7 us, 909 MB, 1.36 GB, 55 MB, 47.6%. So
the multicast pair reads the L2 about as little as cuBLASLt does and is no faster: the copies' volume
is not what holds the main loop back (the "copies alone" figures above measure the ring's pacing, not
the L2's rate); the consumers leave the tensor pipes idle half the time. Next to look at: how far
ahead the producer can run (a stage is released only after the next K step's products, so about two
of the four stages are in flight), the epilogue's 4-byte stores, and the named-barrier stalls.

Measured on the H100 (2026-11-25), the epilogue through shared memory and TMA stores (candidates
("ps", STAGES, CLUSTER), 3 stages to leave room for the two 32 KB result buffers; a plain twin
where out's rows are not 16-byte multiples): every check passes. Plain products: 32,768 x 2,304 x
768 205.1 us against 269.6-283.3 for the "p" candidates (cuBLASLt 157.1: 0.77x, from 0.58x);
32,768 x 768 x 768 70.5 against 93.9 (cuBLASLt 58.2: 0.83x); 32,768 x 768 x 3,072 252.0 against
243.9 ((p, 4, 1): there the epilogue is a smaller share than the fourth stage). Fused bias + erf
GELU: 32,768 x 3,072 x 768 379.2-383.2 against 379.5 for ("p", 4, 1) and 349.7 for cuBLASLt + the
pass (0.92x); all-MiniLM-L6-v2's 32,768 x 1,536 x 384 137.4 against 132.5 (0.96x); 4,096 x 3,072 x
768 50.2 against 45.7. The GELU now costs the fused product about 110 us at 32,768 x 3,072 (the
pass: 142), which no product overlaps. On the way: shared-memory writes as asm volatile stores kept
the compiler from overlapping the fragments' work (plain 253 us against 205 with plain C++
stores); and with the plain twin's store path compiled into the same kernel (each path 128
unrolled GELUs in both forms) the fused product took 463-477 us: the kernel's code outgrew the
instruction cache. Next: the GELU form as a template parameter (half the epilogue's code again),
and each consumer warpgroup on a tile of its own, so that one's epilogue (its results leaving by
TMA) runs while the other multiplies.

Measured on the H100 (2026-11-25, the same day), the epilogue a template parameter (candidates
("ps", STAGES, CLUSTER, "e"): a kernel per epilogue, the erf GELU form's 50 KB of code against 104
KB for the kernel that takes any): every check passes, and the fused bias + erf GELU product now
beats cuBLASLt + the pass from 4,096 rows at BERT-base's widths, us:

    product (rows x N x K), bias + erf GELU   cuBLASLt + pass   ("ps", 3, 1, "e")   ("ps", 3, 2, "e")
    32,768 x 3,072 x 768                        350.4             316.8               314.6  (1.11x)
    4,096 x 3,072 x 768                          45.1              40.8  (1.10x)       42.7
    1,024 x 3,072 x 768                          13.5              15.4  (0.87x)       16.7
    512 x 3,072 x 768                             8.6              14.5                15.9
    32,768 x 1,536 x 384 (all-MiniLM-L6-v2)     133.0             103.8  (1.28x)      106.4
    4,096 x 1,536 x 384                          17.2              19.2  (0.89x)       20.3

Plain products, against cuBLASLt: 32,768 x 2,304 x 768 193.0 against 159.4 (0.83x), 32,768 x 768 x
768 64.9 against 59.0 (0.91x), 32,768 x 768 x 3,072 245.6 against 211.5 (0.86x). The package
takes ("ps", 3, 1, "e") as kernels_cu/gemm_sm90.cu matmul_wgmma (without the cluster, runtime
epilogue and plain-store paths of the experiment: candidate PRODUCT here), which
ops.matmul_bias_gelu runs for the erf form from gemm.WGMMA_GELU_MIN_OUTPUTS outputs on (the
tile count of 4,096 x 3,072): expected about 0.4 ms off BERT-base 256 x 128's 13.3 ms and 0.17 off
all-MiniLM-L6-v2's 2.5.

Measured on the H100 (2026-11-25), the package's kernel (PRODUCT) after its move: every check
passes (0 failed), us against cuBLASLt + the pass: 32,768 x 3,072 x 768 306.9 against 349.5
(1.14x); 8,192 rows 81.4 against 90.6 (1.11x); 4,096 rows 41.8 against 46.5; 1,024 rows 15.5
against 13.7 (0.88x); all-MiniLM-L6-v2's 32,768 x 1,536 x 384 105.4 against 132.8 (1.26x), 8,192
rows 28.9 against 30.3 (1.05x: as many outputs as 4,096 x 3,072, the threshold), 4,096 rows 19.9
against 17.5. In bench/bench_encoder.py the same day: BERT-base fp16 256 x 128 13.29 -> 12.77 ms
end to end, 64 x 512 14.96 -> 14.34; all-MiniLM-L6-v2's 256 x 128 pass on the GPU 2.52 -> 2.28 ms.

Measured on the H100 (2026-11-25, the same day), ping-pong (candidate ("pp", 4):
bench/experiments/gemm_sm90.cu gemm_wgmma_pingpong, each consumer warpgroup on a 128 x 128 tile of its own, two
m64n128k16 accumulators, so that one's bias + GELU epilogue runs while the other multiplies; the
warpgroups take the ring's stages in tile order through a `done` mbarrier each): every check
passes, but it is no faster than PRODUCT, us (PRODUCT, ping-pong, cuBLASLt + pass): bias + erf GELU
32,768 x 3,072 x 768 304.6, 317.8, 348.0; 8,192 rows 79.0, 77.1, 89.7; 4,096 rows 41.5, 40.7, 45.5;
MiniLM 32,768 x 1,536 x 384 107.1, 103.9, 132.2; 8,192 rows 28.1, 29.3, 30.5. Plain 32,768 x 2,304 x
768 184.0, 197.2 (cuBLASLt 157.7). So hiding the epilogue behind the other warpgroup's products
gains at most 3%, and the 128 x 128 tiles' main loop loses about as much: what separates PRODUCT
from cuBLASLt is its main loop (cuBLASLt's 192 x 192 tiles, 2 x 1 clusters), not the epilogue.
A second run at the final tree (same day, same figures in that order): 32,768 x 3,072 x 768 302.0,
295.1, 347.1 (ping-pong ahead this time: its figure there moves by 7% between runs); 8,192 rows
79.5, 77.3, 90.0; MiniLM 32,768 rows 107.3, 103.1, 132.0; 4,096 x 1,536 x 384 19.7, 17.7, 17.5. So
ping-pong is 2-4% ahead on most shapes, 10% at 4,096 x 1,536, within noise at BERT-base's 32,768
rows: not enough yet to replace PRODUCT (a second kernel in the package, its tests and routing).

Measured on the H100 (2026-11-25, the same day), the package's kernel with narrower tiles for short
batches (NARROW: ("tma", STAGES, BN), BN 128 or 64 columns; --small times them on SMALL alone):
every check passes. Bias + erf GELU, us, cuBLASLt + the pass against (256, 3 stages), (128, 4),
(64, 4), (128, 5), (64, 8):

    rows x N x K            cuBLASLt + pass   256    128/4   64/4   128/5   64/8
    16 x 3,072 x 768           5.7            13.5    7.9    6.6     8.5    6.5
    128 x 3,072 x 768          6.8            14.2    8.2    6.4     8.7    6.4
    256 x 3,072 x 768          7.0            14.3    8.2    6.6     8.8    6.6
    512 x 3,072 x 768          8.6            14.6    8.8   11.8     9.3   11.6
    1,024 x 3,072 x 768       13.4            15.3   15.7   16.9    16.3   16.6
    2,048 x 3,072 x 768       22.9            27.2   22.8   31.7    23.4   31.1
    16 x 1,536 x 384           4.8             9.4    5.7    4.6     5.9    4.5
    128 x 1,536 x 384          5.0            10.1    6.1    4.7     6.3    4.7
    512 x 1,536 x 384          5.7            10.4    6.3    4.9     6.5    5.0
    1,024 x 1,536 x 384        7.1            10.7    6.7    8.3     6.9    8.4
    2,048 x 1,536 x 384       10.6            11.4   10.9   11.6    11.4   11.6

(4,096 x 1,536 x 384 in the full run: 128/4 15.7 against 17.3.) A tile's time hardly depends on
its rows (16 or 256) or on the ring's depth: it is set by its K steps, about 0.33 us each for a 128
x 64 tile, and by a fixed 2.5 us or so (launch, the first copies, the epilogue's stores). So at
BERT-base's K = 768 the narrow tiles do not beat cuBLASLt's product + the pass, and at
all-MiniLM-L6-v2's K = 384 they do by 5-16% (ops.py takes them there: gemm.WGMMA_NARROW_MAX_K).
What would be needed at K = 768: fewer bytes a K step per SM (the x tile multicast over a cluster of
the blocks that share it, or 64-row tiles for short batches) or split K with the epilogue after the
partial sums.

Measured on the H100 (2026-11-25, the same day), the kernel splitting K between its two consumer
warpgroups where M <= 64 (each on the tile's 64 rows, even and odd K steps, warpgroup 1's sums added
to 0's through shared memory; before, the second warpgroup multiplied rows of zeros): every check
passes. Us, cuBLASLt + the pass against (64, 4), (64, 8): BERT-base's 16 x 3,072 x 768 5.7 against
6.5, 5.3; 64 rows 6.0 against 6.3, 5.3; all-MiniLM-L6-v2's 16 x 1,536 x 384 4.8 against 4.1, 3.8;
64 rows 4.8 against 4.1, 3.9. Past 64 rows the figures are those above. So with the split, the
deeper ring pays (gemm.WGMMA_TILES gives the 64-column tile 8 stages) and 64 rows or fewer take
the narrow tile at any K. Tried on top and not kept (a scratch A/B in one run, same bits): the
producer prefetching both tensor maps' descriptors after its wait, and the last stores waited for
reading only (`cp.async.bulk.wait_group.read`): 5.38 against 5.45 us at 16-64 x 3,072 x 768, 4.93
against 4.96 at 128 x 1,536 x 384, no change from 1,024 rows on. The fixed cost of a short tile lies
elsewhere (its first copies' latency and the K loop's).
Then x's box cut to the 64 rows a split tile multiplies (a stage's copies 16 KB instead of 24; a
scratch A/B in one run, same bits), us, 128-row box against 64: 5 x 3,072 x 768 5.5 against 4.9, 16
rows 5.7 against 4.8-5.0, 64 rows 5.2 against 5.0; 16 x 1,536 x 384 4.0 against 3.9, 64 rows 4.1
against 3.9; 40 x 1,000 x 264 4.0 against 3.8. Kept: the package's kernel takes that box at 64 rows
or fewer (ops.py builds the map to match).

Measured on the H100 (2026-11-25, the same day), changes to the package's kernel by scratch
A/B builds in one run (fp16, us, three rounds each; cuBLASLt + the pass and cuBLASLt's product
alone in brackets):

    product (rows x N x K, epilogue)   shipped        stage released  + GELU on one MUFU op  [cuBLASLt + pass, product]
    32,768 x 3,072 x 768, erf GELU     311-315        296-301         291-292                [349-361, 208-211]
    8,192 x 3,072 x 768, erf GELU      80-85          77-82           75.5-75.9              [90.5, 56.5]
    4,096 x 3,072 x 768, erf GELU      41.2-41.5      40.5-40.6       39.6-39.8              [45.9, 32.5]
    32,768 x 1,536 x 384, erf GELU     107-110        106-107         101.6-101.9            [132.3, 62.0]
    32,768 x 2,304 x 768, plain        186-201        178-179                                [157-162]
    32,768 x 768 x 3,072, plain        232-267        219-220                                [220-234]
    32,768 x 768 x 768, plain          65-67          62.8-63.1                              [58.4]
    4,096 x 2,304 x 768, plain         31.3-31.8      30.3-30.8                              [23.5]

"Stage released": each consumer warpgroup waits for its K step's products and releases the stage at
once, where it had kept them in flight into the next step and released a stage only after issuing
the next step's products, so only once the next stage's copies had arrived: the producer then had
one copy fewer in flight. Releasing the previous stage early while keeping the products in flight
(a non-blocking test of the next stage's barrier, the products waited for where it was not full
yet) was slower than the plain release (301-306 at 32,768 x 3,072 x 768). "GELU on one MUFU op":
common.cuh's erf GELU as 2^q(z) for erfc (bench/experiments/gelu_fit.py) instead of Abramowitz &
Stegun 7.1.26's reciprocal and exponential: the epilogue was bound by the MUFU unit (16 results a
clock an SM). Outputs: the same bits with the stage released; within one fp16 ulp with the new GELU.
The narrow tiles gained nothing either way (512 x 1,536 x 384 5.2, 64 x 3,072 x 768 4.8-4.9).
Both kept. Tried and not kept: K split over a cluster of 2-4 blocks (one tile a cluster; blocks
1.. sent their fp32 sums to block 0 through distributed shared memory and an mbarrier, block 0
added them in rank order and ran the epilogue), for short batches at K = 768: slower everywhere,
us, against the 64-column tile (8 stages) and cuBLASLt + the pass: 128 x 3,072 x 768 split 2 7.4,
split 3 11.4, split 4 12.4 against 6.8 and 6.6; 128 x 768 x 768 (plain) 6.3 / 5.9 / 6.4 against
5.4 (cuBLASLt 3.3). A short product's time here is a fixed cost of about 5 us (12 blocks of 12 K
steps take 5.4 us, 36 blocks of 4 K steps 5.9), not its K steps: splitting K only adds blocks and
the exchange.

Measured on the H100 (2026-11-25, a later session), 192-column tiles with four stages (the ring one
stage deeper in the same shared memory: 40 KB a stage against 48; m64n192k16), each stage released
as its products finish or one product group kept in flight (wgmma_wait<1>, the stage released after
the next step's issue), by a scratch A/B build in one run (fp16, us, best of three rounds; every
check against NumPy passed). No variant leads the shipped kernel on the products it runs:

    product (rows x N x K, epilogue)   256 / 3 stages   192 / 4   192 / 4, wait<1>   256 / 3, wait<1>   [cuBLASLt]
    32,768 x 3,072 x 768, erf GELU     293.8            319.5     325.8              330.9              [351.8]
    8,192 x 3,072 x 768, erf GELU      75.5             76.0      76.2               76.2               [90.1]
    4,096 x 3,072 x 768, erf GELU      39.3             39.8      39.8               39.4               [43.1]
    32,768 x 1,536 x 384, erf GELU     102.8            109.8     109.1              107.1              [133.7]
    32,768 x 2,304 x 768, plain        194.9            190.4     190.6              195.8              [157.0]
    32,768 x 768 x 3,072, plain        241.1            236.2     214.0              241.5              [217.4]
    32,768 x 768 x 768, plain          62.9             63.1      63.3               64.1               [58.6]
    4,096 x 2,304 x 768, plain         30.3             22.9      22.7               30.6               [22.0]

(cuBLASLt: + the bias + GELU pass where there is a GELU.) The rounds spread by up to 10% at 32,768
rows; the 192-column tile's lead at 4,096 x 2,304 is its tile count: 384 tiles fill three rounds of
132 SMs where 288 leave the third round part empty. So the ring's depth is not what keeps the main
loop behind cuBLASLt. The 192-column tile is kept for gemm_sm90.cu matmul_wgmma_ln (figures in
kernels.py at WGMMA_LN_TILE), whose 256-column tile would spill.

The same session, two blocks an SM (__launch_bounds__(288, 2): 128-column tiles with 2 stages, 96
registers, or 64-column tiles with 2-3 stages, 80; one block's epilogue could run beside the other's
products), bias + erf GELU, us, against (256, 3 stages), (128, 4) one block an SM, and cuBLASLt + the
pass; all the same bits: 4,096 x 3,072 x 768 128/2 42.6, 64/3 56.2 against 39.1, 42.8 and 42.4;
2,048 rows 27.3 / 28.6 against 25.9 / 22.4 / 22.8; 32,768 rows 356.7 / 485.2 against 313.2 / 361.3 /
352.9; all-MiniLM-L6-v2's 4,096 x 1,536 x 384 18.9 / 18.6 against 18.5 / 15.7 / 18.4, 32,768 rows
112.8 / 135.8 against 102.2 / 115.9 / 133.8. Not kept.

Measured on the H100 (2026-11-26), the GELU of each tile deferred into the next tile's K steps, so
that it runs while the tensor cores multiply: a tile's sums + bias rounded to T into the
warpgroup's result buffer (stage_fragments without the GELU), then, as a consume_tile step_work
after each K step's products were issued, half a 64-column box of the tile before a step (16 values
a thread, in place), each box stored by TMA once done, spread over all but the tile's last K step;
the block's last tile as before. Right (within the op tolerances, two roundings as cuBLASLt + the
pass), but slower, us, fp16, against the shipped kernel and the plain product (the same kernel
without the GELU): 32,768 x 3,072 x 768 303.2 against 293.4 and 238.3, 8,192 rows 76.7 against 75.5
and 61.6, 4,096 rows 38.8 against 39.2 and 31.6, all-MiniLM-L6-v2's 32,768 x 1,536 x 384 106.2
against 101.6 and 72.3, 1,000 x 3,000 x 376 (128-column tiles) 15.0 against 14.7. The GELU cost as
much beside the products as after them, though at one half-box a K step it asked for well under
the step's tensor-core time: the products slowed beside the warps' float32 work (why was not
measured further; a ping-pong of the two consumer warpgroups, one's epilogue beside the other's
products, would put the same work beside the same products). What made the epilogue cheaper
instead: fewer instructions a value in common.cuh's gelu (figures there).

Measured on the H100 (2026-11-26, a later session), the epilogue handed to warps of its own: the
256-column kernel with three more warps (384 threads, 166 registers, no spills), the consumer
warpgroups writing each tile's sums + bias, rounded to T, into their result buffers and going on to
the next tile, the epilogue warps taking each buffer through the erf GELU in place (16 bytes a
thread at a time) and out by TMA stores, an mbarrier pair per buffer between them (a scratch A/B
build in one run; every check against float64 passed, fp16 and bf16, errors within 5% of the
shipped kernel's: the pre-activation is rounded once more, as cuBLASLt + the pass and HF round it).
Slower or level, us, best of three rounds (worst in brackets), against the shipped kernel,
cuBLASLt + the pass and cuBLASLt's product alone: 32,768 x 3,072 x 768 287.6 (386.0) against 307.6
(324.2), 347.9, 207.1; 8,192 rows 76.7 against 74.4; 4,096 rows 40.4 against 38.9;
all-MiniLM-L6-v2's 32,768 x 1,536 x 384 118.5 against 99.0, 8,192 rows 32.1 against 26.8. At K = 384
three warps' GELUs take longer than the next tile's products, and at K = 768, where they keep up,
the products slowed beside them, as with the GELU deferred into the K steps above.
Why, measured the same day: each product run back to back for 3 s (50-launch graphs replayed),
nvidia-smi sampled every 50 ms, medians: every variant runs at the board's 700 W limit, its SM
clock well under the 1,980 MHz maximum: the shipped bias + erf GELU product 329.0 us a launch at
1,470 MHz and 699 W; the same kernel without the GELU 275.0 us, 1,350 MHz, 697 W; cuBLASLt's product
243.0 us (636 TFLOP/s), 1,245 MHz, 698 W; cuBLASLt + the pass 390.1 us, 1,500 MHz, 692 W. (Short
bursts, as timed above, run before the clock settles: 293-308, 238, 207 us.) So under sustained
load these products are bound by power, not by when their work is issued: overlapping the GELU
with the products cannot hide energy the GELU still spends. What remains is less energy a product:
fewer instructions a GELU, fewer bytes moved, or FP8's products.

    PYTHONPATH=. python3 bench/experiments/gemm_tiles.py [--small] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from ftengine.backends.cuda import gemm, launch as cuda_launch, runtime  # noqa: E402

PRODUCT = ("tma", 3, 256)  # the package's kernel: kernels_cu/gemm_sm90.cu matmul_wgmma, 3 stages, 256 columns
# its narrower tiles (("tma", STAGES, BN)), which ops.matmul_bias_gelu takes below WGMMA_GELU_MIN_OUTPUTS outputs
NARROW = [("tma", 4, 128), ("tma", 4, 64), ("tma", 5, 128), ("tma", 8, 64)]


PP_BN = 128  # gemm_wgmma_pingpong's tile columns (bench/experiments/gemm_sm90.cu)


def name(ctype, tiles, epilogue):
    """The kernel of a candidate: gemm_wgmma's; for PRODUCT and NARROW matmul_wgmma's and for ("pp",
    STAGES) gemm_wgmma_pingpong's, compiled per epilogue."""
    if tiles[0] == "tma":
        return f"matmul_wgmma<{ctype}, {tiles[1]}, {epilogue}, {tiles[2]}>"
    if tiles[0] == "pp":
        return f"gemm_wgmma_pingpong<{ctype}, {tiles[1]}, {epilogue}>"
    return f"gemm_wgmma<{ctype}, {tiles[0]}, {tiles[1]}, {tiles[2]}>"


def smem(itemsize, tiles):
    from ftengine.backends.cuda.gemm import GEMM_BK, GEMM_BM, wgmma_shared_mem
    if tiles[0] == "tma":
        return wgmma_shared_mem(itemsize, tiles[2], tiles[1])
    if tiles[0] == "pp":
        return (tiles[1] * (GEMM_BM + PP_BN) * GEMM_BK + 2 * GEMM_BM * PP_BN) * itemsize + 1024
    return tiles[1] * (GEMM_BM + 128 * tiles[0]) * GEMM_BK * itemsize + 1024

# (NI, STAGES, MIN_BLOCKS) of gemm_wgmma (bench/experiments/gemm_sm90.cu), and PRODUCT. The persistent kernels measured
# above as ("p", ...) and ("ps", ...) are gone but for ("ps", 3, 1, "e"), which became PRODUCT.
CANDIDATES = [(1, 3, 2), (1, 4, 1), (2, 4, 1), PRODUCT, ("pp", 4), *NARROW]
# (M, N, K, epilogue): 0 plain, 1 bias + erf GELU, 2 bias + tanh GELU
# (N a multiple of 8 throughout: matmul_wgmma's TMA stores take rows of 16-byte multiples)
CHECKS = [(1000, 3000, 760, 1), (129, 136, 72, 0), (5000, 3072, 768, 1), (300, 600, 200, 0), (300, 2304, 768, 2),
          (4096, 3072, 768, 1), (77, 512, 8, 1), (5, 3072, 768, 1), (200, 1544, 384, 1),
          (40, 1000, 264, 1), (64, 520, 64, 0)]
# (the rows of short batches: 1 x 128 BERT-base tokens and up; all-MiniLM-L6-v2's 384 -> 1,536)
SMALL = [(rows, n, k, 1) for n, k in ((3072, 768), (1536, 384)) for rows in (16, 64, 128, 256, 512, 1024, 2048)]
TIMED = [(32768, 3072, 768, 1), (8192, 3072, 768, 1), (4096, 3072, 768, 1), (1024, 3072, 768, 1),
         (512, 3072, 768, 1), (32768, 1536, 384, 1), (8192, 1536, 384, 1), (4096, 1536, 384, 1),
         (32768, 2304, 768, 0), (32768, 768, 3072, 0), (32768, 768, 768, 0), (4096, 768, 3072, 0)]
OPS_TOL = {"fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}  # tests/tolerances.py OPS


def check_candidates(candidates, checks, launch, rng) -> int:
    """Every candidate against NumPy (float64 products of the rounded operands) on `checks`
    ((M, N, K, epilogue) shapes), fp16 and bf16, outputs poisoned with NaN, at the package's op
    tolerance; launch(candidate, out, x, w, bias, epilogue) runs one. Returns the failures."""
    import cupy
    from ftengine.backends import numpy_ops as ref
    from ftengine.backends.cuda import ops as cu
    failures = 0
    for dtype in ("fp16", "bf16"):
        for m, n, k, epi in checks:
            xh = (rng.standard_normal((m, k)) / np.sqrt(k) ** 0.5).astype(np.float32)
            wh = (rng.standard_normal((n, k)) / np.sqrt(k) ** 0.5).astype(np.float32)
            bh = rng.standard_normal(n).astype(np.float32)
            x, w, b = (cu.to_device(a, cu.storage_dtype(dtype)) for a in (xh, wh, bh))
            xh, wh, bh = (cu.to_host(a).astype(np.float64) for a in (x, w, b))
            expected = xh @ wh.T
            if epi:
                ref.matmul_bias_gelu(expected, xh, wh, bh, form="erf" if epi == 1 else "tanh")
            atol, rtol = OPS_TOL[dtype]
            for cfg in candidates:
                out = cu.empty((m, n), cu.storage_dtype(dtype))
                with cu.context().stream:
                    out.view(cupy.uint16).fill(0x7FC0 if dtype == "bf16" else 0x7E00)
                launch(cfg, out, x, w, b, epi)
                got = cu.to_host(out).astype(np.float64)
                err = np.abs(got - expected)
                ok = not np.isnan(got).any() and bool(np.all(err <= atol + rtol * np.abs(expected)))
                failures += not ok
                print(f"check {dtype} {m}x{n}x{k} epi {epi} {cfg}: {'ok' if ok else 'FAIL'} "
                      f"max err {np.nanmax(err):.3g} nan {int(np.isnan(got).sum())}", flush=True)
    return failures


def main():
    from bench.bench_encoder import graph_ms
    from ftengine.backends.cuda import kernels
    from ftengine.backends.cuda import ops as cu

    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--small", action="store_true",
                   help="time the SMALL shapes only, and only matmul_wgmma's tiles (PRODUCT and NARROW)")
    args = p.parse_args()
    ctx = cu.context()
    assert ctx.wgmma, "needs a compute capability 9.0 GPU"
    candidates, timed = ([PRODUCT, *NARROW], SMALL) if args.small else (CANDIDATES, TIMED + SMALL)
    names = sorted({name(t, c, e) for t in ("__half", "__nv_bfloat16") for c in candidates for e in (0, 1, 2)})
    root = Path(__file__).resolve().parents[2] / "kernels_cu"
    code = "\n".join([*((root / f).read_text() for f in ("common.cuh", "gemm_sm90.cu")),
                      (Path(__file__).resolve().parent / "gemm_sm90.cu").read_text()])
    mod = kernels.CachedModule(code, names, (*kernels.compile_options(), "--gpu-architecture=sm_90a"))
    rng = np.random.default_rng(0)

    def launch(cfg, out, x, w, bias, epi):
        (m, k), n = x.shape, w.shape[0]
        k_ = mod.get_function(name(runtime._ctype(x), cfg, epi))
        size = smem(x.itemsize, cfg)
        if k_.max_dynamic_shared_size_bytes < size:
            k_.max_dynamic_shared_size_bytes = size
        sizes = (np.int32(m), np.int32(n), np.int32(k))
        # matmul_wgmma's x box holds 64 rows where M <= 64 (its split K steps)
        x_map = cuda_launch.TensorMap(x, gemm.GEMM_BK, gemm.wgmma_x_rows(m) if cfg[0] == "tma" else gemm.GEMM_BM)
        if cfg[0] in ("tma", "pp"):
            bn = cfg[2] if cfg[0] == "tma" else PP_BN
            tiles = gemm.wgmma_tiles(m, n, bn)
            maps = (x_map, cuda_launch.TensorMap(w, gemm.GEMM_BK, bn), cuda_launch.TensorMap(out, 64, 64))
            cuda_launch.launch_ex(k_, (min(ctx.sm_count, tiles),), (gemm.GEMM_THREADS,), (bias, *maps, *sizes), size,
                              ctx.stream.ptr, dependent=False)
        else:
            grid = (-(-n // (128 * cfg[0])), -(-m // gemm.GEMM_BM))
            cuda_launch.launch_ex(k_, grid, (gemm.GEMM_THREADS,),
                              (out, bias, x_map, cuda_launch.TensorMap(w, gemm.GEMM_BK, 128 * cfg[0]), *sizes,
                               np.int32(epi)), size, ctx.stream.ptr, dependent=False)

    failures = check_candidates(candidates, CHECKS, launch, rng)
    print(f"{failures} failed checks", flush=True)

    rows = []
    for m, n, k, epi in timed:
        x = cu.to_device(rng.standard_normal((m, k)).astype(np.float32) / np.sqrt(k) ** 0.5, np.float16)
        w = cu.to_device(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k) ** 0.5, np.float16)
        b = cu.to_device(rng.standard_normal(n).astype(np.float32), np.float16)
        out = cu.empty((m, n), np.float16)
        gemm._lt_matmul(out, x, w)  # times cuBLASLt's candidates for this shape once, outside a capture
        flop = 2 * m * n * k

        def baseline():
            gemm._lt_matmul(out, x, w)
            if epi:
                cu.add_bias_gelu(out, out, b, form="erf" if epi == 1 else "tanh")
        row = {"m": m, "n": n, "k": k, "epilogue": epi, "cublaslt_ms": graph_ms(baseline)}
        if epi:
            row["cublaslt_product_ms"] = graph_ms(lambda: gemm._lt_matmul(out, x, w))
        for cfg in candidates:
            row[str(cfg)] = graph_ms(lambda cfg=cfg: launch(cfg, out, x, w, b, epi))
        best = min(candidates, key=lambda c: row[str(c)])
        print(f"{m}x{n}x{k} epi {epi}: cuBLASLt{' + pass' if epi else ''} {row['cublaslt_ms'] * 1e3:.1f} us "
              f"({flop / row['cublaslt_ms'] / 1e9:.0f} TFLOP/s)"
              + (f", product alone {row['cublaslt_product_ms'] * 1e3:.1f}" if epi else "")
              + "; " + ", ".join(f"{c} {row[str(c)] * 1e3:.1f}" for c in candidates)
              + f"; best {best} {flop / row[str(best)] / 1e9:.0f} TFLOP/s, {row['cublaslt_ms'] / row[str(best)]:.2f}x",
              flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": ctx.device_name, "candidates": candidates, "rows": rows,
                       "median_ratio": statistics.median(r["cublaslt_ms"] / min(r[str(c)] for c in candidates)
                                                         for r in rows)}, f, indent=1)


if __name__ == "__main__":
    main()
