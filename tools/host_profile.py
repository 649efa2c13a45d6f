#!/usr/bin/env python3
"""Where the host time of flash_maxsim's eager training step goes (scores -> cross-entropy -> autograd.grad of
queries and documents), on the benchmark's host-cost rows.

    python tools/host_profile.py                          # CUDA: the rows of bench.py's host section
    python tools/host_profile.py --rows B8 --steps 500 --json OUT.json
    python tools/host_profile.py --smoke                  # CPU, tiny shapes: the CPU path (PyTorch's ops)
    python tools/host_profile.py --smoke --stub-launches  # CPU: the kernels' host path, launches replaced by no-ops

Three views of each row:

1. Timed pieces, each called back to back with one synchronisation at the end (microseconds per call, and the
   part before the synchronisation, "enqueue"): the whole step, PyTorch's share (the loss and its gradient over a
   leaf tensor of scores), ``canonicalize``, the forward under autograd, forward + backward without the loss, and
   on the kernels' path ``launch.forward`` and ``launch.backward`` alone.
2. cProfile of the step: microseconds per step in the pipeline's functions, and the step split into buckets
   (validation, plan lookup, allocations, autograd Function, launches, the loss, autograd's engine and the rest).
   cProfile slows every Python call, so its microseconds are larger than the step's: read them as shares.
3. torch.profiler of the step: aten operators by self CPU time, kernels and launch calls per step, the GPU's
   kernel time per step (CUDA).

Also: host synchronisations inside a step (CUDA), whether Triton launch hooks are set and which launch path each
cached kernel takes (``kernels/direct_launch.py``: Triton's C launcher, or the compiled kernel's runner).

On the CPU, ``--stub-launches`` runs the kernels' host path (canonicalize, plans, allocations, the autograd
Function) with TRITON_INTERPRET=1 and every kernel launch replaced by a no-op: the Python cost of that path, which is
the same on the GPU machine, without the interpreter's time. Its outputs are uninitialised memory.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _shapes import CONTRASTIVE_TEMPERATURE, HOST_SHAPES, smoke_train  # noqa: E402

# functions of the pipeline, shown per step in the cProfile view: (file suffix, function name) -> label
PIPELINE = [
    (("flash_maxsim/_api.py", "maxsim"), "maxsim (public API)"),
    (("flash_maxsim/_layout.py", "canonicalize"), "  canonicalize (validation)"),
    (("flash_maxsim/ops.py", "scores"), "  ops.scores"),
    (("torch/autograd/function.py", "apply", "flash_maxsim/ops.py"), "    autograd.Function.apply"),
    (("flash_maxsim/ops.py", "forward"), "      _EagerMaxSim.forward"),
    (("flash_maxsim/ops.py", "forward_impl"), "        forward_impl"),
    (("flash_maxsim/kernels/launch.py", "forward"), "          launch.forward"),
    (("flash_maxsim/_cpu.py", "forward"), "          _cpu.forward (CPU path)"),
    (("loss",), "loss (cross-entropy)"),
    (("torch/autograd/__init__.py", "grad"), "torch.autograd.grad"),
    (("torch/autograd/function.py", "apply", "run_backward"), "  autograd's call of the Function's backward"),
    (("flash_maxsim/ops.py", "backward"), "    _EagerMaxSim.backward"),
    (("flash_maxsim/ops.py", "backward_impl"), "      backward_impl"),
    (("flash_maxsim/kernels/launch.py", "backward"), "        launch.backward"),
    (("flash_maxsim/_cpu.py", "backward"), "        _cpu.backward (CPU path)"),
    (("flash_maxsim/kernels/launch.py", "_cached_plan"), "plan cache lookups (forward + backward)"),
    (("flash_maxsim/kernels/direct_launch.py", "launch"), "kernel launches (direct_launch.launch)"),
]
# allocating calls, attributed to flash_maxsim when called from its files
ALLOCATORS = ("<built-in method torch.empty>", "<built-in method torch.zeros>", "<built-in method torch.full>",
              "<method 'new_empty' of 'torch._C.TensorBase' objects>",
              "<method 'new_zeros' of 'torch._C.TensorBase' objects>")


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def per_call_us(fn, n: int, cuda: bool, rounds: int = 3) -> dict:
    """``n`` calls back to back after a warm-up, one synchronisation at the end; median of ``rounds`` passes:
    microseconds per call (``us``) and before the synchronisation (``enqueue_us``)."""
    walls, enqueues = [], []
    for _ in range(rounds):
        for _ in range(max(3, n // 10)):
            fn()
        sync(cuda)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync(cuda)
        t2 = time.perf_counter()
        walls.append((t2 - t0) / n * 1e6)
        enqueues.append((t1 - t0) / n * 1e6)
    return {"us": statistics.median(walls), "enqueue_us": statistics.median(enqueues)}


def _key(func) -> str:
    filename, _, name = func
    return f"{filename}:{name}"


def _matches(func, pattern) -> bool:
    """``pattern``: (function name,) or (file suffix, function name[, caller's file suffix or name])."""
    filename, _, name = func
    if len(pattern) == 1:
        return name == pattern[0]
    return filename.replace(os.sep, "/").endswith(pattern[0]) and name == pattern[1]


def _called_by(caller, text: str) -> bool:
    return caller[0].replace(os.sep, "/").endswith(text) or text in caller[2]


def _builtin_name(func) -> str:
    return func[2] if func[0] == "~" else ""


def cprofile_step(step, n: int, cuda: bool) -> dict:
    """cProfile of ``n`` steps: per step, the cumulative microseconds of the pipeline's functions, the buckets
    the step splits into, and the functions with the most own time."""
    for _ in range(5):
        step()
    sync(cuda)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    sync(cuda)
    prof.disable()
    stats = pstats.Stats(prof).stats       # func -> (primitive calls, calls, own time, cumulative time, callers)

    def cum(pattern) -> float:
        if len(pattern) == 3:       # only the calls from that caller
            return sum(c[3] for f, v in stats.items() if _matches(f, pattern)
                       for caller, c in v[4].items() if _called_by(caller, pattern[2])) / n * 1e6
        return sum(v[3] for f, v in stats.items() if _matches(f, pattern)) / n * 1e6

    def own(pattern) -> float:
        return sum(v[2] for f, v in stats.items() if _matches(f, pattern)) / n * 1e6

    pipeline = {label: cum(pattern) for pattern, label in PIPELINE}
    total = cum(("step",))
    # allocations made by flash_maxsim's own code (the kernels' outputs, the arg-max, the gradients), and by
    # kernels/launch.py alone
    alloc = alloc_launch = 0.0
    for f, v in stats.items():
        if _builtin_name(f) in ALLOCATORS:
            for caller, c in v[4].items():
                path = caller[0].replace(os.sep, "/")
                if "/flash_maxsim/" in path:
                    alloc += c[3] / n * 1e6
                    alloc_launch += c[3] / n * 1e6 if path.endswith("kernels/launch.py") else 0.0
    launches = cum(("flash_maxsim/kernels/direct_launch.py", "launch"))
    launch_py = cum(("flash_maxsim/kernels/launch.py", "forward")) + cum(("flash_maxsim/kernels/launch.py",
                                                                          "backward"))
    function_fwd = cum(("torch/autograd/function.py", "apply", "flash_maxsim/ops.py")) \
        - cum(("flash_maxsim/ops.py", "forward"))
    function_bwd = cum(("torch/autograd/function.py", "apply", "run_backward")) \
        - cum(("flash_maxsim/ops.py", "backward_impl"))
    buckets = {
        "canonicalize / validation": cum(("flash_maxsim/_layout.py", "canonicalize")),
        "public API and op layer (maxsim, scores, forward_impl, backward_impl: own time)":
            own(("flash_maxsim/_api.py", "maxsim")) + own(("flash_maxsim/ops.py", "scores"))
            + own(("flash_maxsim/ops.py", "forward_impl")) + own(("flash_maxsim/ops.py", "backward_impl"))
            + own(("flash_maxsim/ops.py", "_use_triton")),
        "autograd Function plumbing (apply, ctx, saved tensors, the backward's call)": function_fwd + function_bwd,
        "plan lookup (keys, cache) and launch arguments (launch.forward/backward, less launches and allocations)":
            launch_py - launches - alloc_launch,
        "allocations by flash_maxsim (outputs, arg-max, gradients)": alloc,
        "kernel launches (direct_launch.launch)": launches,
        "CPU path compute (_cpu.forward / _cpu.backward)": cum(("flash_maxsim/_cpu.py", "forward"))
        + cum(("flash_maxsim/_cpu.py", "backward")),
        "the loss (forward)": cum(("loss",)),
    }
    buckets["autograd engine, the loss's backward, the rest"] = total - sum(buckets.values())
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
    return {"profiled_step_us": total, "pipeline_us": pipeline, "buckets_us": buckets,
            "top_own_us": [(_key(f), v[1] / n, v[2] / n * 1e6) for f, v in top]}


def torch_profile(step, n: int, cuda: bool) -> dict:
    """torch.profiler over ``n`` steps: the aten operators by self CPU time, kernels and launch calls per step, the
    GPU's kernel time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    step()
    sync(cuda)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync(cuda)
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    launch_calls = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
    ops: dict = {}
    for e in events:
        if e.device_type == DeviceType.CPU:
            count, self_us = ops.get(e.name, (0, 0.0))
            ops[e.name] = (count + 1, self_us + e.self_cpu_time_total)
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:20]
    out = {"aten_ops": sum(c for name, (c, _) in ops.items() if name.startswith("aten::")) / n,
           "launch_calls": sum(c for name, (c, _) in ops.items() if name in launch_calls) / n,
           "top_self_cpu_us": [(name, c / n, us / n) for name, (c, us) in top],
           "gpu_us": None, "kernels": None, "kernel_names": {}}
    if cuda:
        out["gpu_us"] = sum(e.time_range.elapsed_us() for e in device) / n
        out["kernels"] = len(device) / n
        names: dict = {}
        for e in device:
            count, us = names.get(e.name, (0, 0.0))
            names[e.name] = (count + 1, us + e.time_range.elapsed_us())
        out["kernel_names"] = {name[:80]: (c / n, us / n) for name, (c, us) in names.items()}
    return out


def host_syncs(step) -> list[str]:
    """Messages of the host synchronisations one step makes (CUDA only)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message)[:200] for w in caught if "prototype" not in str(w.message)]


def launch_paths() -> dict:
    """How the cached kernels launch: Triton's C launcher called directly, the compiled kernel's runner, or none
    cached (Triton's own launch path, or the CPU); and whether a Triton launch hook is set (it sends every direct
    launch through the runner)."""
    from flash_maxsim.kernels import direct_launch
    kinds: dict = {}
    for entry in direct_launch._RUNNERS.values():
        kinds[type(entry).__name__] = kinds.get(type(entry).__name__, 0) + 1
    hooks = None
    try:
        from triton import knobs
        hooks = {name: bool(getattr(getattr(knobs.runtime, name, None), "calls", False))
                 for name in ("launch_enter_hook", "launch_exit_hook")}
    except Exception as exc:
        hooks = f"unknown ({type(exc).__name__})"
    return {"direct_launch_enabled": direct_launch._enabled, "cached_launchers": kinds, "triton_hooks_set": hooks}


def profile_row(shape, args, cuda: bool) -> dict:
    import flash_maxsim as fm
    from flash_maxsim import _layout, ops
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    Nq, B, Lq, Ld, d = shape.Nq, shape.B, shape.Lq, shape.Ld, shape.d
    dtype = torch.bfloat16

    def tokens(*size):
        x = torch.randn(size, generator=gen, device=device)
        return F.normalize(x, dim=-1).to(dtype).requires_grad_(True)
    q, docs = tokens(Nq, Lq, d), tokens(B, Ld, d)
    labels = torch.arange(Nq, device=device) * (B // Nq)
    leaf = torch.zeros((Nq, B), device=device, requires_grad=True)
    g = torch.randn((Nq, B), generator=gen, device=device)

    def loss(s):
        return F.cross_entropy(s.float() / CONTRASTIVE_TEMPERATURE, labels)

    def step():
        return torch.autograd.grad(loss(fm.maxsim(q, docs)), (q, docs))

    def share():
        return torch.autograd.grad(loss(leaf), leaf)

    p = _layout.canonicalize(q, docs)
    pieces = {
        "step (ours)": step,
        "PyTorch's share (loss + its gradient over a leaf)": share,
        "canonicalize": lambda: _layout.canonicalize(q, docs),
        "forward under autograd (maxsim, graph dropped)": lambda: fm.maxsim(q, docs),
        "ops.scores under autograd (no canonicalize)": lambda: ops.scores(p, False, None),
        "forward + backward, no loss": lambda: torch.autograd.grad(fm.maxsim(q, docs), (q, docs), g),
    }
    kernels_path = ops._use_triton(q)
    if kernels_path:
        launch = ops.kernels()
        qd, dd = q.detach(), docs.detach()
        _, aux = launch.forward(qd, dd, None, None, None, 0, False, None, True, Ld)
        pieces["launch.forward (plan, allocations, launch)"] = \
            lambda: launch.forward(qd, dd, None, None, None, 0, False, None, True, Ld)
        pieces["launch.backward (plan, allocations, launch)"] = \
            lambda: launch.backward(g, qd, dd, None, None, None, Ld, aux, 0, None, True, True)
    pieces["torch.empty x4 (the step's outputs: scores, arg-max, 2 gradients)"] = lambda: (
        torch.empty((Nq, B), device=device), torch.empty((Nq, B, Lq), dtype=torch.int16, device=device),
        torch.empty((Nq, Lq, d), dtype=dtype, device=device), torch.empty((B, Ld, d), dtype=dtype, device=device))
    row = {"name": shape.name, "Nq": Nq, "B": B, "Lq": Lq, "Ld": Ld, "d": d, "device": str(device),
           "kernels_path": kernels_path, "stub_launches": args.stub_launches, "steps": args.steps}
    row["timed_us"] = {name: per_call_us(fn, args.steps, cuda) for name, fn in pieces.items()}
    # each view on its own: one that fails (a profiler without CUPTI) leaves the others
    views = (("cprofile", lambda: cprofile_step(step, args.profiled_steps, cuda)),
             ("torch_profiler", lambda: torch_profile(step, min(args.profiled_steps, 20), cuda)),
             ("host_syncs", lambda: host_syncs(step) if cuda else []),
             ("launch_paths", launch_paths))
    for name, view in views:
        try:
            row[name] = view()
        except Exception as exc:
            row[name] = None
            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def print_row(row: dict, top: int) -> None:
    timed = row["timed_us"]
    print(f"\n=== {row['name']} on {row['device']}"
          f"{' (kernel launches stubbed: host Python only)' if row['stub_launches'] else ''}"
          f"{'' if row['kernels_path'] else ' (CPU path: PyTorch ops, no kernels)'}")
    print(f"timed, {row['steps']} calls back to back, one sync at the end (median of 3 passes):")
    for name, t in timed.items():
        print(f"  {name:68s} {t['us']:8.1f} us  (enqueue {t['enqueue_us']:7.1f})")
    step, share = timed["step (ours)"]["us"], timed["PyTorch's share (loss + its gradient over a leaf)"]["us"]
    print(f"  {'ours above PyTorch share':68s} {step - share:+8.1f} us")
    for name, error in (row.get("errors") or {}).items():
        print(f"{name}: failed ({error})")
    cp = row["cprofile"] or {"profiled_step_us": 0.0, "buckets_us": {}, "pipeline_us": {}, "top_own_us": []}
    scale = step / cp["profiled_step_us"] if cp["profiled_step_us"] else 0.0
    print(f"cProfile: {cp['profiled_step_us']:.1f} us per profiled step ({step:.1f} unprofiled); "
          f"buckets (us per profiled step, share, share x unprofiled step):")
    for name, us in cp["buckets_us"].items():
        share_of = us / cp["profiled_step_us"] if cp["profiled_step_us"] else 0.0
        print(f"  {name:84s} {us:8.1f} {100 * share_of:5.1f}% ~{us * scale:7.1f}")
    print("cProfile: the pipeline's functions, cumulative us per profiled step:")
    for name, us in cp["pipeline_us"].items():
        if us > 0:
            print(f"  {name:60s} {us:8.1f}")
    print(f"cProfile: the {top} functions with the most own time (calls per step, own us per step):")
    for name, calls, us in cp["top_own_us"][:top]:
        print(f"  {us:8.1f} us {calls:5.1f}x  {name[-110:]}")
    tp = row["torch_profiler"] or {"gpu_us": None, "aten_ops": 0.0, "launch_calls": 0.0, "kernel_names": {},
                                    "top_self_cpu_us": []}
    gpu = "n/a" if tp["gpu_us"] is None else f"{tp['gpu_us']:.1f} us in {tp['kernels']:.1f} kernels"
    print(f"torch.profiler per step: {tp['aten_ops']:.1f} aten ops (nested included), {tp['launch_calls']:.1f} "
          f"launch calls, GPU time {gpu}")
    for name, (calls, us) in sorted(tp["kernel_names"].items(), key=lambda kv: -kv[1][1]):
        print(f"  GPU {us:8.1f} us {calls:5.1f}x  {name}")
    for name, calls, us in tp["top_self_cpu_us"][:top]:
        print(f"  CPU self {us:8.1f} us {calls:5.1f}x  {name[:90]}")
    syncs = row["host_syncs"] or []
    print(f"host syncs in one step: {len(syncs)}" + "".join(f"\n  {m}" for m in syncs[:5]))
    print(f"launch paths: {row['launch_paths']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", default="", help="comma list of texts; keep the host rows whose name contains one "
                   "(B8, B128; default: every row)")
    p.add_argument("--steps", type=int, default=None, help="calls per timed pass (default 300; 5 with --smoke)")
    p.add_argument("--profiled-steps", type=int, default=None,
                   help="steps under cProfile (default 200; 5 with --smoke); torch.profiler takes at most 20")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few steps: the code path only")
    p.add_argument("--stub-launches", action="store_true",
                   help="CPU: the kernels' host path (TRITON_INTERPRET=1) with every launch a no-op")
    p.add_argument("--import-peers", action="store_true",
                   help="import the peer packages first (benchmarks/_peers.py), as bench.py does: shows whether "
                        "one changes our launch path (a Triton launch hook)")
    p.add_argument("--src", type=Path, default=None,
                   help="profile the flash_maxsim package under this folder instead of this checkout's src/ (e.g. "
                        "another revision's: mkdir -p .ab/base && git archive REV src | tar -x -C .ab/base, then "
                        "--src .ab/base/src)")
    p.add_argument("--top", type=int, default=15, help="lines of each per-function list")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    args = p.parse_args(argv)
    args.steps = args.steps or (5 if args.smoke else 300)
    args.profiled_steps = args.profiled_steps or (5 if args.smoke else 200)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.src is not None:
        if not (args.src / "flash_maxsim" / "__init__.py").is_file():
            raise SystemExit(f"--src {args.src}: no flash_maxsim package there")
        sys.path.insert(0, str(args.src.resolve()))
    cuda = torch.cuda.is_available() and not args.smoke
    if args.stub_launches:
        if cuda:
            raise SystemExit("--stub-launches is for the CPU (use --smoke on a GPU machine)")
        os.environ["TRITON_INTERPRET"] = "1"      # before flash_maxsim's kernels are imported
    if args.import_peers:
        from _peers import PEER_KEYS, load_peers
        peers, missing = load_peers(PEER_KEYS)
        print(f"peers imported: {[p.label for p in peers]}; missing: {missing}")
    import flash_maxsim
    from flash_maxsim import ops
    print(f"flash_maxsim from {Path(flash_maxsim.__file__).parent}")
    if not cuda:
        torch.set_num_threads(1)
    shapes = [s for s in HOST_SHAPES if not args.rows or any(t in s.name for t in args.rows.split(","))]
    if args.smoke:
        shapes = [smoke_train(s) for s in shapes]
    rows = []
    backend = ops.force_backend("triton") if args.stub_launches else ops.force_backend(None)
    with backend:
        if args.stub_launches:
            from flash_maxsim.kernels import direct_launch
            direct_launch.launch = lambda *a, **k: None
        for shape in shapes:
            row = profile_row(shape, args, cuda)
            print_row(row, args.top)
            rows.append(row)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                "stub_launches": args.stub_launches, "argv": sys.argv[1:]}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
