"""How fast can this GPU merely *read* the bytes a bandwidth-bound scoring row reads?

The benchmark's floor divides a row's bytes by the bandwidth of a 1 GiB device-to-device copy. A short kernel (the
1x1k rows read ~250 MB in ~0.07 ms) also pays a launch, a ramp-up and a tail that no large copy shows. This
script times, for each bandwidth-bound row, the fastest of a sweep of read-only kernels over the same number of
bytes (a Triton loop that loads and XORs 32-bit words, each program one contiguous share, the loads pipelined;
configurations: words per load, programs per SM, warps, stages), and ``flash_maxsim.maxsim`` on the row itself,
interleaved in rounds. "ours / read" close to 1 means the row is as fast as reading its inputs.

    python tools/read_roofline.py [--rounds 3] [--out FILE.json] [--rows 32x1030] [--l2-flush read]

``--l2-flush read``: every call timed after a read of do_bench's 256 MB buffer instead of its zeroing (which leaves
dirty L2 lines that the timed call writes back: ~8-9 us per call on an H200). Not the published benchmark
(benchmarks/bench.py, whose L2 flush modes this script shares).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench import L2_FLUSH_HELP, L2_FLUSH_MODES, l2_flush  # noqa: E402

# (name, Nq, B, Lq, Ld, d, index): the bandwidth-bound rows (one query token block streams the documents once)
ROWS = [
    ("1x1k 32x1024", 1, 1000, 32, 1024, 128, None),
    ("1x1k 128x1024", 1, 1000, 128, 1024, 128, None),
    ("1x10k 32x300", 1, 10000, 32, 300, 128, None),
    ("1x10k 32x1030", 1, 10000, 32, 1030, 128, None),
    ("1x5k 31x257 d=96", 1, 5000, 31, 257, 96, None),
    ("int8 1x10k 32x300", 1, 10000, 32, 300, 128, "int8"),
    ("int8 1x10k 32x1030", 1, 10000, 32, 1030, 128, "int8"),
]

# words per load, programs per SM, warps, stages
CONFIGS = list(itertools.product((1024, 2048, 4096), (2, 4, 8), (4, 8), (3, 4)))


@triton.jit
def _read_kernel(X, OUT, n_words, words_per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """XOR of a contiguous share of ``X`` (int32 words): every word is loaded once; one word written."""
    pid = tl.program_id(0).to(tl.int64)
    start = pid * words_per_program
    end = tl.minimum(start + words_per_program, n_words)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for lo in tl.range(start, end, BLOCK, num_stages=STAGES):
        acc ^= tl.load(X + lo + offs, mask=lo + offs < end, other=0)
    tl.store(OUT + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_call(words: torch.Tensor, cfg):
    block, per_sm, warps, stages = cfg
    sms = torch.cuda.get_device_properties(words.device).multi_processor_count
    programs = per_sm * sms
    per_program = triton.cdiv(triton.cdiv(words.numel(), programs), block) * block
    grid = (triton.cdiv(words.numel(), per_program),)
    out = torch.empty(grid[0], dtype=torch.int32, device=words.device)

    def call():
        _read_kernel[grid](words, out, words.numel(), per_program, BLOCK=block, STAGES=stages, num_warps=warps)
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--rows", default="", help="only rows whose name contains one of these comma-separated texts")
    ap.add_argument("--l2-flush", choices=L2_FLUSH_MODES, default="zero", help=L2_FLUSH_HELP)
    args = ap.parse_args(argv)
    import flash_maxsim as fm

    def bench(fn):
        with l2_flush(args.l2_flush):
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    torch.manual_seed(0)
    results = []
    for name, Nq, B, Lq, Ld, d, kind in ROWS:
        if not any(r in name for r in args.rows.split(",")):
            continue
        q = torch.randn(Nq, Lq, d, device="cuda", dtype=torch.bfloat16)
        docs = torch.randn(B, Ld, d, device="cuda", dtype=torch.bfloat16)
        if kind:
            docs = fm.quantize(docs, dtype=kind)
            nbytes = docs.values.numel() + docs.scales.numel() * 4
        else:
            nbytes = docs.numel() * 2
        # the same number of bytes as one flat buffer of 32-bit words (a fresh buffer: the row's inputs stay)
        words = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_()
        ours = lambda: fm.maxsim(q, docs)  # noqa: E731
        # sweep once for the fastest read configuration, then time it against ours in rounds
        sweep = {cfg: bench(read_call(words, cfg)) for cfg in CONFIGS}
        best_cfg = min(sweep, key=sweep.get)
        best = read_call(words, best_cfg)
        t_read, t_ours = [], []
        for _ in range(args.rounds):
            t_read.append(bench(best))
            t_ours.append(bench(ours))
        r, o = statistics.median(t_read), statistics.median(t_ours)
        row = dict(row=name, bytes=nbytes, read_ms=r, ours_ms=o, ours_over_read=o / r,
                   read_tb_s=nbytes / r / 1e9, ours_tb_s=nbytes / o / 1e9,
                   read_config=dict(zip(("words_per_load", "programs_per_sm", "warps", "stages"), best_cfg)),
                   sweep_ms_min_max=(min(sweep.values()), max(sweep.values())))
        results.append(row)
        print(f"{name:20s} {nbytes / 1e6:8.1f} MB  read {r:.4f} ms ({row['read_tb_s']:.2f} TB/s, {best_cfg})  "
              f"ours {o:.4f} ms ({row['ours_tb_s']:.2f} TB/s)  ours/read {o / r:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           l2_flush=args.l2_flush, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
