"""A/B of the forward kernels against a baseline copy of them, in one device run: every forward row of issue 6
and the int8 rows of issue 7, the baseline, this checkout's default and tile variants of it timed in interleaved
rounds (so that clock drift hits every entry alike); medians of the rounds' medians.

The baseline is ``src/flash_maxsim/kernels`` and ``_layout.py`` of a git revision, extracted as the package
``flash_maxsim_base`` (the device copy of the repository has no history):

    python benchmarks/ab_forward.py --extract HEAD .ab/base          # here; .ab is git-ignored, carried
    python benchmarks/ab_forward.py --base .ab/base [--rows int8]    # on the GPU

Both sides score the same canonical inputs through ``kernels.launch.forward`` (the host path above it is shared).
Not the published benchmark (benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# (Nq, B, Lq, Ld, d, kind): issue 6's forward rows (bf16), issue 7's (int8 / fp8 index), the training forwards
ROWS = [
    (1, 1000, 32, 300, 128, None), (1, 10000, 32, 300, 128, None), (1, 1000, 32, 1024, 128, None),
    (1, 10000, 32, 1030, 128, None), (1, 1000, 128, 1024, 128, None), (1, 1000, 512, 1024, 128, None),
    (1, 1000, 1024, 1024, 128, None), (1, 10000, 1024, 1024, 128, None), (64, 1000, 32, 300, 128, None),
    (16, 32, 32, 8192, 128, None), (1, 10000, 32, 180, 384, None), (1, 5000, 31, 257, 96, None),
    (1, 10000, 32, 300, 128, "int8"), (1, 10000, 32, 1030, 128, "int8"), (1, 10000, 1024, 1024, 128, "int8"),
    (1, 10000, 32, 300, 128, "fp8"), (1, 10000, 32, 1030, 128, "fp8"), (1, 10000, 1024, 1024, 128, "fp8"),
    # the training steps' forwards (arg-max, or the smooth max's log-sum-exp, saved for the backward): ColBERT
    # in-batch B128 and B64 + 7 negatives (512 documents), ColPali B64 and B256, the smooth max (tau 0.1) at B128
    (128, 128, 32, 300, 128, "train"), (64, 512, 32, 300, 128, "train"), (64, 64, 32, 1030, 128, "train"),
    (256, 256, 32, 1030, 128, "train"), (128, 128, 32, 1030, 128, "smooth-train"),
]

def _token_rows(programs_per_sm, block_n=64, tma=False, stages=2, maxnreg=0, warps=4):
    """A variant of the token-rows kernel (kernels/forward_token_rows.py), every one of its choices spelled out."""
    return {"TOKEN_ROWS": True, "TOKEN_ROWS_PROGRAMS_PER_SM": programs_per_sm, "TOKEN_ROWS_BLOCK_N": block_n,
            "TOKEN_ROWS_TMA": tma, "TOKEN_ROWS_STAGES": stages, "TOKEN_ROWS_MAXNREG": maxnreg,
            "TOKEN_ROWS_WARPS": warps}


# session 10's variants (docs/perf-notes.md), by index (--variants): the several-documents loop as it was (one
# tile loop per document, FLAT_RUN off); register caps for more resident programs per SM (int8 1024x1024: 208
# registers, 2 programs of 4 warps; the 32-row int8 rows: 160 with straddling tiles, 6 programs of 2 warps), with
# grids sized for them; 128-token tiles for the int8 bandwidth rows (a run of documents wastes no partial tile per
# document); the peeled loop (unmasked whole tiles) on the bf16 bandwidth rows
VARIANTS = [{}, {"FLAT_RUN": False}, {"MAXNREG": 168}, {"MAXNREG": 168, "PROGRAMS_PER_SM": 12},
            {"MAXNREG": 168, "PROGRAMS_PER_SM": 24}, {"MAXNREG": 128}, {"BLOCK_N": 128},
            {"BLOCK_N": 128, "MAXNREG": 128}, {"PEEL_TAIL": True},
            # 9-15, on the int8 1024x1024 row's run of whole tiles (3.39 ms in run 22's first call): stages, grid
            # sizes, narrower tiles (64 tokens; 64 rows: a 64-register accumulator, more programs per SM)
            {"num_stages": 2}, {"num_stages": 4}, {"PROGRAMS_PER_SM": 8}, {"PROGRAMS_PER_SM": 32}, {"BLOCK_N": 64},
            {"ROWS": 64, "BLOCK_N": 128, "PROGRAMS_PER_SM": 16},
            {"ROWS": 64, "BLOCK_N": 128, "PROGRAMS_PER_SM": 16, "MAXNREG": 128},
            # 16-22: rows a few % short of their targets: grid sizes (int8 1x10k 32x300 at 8 programs per SM; bf16
            # 1x1k rows, one document per program: runs of several), the 16x32 32x8192 row's token split (3 slices
            # on 8 warps)
            {"PROGRAMS_PER_SM": 6}, {"PROGRAMS_PER_SM": 12}, {"PROGRAMS_PER_SM": 2}, {"PROGRAMS_PER_SM": 4},
            {"DSPLIT": 2}, {"DSPLIT": 4}, {"DSPLIT": 3, "num_warps": 4},
            # 23: the token split's slice count before run 22 (2 programs per SM rounded up: 3 on the 16x32 row)
            {"DSPLIT": 3},
            # 24-29 (session 11), the int8 compute-bound grid: its run's scales loaded in the tile itself (not a tile
            # ahead); the queries quantised in the kernel (not before the launch); with them quantised before, a
            # register cap for 3 programs per SM (165 registers, no spills) with grids of 8 or 4 waves
            {"PREFETCH_TOKENS": False}, {"QUANTIZE_FIRST": False}, {"QUANTIZE_FIRST": False, "PREFETCH_TOKENS": False},
            {"MAXNREG": 168, "PROGRAMS_PER_SM": 24}, {"MAXNREG": 168, "PROGRAMS_PER_SM": 12}, {"MAXNREG": 168},
            # 30-33 on that default (3 programs per SM): 2 stages; 64-token tiles, 3 or 4 programs per SM; 16 waves
            {"num_stages": 2}, {"BLOCK_N": 64}, {"BLOCK_N": 64, "MAXNREG": 128, "PROGRAMS_PER_SM": 32},
            {"PROGRAMS_PER_SM": 48},
            # 34-36: stages and warps on the rows a few % short of their targets (bandwidth-bound: 1x1k 32x1024,
            # 128x1024; int8 1x10k 32x300)
            {"num_stages": 4}, {"num_warps": 8}, {"num_stages": 2},
            # 37-39: bf16 bandwidth rows in straddling runs of documents on the int8 streaming grid's sizes (8 or 16
            # programs of 2 warps per SM; session 10 tried 2 and 4 per SM): no partial tile per document (d=96's
            # 257 tokens: 5 tiles of 64 for 4.02 tiles of tokens)
            {"PROGRAMS_PER_SM": 8}, {"PROGRAMS_PER_SM": 16}, {"PROGRAMS_PER_SM": 8, "MAXNREG": 128},
            # 40-41: the int8 compute-bound grid's whole document tiles copied by TMA (a tensor descriptor), on or off
            {"TMA_DOCS": True}, {"TMA_DOCS": False},
            # 42-47 (session 12): TMA copies on the bandwidth-bound runs of documents (int8 streaming grid: tiles that
            # straddle documents; bf16 runs of whole tiles), with deeper pipelines or larger tiles (more bytes in
            # flight per SM, which TMA gives without registers for addresses)
            {"TMA_DOCS": True, "num_stages": 4}, {"TMA_DOCS": True, "num_stages": 6},
            {"TMA_DOCS": True, "BLOCK_N": 128}, {"TMA_DOCS": True, "BLOCK_N": 128, "PROGRAMS_PER_SM": 4},
            {"TMA_DOCS": True, "PROGRAMS_PER_SM": 4}, {"TMA_DOCS": True, "num_stages": 4, "PROGRAMS_PER_SM": 4},
            # 48-49: the int8 streaming grid's scales loaded a tile ahead, with the per-thread copies or TMA (TMA frees
            # the copies' address registers: at the 128-register cap the prefetched loop no longer spills)
            {"PREFETCH_TOKENS": True}, {"TMA_DOCS": True, "PREFETCH_TOKENS": True},
            # 50-53 (session 13): d=96 (and any d < BLOCK_D) in runs of documents at 8 or 16 programs per SM, whole
            # tiles copied by TMA, which fills the features d..BLOCK_D with zeros (no feature mask, no per-thread
            # addresses)
            {"TMA_DOCS": True, "PROGRAMS_PER_SM": 8, "MAXNREG": 128}, {"TMA_DOCS": True, "PROGRAMS_PER_SM": 8},
            {"TMA_DOCS": True, "PROGRAMS_PER_SM": 16, "MAXNREG": 128},
            {"TMA_DOCS": True, "PROGRAMS_PER_SM": 8, "MAXNREG": 128, "num_stages": 4},
            # 54-55: 8 warps on the 1x1k 128-row runs of whole tiles, with TMA copies or 4 stages
            {"num_warps": 8, "TMA_DOCS": True}, {"num_warps": 8, "num_stages": 4},
            # 56-58 (session 15): int8 x int8 sums read as fp32 bits instead of converted (no I2FP per similarity:
            # 449 against 565 instructions per 128x128 tile on Triton 3.6's sm_90 SASS), alone and with the 2 or 4
            # stages the shorter loop may prefer
            {"BITCAST_SUMS": True}, {"BITCAST_SUMS": True, "num_stages": 2}, {"BITCAST_SUMS": True, "num_stages": 4},
            # 59 (session 18): the hard max over runs of whole tiles keeps 8 partial maxima per row across a
            # document's tiles (the columns one thread of the accumulator layout holds), the max across threads
            # once per document (offline sm_90, int8 1024x1024: 8 shuffles and 4 maxima fewer per tile of 441)
            {"ROW_PARTIALS": 8},
            # 60-62: fp8 streaming rows in 64-row tiles (the 32 query tokens padded) on 4 warps, so that the products
            # are wgmma e4m3 (32-row tiles: mma.sync f16 after converting each fp8 document tile), 128-token tiles
            # for runs of documents that straddle (Triton 3.6 pipelines 64 rows only so), 4 programs per SM at 128
            # registers; without the register cap (200: 2 per SM); TMA copies
            {"TOKB": 64, "BLOCK_N": 128, "num_warps": 4, "PROGRAMS_PER_SM": 4},
            {"TOKB": 64, "BLOCK_N": 128, "num_warps": 4, "PROGRAMS_PER_SM": 4, "MAXNREG": 0},
            {"TOKB": 64, "BLOCK_N": 128, "num_warps": 4, "PROGRAMS_PER_SM": 4, "TMA_DOCS": True},
            # 63: the same tiles in a grid of 8 programs per SM (4 resident: two waves of half the share each)
            {"TOKB": 64, "BLOCK_N": 128, "num_warps": 4, "PROGRAMS_PER_SM": 8},
            # 64-67: 64x1k 32x300 (256-row tiles, one program per document, ~1 query tile of 64 KB read per 77 KB
            # of document): 2 or 4 documents per program (the loop over several documents' tiles, each with its
            # partial last tile), with or without the partial row maxima; 68: the defaults without them
            {"DOCS": 2}, {"DOCS": 4}, {"DOCS": 2, "ROW_PARTIALS": 1}, {"DOCS": 4, "ROW_PARTIALS": 1},
            {"ROW_PARTIALS": 1},
            # 69-72: the 8-bit streaming grid on one warp per program (offline sm_90, 32x300: fp8 1404 warp
            # instructions per 64 tokens against 1604 on 2 warps, int8 854 against 1048; 246 / 234 registers
            # uncapped: 1181 / 785): 8 programs per SM at 128 registers or uncapped; 12 or 16 on 2 stages (the
            # 3-stage buffers hold 9 one-warp programs per SM)
            {"num_warps": 1, "PROGRAMS_PER_SM": 8}, {"num_warps": 1, "PROGRAMS_PER_SM": 8, "MAXNREG": 0},
            {"num_warps": 1, "PROGRAMS_PER_SM": 12, "num_stages": 2},
            {"num_warps": 1, "PROGRAMS_PER_SM": 16, "num_stages": 2},
            # 73 (session 18, not yet timed): 4 partial row maxima over column pairs, one per thread of a quad: no
            # more registers than one max per row (offline sm_90, int8 1024x1024: 168 registers, no spill, the tile
            # loop's 8 shuffles and 8 maxima moved to the document's end; the 8 partials spill there)
            {"ROW_PARTIALS": 4},
            # 74-75 (session 19, not yet timed): the peeled tail in 16- or 32-token tiles (TAIL_N), for 64x1k 32x300
            # (the last 44 tokens of each document: 48 columns of products instead of 64). Offline sm_90: 3 x 138
            # instructions against 1 x 333 for the tail (32: 2 x 195). Predicted slower (docs/perf-notes.md,
            # session 19): a wgmma m64n16k16 reads its 2 KB query slice from shared memory for 1/4 of the products
            {"TAIL_N": 16}, {"TAIL_N": 32},
            # 76-78 (session 19, not yet timed): 64x1k 32x300 with several documents per program, a loop per document
            # with its last tile peeled (PEEL_EACH_DOC; session 18's DOCS 2 / 4 tested every tile per element:
            # 1.06-1.32 of the time), the query tile loaded once per program: 4 documents at 128 registers (2 programs
            # per SM: offline sm_90 loops 332 / 210 instructions against 333 / 197, 232 B of stack outside them),
            # one persistent wave of 2 per SM (31 documents each), 4 documents uncapped (216 registers: 1 per SM)
            {"DOCS": 4, "PEEL_EACH_DOC": True, "MAXNREG": 128},
            {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128},
            {"DOCS": 4, "PEEL_EACH_DOC": True},
            # 79: the persistent wave with the 16-token tail (as 74 goes)
            {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16},
            # 80-84 (session 20, after 79 measured 0.3065 against 0.3440 ms, the only one of 74-79 faster than the
            # default): its neighbours, the tail in 32-token tiles, registers uncapped, 3 or 4 programs per SM (a
            # second wave), and one document per program with the 16-token tail and the cap
            {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 32},
            {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "TAIL_N": 16},
            {"PROGRAMS_PER_SM": 3, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16},
            {"PROGRAMS_PER_SM": 4, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16},
            {"MAXNREG": 128, "TAIL_N": 16},
            # 85-94 (session 21): the training forward (arg-max or log-sum-exp saved; 128 rows on 4 warps, 2 stages,
            # one document per program; ncu of B64 + 7 negatives: 231 us, ~350 TFLOP/s, half the step): 3 stages;
            # 256 rows on 8 warps (the scoring forward's tiles), with 3 stages; the peeled tail in 16-token tiles
            # (ColPali's 1030 tokens end 6 into a tile); the scoring forward's peeled runs (a share of the documents
            # per program, the query tile loaded once, each document's aux stored at its end) on 128 rows at 2 or 4
            # programs per SM, and on 256 rows at 2 per SM with the 128-register cap, without it, and with the
            # token-range mask on whole tiles as the scoring default has it (90-94: that kernel option was dropped after
            # this measurement, see DROPPED)
            {"num_stages": 3}, {"ROWS": 256, "num_warps": 8}, {"ROWS": 256, "num_warps": 8, "num_stages": 3},
            {"TAIL_N": 16}, {"ROWS": 256, "num_warps": 8, "TAIL_N": 16},
            {"PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "TAIL_N": 16},
            {"PROGRAMS_PER_SM": 4, "PEEL_EACH_DOC": True, "TAIL_N": 16},
            {"ROWS": 256, "num_warps": 8, "PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16},
            {"ROWS": 256, "num_warps": 8, "PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "TAIL_N": 16},
            {"ROWS": 256, "num_warps": 8, "PROGRAMS_PER_SM": 2, "PEEL_EACH_DOC": True, "MAXNREG": 128, "TAIL_N": 16,
             "WHOLE_TILE_MASKS": True},
            # 95-96: the 16-token tail with 3 stages, on 256 rows (8 warps) and on 128
            {"ROWS": 256, "num_warps": 8, "TAIL_N": 16, "num_stages": 3}, {"TAIL_N": 16, "num_stages": 3},
            # 97-104: the training forward with more warps per SM (run 41 ncu, B64 + 7 negatives: 3 warps per
            # scheduler, 6.6 cycles per issued instruction, 58% of the SM's issue rate): 128 rows on 8 warps (half the
            # accumulator per thread), with the 16-token tail and 3 stages; 64-row tiles; 256 rows on 16 warps; 256
            # rows on 8 warps with 4 stages
            {"num_warps": 8}, {"num_warps": 8, "TAIL_N": 16}, {"num_warps": 8, "num_stages": 3, "TAIL_N": 16},
            {"ROWS": 64}, {"ROWS": 64, "TAIL_N": 16}, {"ROWS": 256, "num_warps": 16, "TAIL_N": 16},
            {"ROWS": 256, "num_warps": 16, "TAIL_N": 16, "num_stages": 3},
            {"ROWS": 256, "num_warps": 8, "TAIL_N": 16, "num_stages": 4},
            # 105-106: 64x1k's peeled runs (run 42 ncu: 38% of the stalls at the per-tile CTA barrier of 8 warps) on
            # 2 stages, and as one program of 16 warps per SM
            {"num_stages": 2}, {"num_warps": 16, "PROGRAMS_PER_SM": 1},
            # 107-111: each whole tile's products issued before the previous tile's fold (OVERLAP_TILES; offline sm_90:
            # ptxas interleaves the fold between the next tile's wgmma instructions, the wait stays after the last),
            # on the default tiles and on the training forward's candidates above (dropped after this measurement)
            {"OVERLAP_TILES": True}, {"num_warps": 8, "OVERLAP_TILES": True},
            {"num_warps": 8, "TAIL_N": 16, "OVERLAP_TILES": True},
            {"ROWS": 256, "num_warps": 8, "TAIL_N": 16, "num_stages": 3, "OVERLAP_TILES": True},
            {"ROWS": 256, "num_warps": 8, "TAIL_N": 16, "OVERLAP_TILES": True},
            # 112-115 (session 22, timed on aca5130's defaults; 113 is the default since): the training forward's
            # arg-max in 8 partial (max, arg-max) pairs per row (ROW_PARTIALS with the arg-max; offline sm_90, B64 + 7
            # negatives: 340 instructions per whole tile against 396, no shuffle per tile), with whole tiles copied by
            # TMA (TMA_ONE_DOC), TMA alone, and the pairs on 3 stages
            {"ROW_PARTIALS": 8}, {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True}, {"TMA_ONE_DOC": True},
            {"ROW_PARTIALS": 8, "num_stages": 3},
            # 116-120: the pairs with TMA copies (112-115's fastest on the hard-max rows) on 3 stages, on 2, with the
            # 16-token tail, on 128 rows of 8 warps, on 256 rows of 8 warps with the 16-token tail
            {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True, "num_stages": 3},
            {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True, "num_stages": 2},
            {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True, "TAIL_N": 16},
            {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True, "num_warps": 8},
            {"ROW_PARTIALS": 8, "TMA_ONE_DOC": True, "ROWS": 256, "num_warps": 8, "TAIL_N": 16},
            # 121-130 (session 28): the 8-bit streaming grid with document tokens as the tile's rows
            # (kernels/forward_token_rows.py: 64-token wgmma tiles of int8 or fp8 straight from shared memory, an
            # element-wise running max, the max across tokens once per document; offline sm_90, 32x300: 78 / 96
            # registers, one loop of 360 / 339 instructions per thread on 4 warps, branches included, against 525 on
            # 2 warps and 1286 on 1): 4 programs per SM (16 warps, as 8 of 2 warps), 3 stages, TMA copies, 5, 6 or 8
            # per SM (8 at 64 registers), 128-token tiles on 8 warps
            _token_rows(4), _token_rows(4, stages=3),
            _token_rows(4, tma=True),
            _token_rows(4, tma=True, stages=3),
            _token_rows(5), _token_rows(6),
            _token_rows(8, maxnreg=64),
            _token_rows(8, tma=True, maxnreg=64),
            _token_rows(4, block_n=128, warps=8),
            _token_rows(2, block_n=128, stages=3, warps=8),
            # 131-137, around 128 / 124 (device call 1: the fastest on int8 and on fp8): TMA copies with 6, 7 or 8
            # programs per SM, 2 or 3 stages, register caps that leave the loop unspilled (offline sm_90: fp8 spills
            # at 64, not at 72; int8 neither); 128-token tiles on one warpgroup (two products of 64 rows)
            _token_rows(7, tma=True, stages=3, maxnreg=72),
            _token_rows(7, tma=True, maxnreg=72),
            _token_rows(6, tma=True, stages=3),
            _token_rows(6, tma=True),
            _token_rows(8, tma=True, stages=3, maxnreg=64),
            _token_rows(4, block_n=128, tma=True),
            _token_rows(5, block_n=128, tma=True, maxnreg=96),
            # 138-139, around 136 (device call 2: the fastest on three of the four rows): 128-token tiles on one
            # warpgroup by TMA with 3 stages (4 programs per SM) or 4 (3 per SM)
            _token_rows(4, block_n=128, tma=True, stages=3),
            _token_rows(3, block_n=128, tma=True, stages=4),
            # 140: the tile kernel on the streaming rows (the default before session 28)
            {"TOKEN_ROWS": False},
            # 141 (session 42; session 43 also fp8's 8 partial maxima per row): the hard max's tile max folded in a
            # fixed chain (kernels/forward.py, _column_chains): Triton 3.8+ lowers tl.max / tl.reduce within a
            # thread as a tree, 3.6 as a chain
            {"CHAINED_MAX": True},
            # 142 (session 43): without it (the defaults before session 43: int8's bit-cast sums, and fp8's
            # compute-bound grid under Triton 3.8+, take it since)
            {"CHAINED_MAX": False}]

# (variants timed and dropped with their kernel code: session 12's L2 prefetch of the run's scales, session 13's
# document tiles loaded under a gate on their scales; docs/perf-notes.md)
# variants whose kernel option was dropped after they were timed (index -> what it was): the plan would ignore the
# option, so they are refused rather than timed as something else
DROPPED = {i: "session 21: several documents per program in the training forward (1.1-1.5x slower)"
           for i in (90, 91, 92, 93, 94)}
DROPPED.update({i: "session 21: OVERLAP_TILES, each tile's products before the previous tile's fold (1.2-2.1x "
                   "slower)" for i in (107, 108, 109, 110, 111)})


def extract(rev: str, out: str) -> None:
    """``flash_maxsim_base`` under ``out``: the kernels and the layout module of ``rev``."""
    pkg = os.path.join(out, "flash_maxsim_base")
    os.makedirs(os.path.join(pkg, "kernels"), exist_ok=True)
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=HERE).stdout.strip()
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "src/flash_maxsim/kernels/"], capture_output=True,
                           text=True, check=True, cwd=root).stdout.split()
    # launch.py imports quantization lazily (queries quantised before the launch)
    for path in names + ["src/flash_maxsim/_layout.py", "src/flash_maxsim/quantization.py"]:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True,
                              cwd=root).stdout
        rel = os.path.relpath(path, "src/flash_maxsim")
        with open(os.path.join(pkg, rel), "w") as f:
            f.write(text)
    for init in (os.path.join(pkg, "__init__.py"), os.path.join(pkg, "kernels", "__init__.py")):
        if not os.path.exists(init):
            open(init, "w").close()
    rev_id = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True,
                            cwd=root).stdout.strip()
    with open(os.path.join(pkg, "REVISION"), "w") as f:
        f.write(rev_id + "\n")
    print(f"extracted {len(names) + 2} files of {rev} ({rev_id}) into {pkg}")


def forward_scores(lm, p, save_aux: bool = False, smooth_tau=None):
    """Scores of the canonical problem ``p`` (``_layout.canonicalize``) through ``lm.forward`` (a ``kernels.launch``
    module: this checkout's or the baseline's), hard max or smooth (``smooth_tau``). ``save_aux``: the training
    forward, its scores and saved arg-max (or log-sum-exp) flattened into one fp32 vector, so that a check of it
    covers both."""
    scores, aux = lm.forward(p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.candidates,
                             False, smooth_tau, save_aux, p.max_length, p.document_scales)
    if not save_aux:
        return scores
    return torch.cat([scores.flatten(), aux.flatten().to(torch.float32)])


def time_interleaved(entries, want, rounds: int, tol: float = 1e-5, clocks=None, unchecked=()) -> dict:
    """``label -> [ms per round]`` for ``entries`` of ``(label, call, before)``, timed in interleaved rounds
    (``triton.testing.do_bench`` medians). ``before`` (or None) runs ahead of each entry's check and timing (e.g.
    sets its overrides). Each round first checks the entry's scores against ``want`` (relative 1e-5); an entry that
    fails, does not compile or does not fit is timed as inf under a label that names the error, and the sweep goes
    on. ``clocks`` (a running gpu_clocks.ClockSampler): each timed pass is printed with the GPU's clocks, power and
    throttle reasons during it. Entries labelled in ``unchecked`` are timed without the check (--ceiling)."""
    import triton.testing
    times: dict = {}
    for r in range(rounds):
        for label, call, before in entries:
            if before is not None:
                before()
            try:
                got = call()
                err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                if not err <= tol and label not in unchecked:
                    raise AssertionError(f"scores differ from the first entry's (relative {err:.1e})")
                t0 = time.monotonic()
                t = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                if clocks is not None:
                    print(f"  pass {r} {label}: {t:.4f} ms, {clocks.summary(t0, time.monotonic())}", flush=True)
            except Exception as exc:
                t = float("inf")
                label = f"{label} [{type(exc).__name__}: {str(exc)[:80]}]"
            times.setdefault(label, []).append(t)
    return times


def ranked_line(times: dict, ref_label: str) -> str:
    """The entries' medians, fastest first, each with its ratio to ``ref_label``'s (to the fastest's if that entry
    failed)."""
    ranked = sorted((statistics.median(v), k) for k, v in times.items())
    ref = statistics.median(times[ref_label]) if ref_label in times else ranked[0][0]
    return "  ".join(f"{t:.4f} ({t / ref:.3f}) {k}" for t, k in ranked)


def host_times(fm, _layout, launches, calls: int = 200) -> None:
    """Microseconds of host time per scoring call, with and without a TMA descriptor (kernel_check.per_call_us:
    ``calls`` calls back to back, no sync inside the loop), on 1 query x 16 documents 32x128 in runs of 2
    documents, through each ``(label, kernels.launch module)`` of ``launches`` (the baseline's, this checkout's)."""
    from kernel_check import per_call_us
    for kind in (None, "int8"):
        q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(16, 128, 128, device="cuda", dtype=torch.bfloat16)
        if kind:
            docs = fm.quantize(docs, dtype=kind)
        p = _layout.canonicalize(q, docs, None, None, masked="exclude", smooth_tau=None)
        for tma in (False, True):
            for label, launch in launches:
                launch.FORWARD_OVERRIDES.clear()
                launch.FORWARD_OVERRIDES.update(PROGRAMS_PER_SM=0, DOCS=2, TMA_DOCS=tma)
                us = per_call_us(lambda: forward_scores(launch, p), calls)
                plan = next(reversed(launch._FORWARD_PLANS.values()))
                print(f"host {label} {kind or 'bf16'} 1x16 32x128 runs of 2, TMA {tma} (plan: {plan.meta['TMA_DOCS']}): "
                      f"{us:.1f} us per call", flush=True)
                launch.FORWARD_OVERRIDES.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract", nargs=2, metavar=("REV", "DIR"), help="write the baseline package and exit")
    ap.add_argument("--base", help="directory holding flash_maxsim_base (from --extract)")
    ap.add_argument("--rows", default="", help="only rows whose name contains one of these comma-separated texts "
                    "(e.g. int8, 1024x1024)")
    ap.add_argument("--variants", default="", help="indices into VARIANTS, comma-separated (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clocks", action="store_true", help="print every timed pass with the GPU's SM clock, power, "
                    "temperature and throttle reasons during it (nvidia-smi sampled every 20 ms: gpu_clocks.py)")
    ap.add_argument("--ceiling", action="store_true", help="time the baseline without checking its scores: a "
                    "deliberately wrong copy (e.g. one with some work cut out) bounds what removing that work gains")
    ap.add_argument("--base-fp32-scales", action="store_true", help="quantized rows: give the baseline fp32 scales "
                    "(a baseline before session 27 reads no others; by default it scores the index as this checkout)")
    ap.add_argument("--fp32-scales", action="store_true", help="quantized rows: also time this checkout's default "
                    "on the same index with its scales as fp32 (4 bytes a token, as before session 27) instead of bf16")
    ap.add_argument("--host", action="store_true", help="first, the host time of a launch with and without a TMA "
                    "descriptor, on a run of documents small enough to be host-bound")
    args = ap.parse_args(argv)
    if args.extract:
        extract(*args.extract)
        return 0
    import flash_maxsim as fm
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    base_launch = None
    if args.base:
        sys.path.insert(0, os.path.abspath(args.base))
        base_launch = importlib.import_module("flash_maxsim_base.kernels.launch")
        with open(os.path.join(args.base, "flash_maxsim_base", "REVISION")) as f:
            print(f"baseline: kernels of {f.read().strip()}")
    indices = [int(i) for i in args.variants.split(",")] if args.variants else range(len(VARIANTS))
    dropped = [i for i in indices if i in DROPPED]
    if args.variants and dropped:
        ap.error("dropped variants: " + "; ".join(f"{i} ({DROPPED[i]})" for i in dropped))
    variants = [VARIANTS[i] for i in indices if i not in DROPPED]
    torch.manual_seed(0)
    if args.host:
        host_times(fm, _layout, ([("base", base_launch)] if base_launch else []) + [("new", launch)])

    def set_overrides(v):
        launch.FORWARD_OVERRIDES.clear()
        launch.FORWARD_OVERRIDES.update(v)
    clocks = None
    with contextlib.ExitStack() as stack:
        if args.clocks:
            from gpu_clocks import ClockSampler, smi_id
            clocks = stack.enter_context(ClockSampler(index=smi_id()))
        run_rows(args, fm, _layout, launch, base_launch, variants, set_overrides, clocks)
    # a failed direct launch switches every later one to Triton's path (slower on the host, same kernels): say so
    from flash_maxsim.kernels import _launcher
    print(f"direct launches: {'on' if _launcher._enabled else 'off (fell back to Triton launches)'}")
    return 0


def run_rows(args, fm, _layout, launch, base_launch, variants, set_overrides, clocks) -> None:
    """Every row of ROWS that ``--rows`` selects: the baseline and the variants in interleaved rounds, a ranked
    line each."""
    dev = "cuda"
    for Nq, B, Lq, Ld, d, kind in ROWS:
        name = f"{kind or 'bf16'} {Nq}x{B} {Lq}x{Ld} d={d}"
        if not any(r in name for r in args.rows.split(",")):
            continue
        q = torch.randn(Nq, Lq, d, device=dev, dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device=dev, dtype=torch.bfloat16)
        training = kind in ("train", "smooth-train")
        if kind and not training:
            docs = fm.quantize(docs, dtype=kind)
        tau = 0.1 if kind == "smooth-train" else None
        p = _layout.canonicalize(q, docs, None, None, masked="exclude", smooth_tau=tau)
        # the index as it was before its 2-byte scales (session 27): the same numbers as fp32 scales, which a
        # baseline before that session reads (--base-fp32-scales); a later one is given the index as it is
        p32 = p if p.document_scales is None else dataclasses.replace(p, document_scales=p.document_scales.float())
        p_base = p32 if args.base_fp32_scales else p

        entries = ([("base", lambda: forward_scores(base_launch, p_base, training, tau), lambda: set_overrides({}))]
                   if base_launch else [])
        entries += [("new " + (str(v) if v else "default"), lambda: forward_scores(launch, p, training, tau),
                     lambda v=v: set_overrides(v)) for v in variants]
        if args.fp32_scales and p32 is not p:
            entries.append(("new default, fp32 scales", lambda: forward_scores(launch, p32, training, tau),
                            lambda: set_overrides({})))
        # the reference scores: this checkout's when the baseline is a deliberately wrong copy (--ceiling)
        want = forward_scores(launch if args.ceiling else (base_launch or launch), p_base, training, tau)
        # fp8 rows: Hopper's fp8 tensor cores sum in fewer bits than fp32 (~2^-14 of the products' magnitude: docs/
        # semantics.md), so an fp8 path on other tensor-core instructions differs at ~1e-4 of the largest score
        times = time_interleaved(entries, want, args.rounds, 5e-4 if kind == "fp8" else 1e-5, clocks,
                                 unchecked=("base",) if args.ceiling else ())
        launch.FORWARD_OVERRIDES.clear()
        print(f"ab {name}: {ranked_line(times, 'base')}", flush=True)
        del q, docs, p


if __name__ == "__main__":
    sys.exit(main())
