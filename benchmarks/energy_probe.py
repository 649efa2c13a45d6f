"""Energy per scoring call, beside its time: for rows that run at the board's power limit (int8 1x10k 1024x1024
since session 16), where a kernel that overlaps more work but spends more energy per product gets no faster.

    python benchmarks/energy_probe.py [--rounds 3] [--seconds 1.5] [--entries triton,rows256-64,gluon]

Each entry scores the same canonical inputs; in interleaved rounds it is checked against the package's default
(relative 1e-5), timed by ``triton.testing.do_bench`` (median), then run back to back for ``--seconds`` while the
board's energy counter (NVML, millijoules) and SM clock are read: milliseconds and millijoules per call, mean watts,
mean SM clock over that window. The window's time per call is the sustained (power-capped) one; ``do_bench``'s the
short one. Why: session 29's Gluon probe overlapped each program's products with its reduction and was slower on
this row (2.83 vs 2.59 ms) yet faster on the 1x1k row (0.283 vs 0.300), which a power-limited board explains if it
spends more energy per tile. Not the published benchmark (benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

# forward overrides (kernels.launch.FORWARD_OVERRIDES) spelled out in full: a "ROWS" override skips the launcher's
# compute-bound choices, so each variant names all of them. They are the choices these variants were measured with
# (sessions 29-33): 2 stages and no chained tile max, where today's default has 3 stages and the chain (sessions 43-44)
_COMPUTE_BOUND = dict(PREFETCH_TOKENS=True, QUANTIZE_FIRST=True, TMA_DOCS=True, BITCAST_SUMS=True, num_stages=2)
TRITON_VARIANTS = {
    "triton": {},
    # 256 query rows per program on 8 warps (two warpgroups share each document tile's copy: half the L2 reads)
    "rows256-64": dict(_COMPUTE_BOUND, ROWS=256, BLOCK_N=64, num_warps=8, MAXNREG=128, PROGRAMS_PER_SM=16),
    "rows256-128": dict(_COMPUTE_BOUND, ROWS=256, BLOCK_N=128, num_warps=8, MAXNREG=0, PROGRAMS_PER_SM=8),
    # 128 rows x 64-token tiles: a 64-register accumulator, more programs per SM
    "rows128-64": dict(_COMPUTE_BOUND, ROWS=128, BLOCK_N=64, num_warps=4, MAXNREG=128, PROGRAMS_PER_SM=32),
}


class EnergyCounter:
    """The board's total energy in millijoules since the driver loaded (NVML), read through pynvml where installed
    (``nvml=True``), else by running ``command`` (nvidia-smi's ``total_energy_consumption``). ``index``: NVML's index
    of the board, or its PCI bus id (``gpu_clocks.smi_id``: the board torch's device is)."""

    def __init__(self, index=0, nvml: bool = True, command: str = "nvidia-smi"):
        self.index, self.command = index, command
        self.source = command
        if nvml:
            try:
                import pynvml
                pynvml.nvmlInit()
                if str(index).isdigit():
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
                else:
                    handle = pynvml.nvmlDeviceGetHandleByPciBusId(str(index))
                self.read = lambda: float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
                self.source = "pynvml"
            except Exception:          # no pynvml, or no NVML driver: nvidia-smi below
                pass

    def read(self) -> float:
        import subprocess
        out = subprocess.run([self.command, "--query-gpu=total_energy_consumption", "--format=csv,noheader,nounits",
                              f"--id={self.index}"], capture_output=True, text=True, check=True).stdout
        return float(out.split()[0])


def sustained(call, seconds: float, energy: EnergyCounter, clocks=None, sync=None) -> dict:
    """Milliseconds and millijoules per call, mean watts (and the mean SM clock of ``clocks``, a running
    ``gpu_clocks.ClockSampler``), over about ``seconds`` of back-to-back calls (at least 5), ``sync`` (default
    ``torch.cuda.synchronize``) waiting for the device at both ends of the window."""
    sync = sync or torch.cuda.synchronize
    call()
    sync()
    t0 = time.monotonic()
    call()
    sync()
    n = max(5, int(seconds / max(time.monotonic() - t0, 1e-6)))
    e0, t0 = energy.read(), time.monotonic()
    for _ in range(n):
        call()
    sync()
    t1, e1 = time.monotonic(), energy.read()
    row = {"ms": (t1 - t0) / n * 1e3, "mJ": (e1 - e0) / n, "W": (e1 - e0) / 1e3 / (t1 - t0)}
    if clocks is not None:
        samples = [s for t, s in clocks.stamped if t0 <= t <= t1]
        if samples:
            row["MHz"] = statistics.mean(s.sm_mhz for s in samples)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--entries", default="", help="comma-separated entry names (default: all)")
    ap.add_argument("--docs", type=int, default=10000)
    ap.add_argument("--kind", choices=("int8", "fp8"), default="int8",
                    help="the index's format (fp8: the default kernel and cuBLAS's int8 GEMM only; the variants and "
                         "the Gluon probe are int8's)")
    args = ap.parse_args(argv)
    import triton.testing

    import flash_maxsim as fm
    from ab_forward import forward_scores
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch
    from gpu_clocks import ClockSampler, smi_id

    torch.manual_seed(0)
    q = torch.randn(1, 1024, 128, device="cuda", dtype=torch.bfloat16)
    docs = torch.randn(args.docs, 1024, 128, device="cuda", dtype=torch.bfloat16)
    p = _layout.canonicalize(q, fm.quantize(docs, dtype=args.kind), None, None, masked="exclude", smooth_tau=None)
    del docs
    launch.FORWARD_OVERRIDES.clear()
    want = forward_scores(launch, p)

    def with_overrides(over):
        def call():
            launch.FORWARD_OVERRIDES.clear()
            launch.FORWARD_OVERRIDES.update(over)
            return forward_scores(launch, p)
        return call

    entries = {name: with_overrides(over) for name, over in TRITON_VARIANTS.items()
               if args.kind == "int8" or not over}
    try:
        if args.kind != "int8":
            raise ImportError("the Gluon probe scores int8 documents only")
        from gluon_int8_probe import gluon_scores
        from flash_maxsim.quantization import quantize_tokens
        qv, qs = quantize_tokens(p.queries)
        dv, ds = p.documents, p.document_scales.contiguous()
        entries["gluon"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, bitcast=True)
        # a floor, not a scorer (wrong scores, unchecked): the same products, 1 tile in 8 reduced
        entries["gluon-fold1/8"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, bitcast=True, fold_every=8)
        # the query tile as the products' A operand in registers (wgmma RS): half the shared-memory operand reads
        entries["gluon-rs"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, bitcast=True, a_regs=True)
        # the same, capped at 168 registers for 3 programs per SM as the SS form has (spills 18 words per tile)
        entries["gluon-rs-168"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, maxnreg=168, bitcast=True, a_regs=True)
        # 128 rows on two warpgroups of 64 (8 warps): RS takes 97 registers (offline sm_90), 2 programs per SM; capped
        # at 80, 3 per SM, the SS form does not spill and the RS form spills 17 words per tile
        entries["gluon-8w-80"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, maxnreg=80, nw=8, bitcast=True)
        entries["gluon-rs-8w"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, nw=8, bitcast=True, a_regs=True)
        entries["gluon-rs-8w-80"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, maxnreg=80, nw=8, bitcast=True,
                                                         a_regs=True)
        entries["gluon-fold1/8-rs"] = lambda: gluon_scores(qv, qs, dv, ds, 24, 3, bitcast=True, fold_every=8,
                                                           a_regs=True)
        # the same floor with 256 query rows per program on 8 warps: each document tile copied once for twice the rows
        entries["gluon256-fold1/8"] = lambda: gluon_scores(qv, qs, dv, ds, 8, 3, nw=8, bm=256, bitcast=True,
                                                           fold_every=8)
        from gluon_pingpong_probe import BOOST, pingpong_scores
        boosted = p.document_scales.float() * BOOST
        # two consumer warpgroups alternating their products and reductions, a producer warp (session 29)
        entries["pingpong"] = lambda: pingpong_scores(qv, qs, dv, boosted, nbuf=4)
        entries["consumers"] = lambda: pingpong_scores(qv, qs, dv, boosted, nbuf=4, pingpong=False)
    except ImportError as exc:
        print(f"no Gluon entry: {exc}")
    # the tensor cores' floor: one int8 GEMM of the row's products (1024 x 1024 x (docs x 128): the same multiply-adds,
    # reduced over the long axis, so that its output is small), through cuBLAS
    k = args.docs * 128
    ga = torch.randint(-127, 128, (1024, k), device="cuda", dtype=torch.int8)
    gb = torch.randint(-127, 128, (1024, k), device="cuda", dtype=torch.int8).t()
    entries["cublas-int8-gemm"] = lambda: torch._int_mm(ga, gb)
    # and one of a shape cuBLAS runs well (8192 x 8192 x 19968: the same number of products, to 0.2%)
    ha = torch.randint(-127, 128, (8192, 19968), device="cuda", dtype=torch.int8)
    hb = torch.randint(-127, 128, (8192, 19968), device="cuda", dtype=torch.int8).t()
    entries["cublas-int8-8k"] = lambda: torch._int_mm(ha, hb)
    unchecked = {"gluon-fold1/8", "gluon-fold1/8-rs", "gluon256-fold1/8", "cublas-int8-gemm", "cublas-int8-8k",
                 "cublas-fp8-8k"}
    if args.kind == "fp8":
        # e4m3 products of the same count (torch._scaled_mm: per-tensor scales, bf16 output)
        fa, fb = ha.to(torch.float8_e4m3fn), hb.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda", dtype=torch.float32)
        entries["cublas-fp8-8k"] = lambda: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16)
    if args.entries:
        keep = args.entries.split(",")
        entries = {k: v for k, v in entries.items() if k in keep}

    gpu = smi_id()
    energy = EnergyCounter(gpu)
    print(f"energy counter: {energy.source}; {args.kind} 1x{args.docs} 1024x1024, d=128", flush=True)
    rows: dict = {}
    with ClockSampler(index=gpu) as clocks:
        for r in range(args.rounds):
            for name, call in entries.items():
                try:
                    got = call()
                    err = 0.0 if name in unchecked else (got - want).abs().max().item() / max(want.abs().max().item(),
                                                                                             1e-30)
                    if not err <= 1e-5:
                        raise AssertionError(f"scores differ from the default's (relative {err:.1e})")
                    short = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                    row = {"do_bench_ms": short, **sustained(call, args.seconds, energy, clocks)}
                except Exception as exc:
                    print(f"round {r} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rows.setdefault(name, []).append(row)
                print(f"round {r} {name:12s} " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    launch.FORWARD_OVERRIDES.clear()
    print("medians over rounds (ratio of mJ per call to the default's):")
    base = statistics.median(x["mJ"] for x in rows.get("triton", [{"mJ": float("nan")}]))
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs if k in x) for k in rs[0]}
        print(f"  {name:12s} " + "  ".join(f"{k} {v:.4g}" for k, v in med.items()) + f"  ({med['mJ'] / base:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
