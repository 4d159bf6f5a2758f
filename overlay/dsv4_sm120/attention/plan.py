"""Split and combine plans of the sparse MLA decode: pure functions of the shapes and the SM count.

Torch-free and Triton-free (``config.resolve`` runs them on a CPU with injected device facts). No
data-dependent value enters a plan, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_splits(T: int, HG: int, K1: int, K2: int, block_n: int, num_sms: int, waves: float = 2.0):
    """Per-cache split plan: (s_main, chunk_main, s_extra, chunk_extra).

    Aim at ``waves * num_sms`` programs in total, never below one split per cache that has candidates, never more
    splits than candidate blocks; the splits go to main / extra in proportion to their candidate blocks."""
    nb1 = max(1, cdiv(K1, block_n))
    nb2 = cdiv(K2, block_n) if K2 > 0 else 0
    floor_ = 1 + (1 if nb2 else 0)
    want = max(1, cdiv(int(waves * num_sms), max(1, T * HG)))
    want = min(max(want, floor_), max(floor_, nb1 + nb2))
    if nb2:
        s1 = min(max(1, round(want * nb1 / (nb1 + nb2))), want - 1)
        s2 = want - s1
    else:
        s1, s2 = want, 0
    c1 = cdiv(nb1, s1) * block_n
    s1 = max(1, cdiv(K1, c1))
    if nb2:
        c2 = cdiv(nb2, s2) * block_n
        s2 = cdiv(K2, c2)
    else:
        c2 = block_n
    return s1, c1, s2, c2


# A program's fixed cost in candidate blocks: Q load, the first gather's full latency, the partial's store and its
# share of the combine. Fitted on the H200 (bench/results/attention.csv, spec_rows cases with waves=4 / 6 variants:
# the model below predicted 0.83-1.27x against measured 0.89-1.19x at 48-384 rows).
PROGRAM_OVERHEAD_BLOCKS = 1
# The warpgroup-MMA body's (64-candidate blocks, one CTA per SM): Q for 64 heads, the ring's first fill, and with
# more than one split per row the partials and the combine, which a single split's program skips (it writes the
# output). Fitted on the H200 (launch_h64 rows of 2026-12-03 06:59): 192 rows in 2 splits (3 rounds of 6 blocks)
# took 102.9 us, 256 rows in 1 split (2 rounds of 11) 92.2 us; with 5 blocks, 192 rows take one split.
WGMMA_PROGRAM_OVERHEAD_BLOCKS = 5
# ... and what a plan of more than one split per row pays once on top, per 64 heads (the partials' round trip and the
# combine launch, which a single split's programs skip; both scale with the heads). Fitted on the H200 (spec_rows
# at 9882354 and e0cb96a, same kernels, one and two splits): SWA-only rows (two blocks) at 48 rows of 64 heads run in
# one split (11.4 against 13.4 us in two), at 24 rows of 32 heads in two (10.2 against 11.0 in one).
WGMMA_COMBINE_BLOCKS = 1.5
# Below this many 64-candidate blocks in a call (rows x blocks per row) the register body runs where a table names
# impl=wgmma: its fixed cost per program outweighs a few blocks (H200, 64 heads, 6 rows: SWA-only, 12 blocks, 7.2 us
# against 10.3; c4, 60 blocks, 12.5 against 11.5). The tables come from launch sweeps over SWA + c4 rows (ten blocks).
WGMMA_MIN_BLOCKS = 48
# The same rule for impl=wgmma_t (16 or 32 heads as the MMA's N), counted in blocks x 16-head groups (its work per
# block grows with the heads while the register body's grows with the 16-head programs): H200, SWA-only rows at 24
# rows (48 blocks) took 8-9% longer than the register body at 8 and 16 heads (e792ad4, spec_h8_swa / spec_h16_swa)
# and 14% less at 32 heads (96); from 48 rows (96 blocks) it is 7-10% faster at 8 and 16 heads.
WGMMA_T_MIN_WORK = 64


# The same rule for the warp-specialized body where a table names it (sm_120's 32- / 64-head tables), in the same
# units: its fixed cost (Q of 32 / 64 heads staged, the ring's first fill, one CTA per SM) outweighs a few blocks.
# H200 with the sm_120 launch forced (rows of ca114e2): SWA-only rows (two blocks) at 8 / 24 rows took 8.68 / 9.62 us
# under wspec at 32 heads against 6.73 / 8.87 under the register body (32 / 96 blocks x groups) and 11.62 against
# 7.19 at 64 heads, 8 rows (64); from 160 (c4, 8 rows, 32 heads: 11.83 against 11.94) it is as fast or faster.
WSPEC_MIN_WORK = 128


def few_blocks(impl: str, rows: int, blocks_per_row: int, heads: int) -> bool:
    """Whether a call of ``rows`` rows of ``blocks_per_row`` 64-candidate blocks is too little work for the
    warpgroup-MMA body ``impl`` (``wgmma``: WGMMA_MIN_BLOCKS blocks; ``wgmma_t``: WGMMA_T_MIN_WORK blocks x 16-head
    groups) or the warp-specialized one (``wspec``: WSPEC_MIN_WORK blocks x 16-head groups), so the register body
    runs where a table names it."""
    if impl == "wgmma":
        return rows * blocks_per_row < WGMMA_MIN_BLOCKS
    if impl == "wgmma_t":
        return rows * blocks_per_row * cdiv(heads, 16) < WGMMA_T_MIN_WORK
    if impl == "wspec":
        return rows * blocks_per_row * cdiv(heads, 16) < WSPEC_MIN_WORK
    return False


def split_makespan(progs: int, splits: int, slots: int, blocks: int, overhead: float, combine: float) -> float:
    """Time of a split plan in blocks: ``progs`` grid rows of ``splits`` programs of ``blocks`` blocks each, ``slots``
    at once, every program paying ``overhead``, and ``combine`` once where rows have more than one split."""
    return cdiv(progs * splits, max(1, slots)) * (blocks + overhead) + (combine if splits > 1 else 0.0)


def plan_span(T: int, HG: int, K1: int, K2: int, block_n: int, num_sms: int, waves: float = 2.0,
              overhead: int = PROGRAM_OVERHEAD_BLOCKS, combine: float = 0.0):
    """Split plan of the spanning register body (SPAN=1): (splits, chunk) over the concatenated candidate list
    (main ++ extra, K1 + K2 candidates). The chunk is a whole number of blocks, so every program but the last of a
    row owns the same work.

    ``waves * num_sms`` programs run at once (2 per SM for a body that fits twice), so ``P`` equal programs finish
    in ``ceil(P / slots)`` rounds, each as long as one program: ``blocks + overhead`` (``PROGRAM_OVERHEAD_BLOCKS``,
    or the body's own), plus ``combine`` blocks for a plan of more than one split where one split launches no
    combine (the warpgroup-MMA body). The plan is the split count with the shortest time (ties: fewer splits). While
    the rows alone fit the slots this is mostly the most splits that fill one round (a second, partial round costs a
    whole program's time); with more rows than slots it cuts rows into a few chunks so the last round is not left
    half empty (384 rows on 264 slots: 2 splits, 3 rounds of 10 blocks instead of 2 rounds of 20)."""
    nb = max(1, cdiv(K1 + K2, block_n))
    slots = max(1, int(waves * num_sms))
    progs = max(1, T * HG)
    best = None
    for want in range(1, nb + 1):
        blocks = cdiv(nb, want)
        splits = cdiv(nb, blocks)
        key = (split_makespan(progs, splits, slots, blocks, overhead, combine), splits)
        if best is None or key < best[0]:
            best = (key, blocks)
    chunk = best[1] * block_n
    return max(1, cdiv(K1 + K2, chunk)), chunk


def balanced_cut(NB: int, W: int, C: int, r: int) -> Tuple[int, int]:
    """The programs that hold grid row ``r``'s first and last 64-candidate block in a balanced launch (``NB``
    blocks per grid row, ``W`` blocks in all, ``C`` programs; program ``c`` owns blocks ``c*W//C ..
    (c+1)*W//C - 1``): program ``c`` holds block ``u`` where ``c = ((u + 1)*C - 1) // W``. The kernels compute the
    same integers."""
    return ((r * NB + 1) * C - 1) // W, ((r + 1) * NB * C - 1) // W


def balanced_sizes(T: int, HG: int, K: int, num_sms: int) -> Tuple[int, int, int]:
    """``(C, NB, W)`` of a balanced plan: programs ``min(num_sms, W)``, blocks per grid row ``ceil(K / 64)``, blocks
    ``T x HG x NB``."""
    NB = max(1, cdiv(K, 64))
    W = max(1, T * HG) * NB
    return max(1, min(int(num_sms), W)), NB, W


@lru_cache(maxsize=1024)
def plan_balanced(T: int, HG: int, K: int, num_sms: int) -> Tuple[int, int, int]:
    """Balanced (persistent) plan of a warpgroup-MMA body: ``(C, NB, S)``. The call's ``T x HG`` grid rows of
    ``NB = ceil(K / 64)`` blocks each are laid end to end and cut into ``C = min(num_sms, W)`` runs of
    ``W // C`` or ``W // C + 1`` blocks (``W = T*HG*NB``), one program per SM walking its run across row boundaries
    with its ring kept full: no round is left part-empty and a program's fixed cost (launch, the ring's first
    fill) is paid once per SM, not once per row. A row inside one run is finished by its program (output and lse);
    a row cut between runs leaves one partial per run, ``S`` = the most runs a row spans (the workspace's splits),
    and the combine merges those rows only."""
    C, NB, W = balanced_sizes(T, HG, K, num_sms)
    S = 1
    for r in range(W // NB):
        first, last = balanced_cut(NB, W, C, r)
        S = max(S, last - first + 1)
    return C, NB, S


# Where the balanced plan pays, as a makespan model in blocks beside the classic plan's (split_makespan): classic =
# rounds x (blocks per program + WGMMA_PROGRAM_OVERHEAD_BLOCKS) + the combine where a row has several splits;
# balanced = one program's overhead + BALANCED_BLOCK_COST x the most blocks of one run + the combine (a cut row is
# merged). A block costs more under the balanced plan because every SM is busy and the loads of all of them
# share the memory system: at 72-120 rows the classic one-round plan keeps 72-120 SMs busy at ~1.65 us per block and
# program, the balanced one 132 at ~2.0-2.4 (H200, 16 heads). Fitted on the H200 over 52 points (8 and 16 heads; SWA
# + c4, + c128 at 64k and 128k; 24-384 rows; rows of dd1395b, 8093d84, 041586c and 636704c in attention.csv): 1.45
# loses the least summed over them (time against the faster plan: 50% in all, against 146% for the rule it replaced,
# "last round at most half full"; 1.4 and 1.5 lose 56% and 61%). It takes the balanced plan where
# the classic one leaves SMs idle: one round of fewer rows than SMs (72 rows of 10 blocks: 22.6 against 25.4 us), a
# last round about half full (192 rows: 45.7 against 48.9), and not where rounds are full (96 rows of 10 blocks: 27.3
# against 25.6; 384 rows: 82.2 against 74.1) or rows short (SWA-only rows of two blocks lost 2-80%:
# BALANCED_MIN_BLOCKS). Where it picks wrong: c128 at 128k with 48, 96 and 210-340 rows keeps the classic plan 3-14%
# slower than the balanced one; c4 with 340 rows takes the balanced plan 3% slower. 16 heads per program only (at 32
# its producers spill).
BALANCED_MIN_BLOCKS = 10
BALANCED_BLOCK_COST = 1.45


def balanced_pays(T: int, HG: int, K: int, num_sms: int, block_h: int, splits: int, blocks: int,
                  combine: float = 0.0) -> bool:
    """Whether the balanced plan replaces the classic one of ``splits`` splits per grid row of ``blocks``
    64-candidate blocks each (one program per SM): the model above, with ``combine`` blocks for a merge
    (``WGMMA_COMBINE_BLOCKS`` x heads / 64, as the classic plan charges it)."""
    if block_h != 16 or cdiv(K, 64) < BALANCED_MIN_BLOCKS:
        return False
    C, _, W = balanced_sizes(T, HG, K, num_sms)
    classic = split_makespan(max(1, T * HG), max(1, splits), num_sms, blocks, WGMMA_PROGRAM_OVERHEAD_BLOCKS, combine)
    balanced = WGMMA_PROGRAM_OVERHEAD_BLOCKS + BALANCED_BLOCK_COST * cdiv(W, C) + combine
    return balanced < classic


def balanced_fits(T: int, HG: int, K: int, num_sms: int) -> bool:
    """Whether the kernels' 32-bit arithmetic of a balanced plan holds: ``(W + NB) x C < 2^31`` (decode and
    verify batches are far below; only a huge prefill chunk is not)."""
    C, NB, W = balanced_sizes(T, HG, K, num_sms)
    return (W + NB) * C < 2 ** 31


def balanced_runs(T: int, HG: int, K: int, num_sms: int):
    """Every program's pieces of a balanced plan, as the kernels walk them: ``[(c, r, j0, j1, s, n)]`` = program
    ``c`` takes blocks ``j0 .. j1 - 1`` of grid row ``r`` as that row's piece ``s`` of ``n`` (``n == 1``: it
    writes the row's output itself)."""
    C, NB, W = balanced_sizes(T, HG, K, num_sms)
    out = []
    for c in range(C):
        u0, u1 = c * W // C, (c + 1) * W // C
        for r in range(u0 // NB, (u1 - 1) // NB + 1):
            first, last = balanced_cut(NB, W, C, r)
            out.append((c, r, max(u0 - r * NB, 0), min(u1 - r * NB, NB), c - first, last - first + 1))
    return out


def split_plan(span: bool, T: int, HG: int, K1: int, K2: int, block_n: int, num_sms: int, waves: float,
               overhead: int = PROGRAM_OVERHEAD_BLOCKS, combine: float = 0.0) -> Tuple[int, int, int, int]:
    """(s_main, chunk_main, s_extra, chunk_extra) of a launch; the spanning plan's splits all count as main
    splits (the kernel reads ``main_chunk`` only)."""
    if span:
        S, chunk = plan_span(T, HG, K1, K2, block_n, num_sms, waves, overhead, combine)
        return S, chunk, 0, block_n
    return plan_splits(T, HG, K1, K2, block_n, num_sms, waves)


def combine_maxnreg(block_s: int, per_thread: int) -> int:
    """Register cap for the combine. ptxas aims multi-warp programs at ~32 registers (full occupancy) and then
    issues only the first 1-3 loads of a chunk before the math; a cap is also the target it schedules to, so
    this one lets all ``block_s`` loads be in flight: 24 + (per_thread + 2) registers per split, a multiple of
    8, 32..255 (checked by the combine code-generation test)."""
    return min(255, max(32, 8 * cdiv(24 + block_s * (per_thread + 2), 8)))


def combine_block_s(S: int, per_thread: int = 4, max_words: int = 32) -> int:
    """Partials merged per unrolled step of the combine: as many as fit in flight (each is one ``per_thread``-element
    load per thread; <= ``max_words`` loaded words per thread, at most 16), spread evenly over the chunks so the
    last chunk is as full as the others."""
    cap = max(1, min(16, max_words // max(1, per_thread)))
    return cdiv(S, cdiv(max(S, 1), cap))


def combine_plan(T: int, H: int, S: int, num_sms: int, BLOCK_D: Optional[int] = None, warps: Optional[int] = None,
                 BLOCK_S: Optional[int] = None, maxnreg: Optional[int] = None, waves: float = 2.0):
    """Combine launch ``(BLOCK_D, BLOCK_S, warps, maxnreg)``; arguments given (not None) are kept and the others
    chosen around them. One head per program. Columns: the whole 512-wide row, halved while the grid
    ``T x H x 512/BLOCK_D`` has fewer than ``waves`` programs per SM, down to 128. Warps: 4 fp32 per thread (one
    16-byte vector per partial). ``BLOCK_S``: up to 8 partials in flight per thread (32 words), up to 16 (one
    round trip for S <= 16) when the grid is that small anyway (registers do not limit its occupancy; it is
    latency-bound)."""
    target = waves * max(1, num_sms)
    if BLOCK_D is not None:
        bd = int(BLOCK_D)
    else:
        bd = 512
        while bd > 128 and T * H * (512 // bd) < target:
            bd //= 2
    w = int(warps) if warps is not None else max(1, min(8, bd // 128))
    small = T * H * (512 // bd) <= target
    per_thread = max(1, bd // (32 * w))
    bs = int(BLOCK_S) if BLOCK_S is not None else combine_block_s(S, per_thread, 64 if small else 32)
    mr = combine_maxnreg(bs, per_thread) if maxnreg is None else int(maxnreg)
    return bd, bs, w, mr


def ws_words(impl: str, part_bf16: int) -> int:
    """4-byte workspace words per (row, split, head): the partial accumulator (fp32, or bf16 with PART_BF16 in the
    bodies that take it: tiled, reg, wspec, wgmma, wgmma_t) + m + l."""
    return 258 if impl in ("tiled", "reg", "wspec", "wgmma", "wgmma_t") and part_bf16 else 514
