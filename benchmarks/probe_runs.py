"""Which runs of documents (several documents per program streamed as one run of tokens, tiles straddling two
documents) compile on this GPU's Triton, for tile rows, token tiles, warps and stages, each scored against the
float64 reference (int8: of the dequantised index and the queries as the kernel quantises them). A device probe
(session 11, benchmarks/results/run25/probe_runs.txt), behind kernels.launch's rule for straddling runs:

    python3 benchmarks/probe_runs.py [NAME_FILTER]
"""
import sys
import torch
import flash_maxsim as fm
from flash_maxsim import reference
from flash_maxsim.kernels import launch
from flash_maxsim.quantization import queries_as_scored

CASES = [
    # (name, Nq, B, Lq, Ld, d, kind, overrides)
    ("int8 1024x1030 default", 1, 2000, 1024, 1030, 128, "int8", {}),
    ("int8 1024x1030 masked", 1, 2000, 1024, 1030, 128, "int8-mask", {}),
    ("bf16 d=384 128x180 default", 1, 2000, 128, 180, 384, None, {}),
    ("bf16 d=384 32x180 default", 1, 4000, 32, 180, 384, None, {}),
    ("bf16 128x300 pps2", 1, 2000, 128, 300, 128, None, {"PROGRAMS_PER_SM": 2}),
    ("bf16 64x300 pps2", 1, 2000, 64, 300, 128, None, {"PROGRAMS_PER_SM": 2}),
    ("bf16 32x300 pps2", 1, 2000, 32, 300, 128, None, {"PROGRAMS_PER_SM": 2}),
    ("bf16 32x300 pps2 2 warps", 1, 2000, 32, 300, 128, None, {"PROGRAMS_PER_SM": 2, "num_warps": 2}),
    ("bf16 64x1k rows128 pps2 stages2", 64, 1000, 32, 300, 128, None, {"ROWS": 128, "PROGRAMS_PER_SM": 2, "num_stages": 2}),
    ("bf16 64x1k rows128 pps2 stages1", 64, 1000, 32, 300, 128, None, {"ROWS": 128, "PROGRAMS_PER_SM": 2, "num_stages": 1}),
    ("bf16 64x1k rows64 pps2", 64, 1000, 32, 300, 128, None, {"ROWS": 64, "PROGRAMS_PER_SM": 2}),
    ("bf16 1024x1030 default", 1, 500, 1024, 1030, 128, None, {}),
]
only = sys.argv[1] if len(sys.argv) > 1 else ""
torch.manual_seed(0)
for name, Nq, B, Lq, Ld, d, kind, ov in CASES:
    if only not in name:
        continue
    q = torch.randn(Nq, Lq, d, device="cuda", dtype=torch.bfloat16)
    docs = torch.randn(B, Ld, d, device="cuda", dtype=torch.bfloat16)
    mask = (torch.rand(B, Ld, device="cuda") > 0.1) if kind and kind.endswith("mask") else None
    launch.FORWARD_OVERRIDES.clear()
    launch.FORWARD_OVERRIDES.update(ov)
    launch._FORWARD_PLANS.clear()
    try:
        with torch.no_grad():
            if kind:
                qd = fm.quantize(docs, mask, dtype="int8")
                got = fm.maxsim(q, qd, documents_mask=mask)
                want = reference.maxsim(queries_as_scored(q, qd).double(), qd.dequantize(torch.float64),
                                        documents_mask=mask)
            else:
                got = fm.maxsim(q, docs)
                want = reference.maxsim(q.double(), docs.double())
        plan = next(iter(launch._FORWARD_PLANS.values()))
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        meta = {k: plan.meta[k] for k in ("TOKB", "QPB", "BLOCK_N", "FLAT_RUN", "STRADDLE", "num_warps", "num_stages")}
        print(f"probe {name}: ok, rel err {err:.1e} {meta}", flush=True)
    except Exception as exc:
        print(f"probe {name}: FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)
launch.FORWARD_OVERRIDES.clear()
