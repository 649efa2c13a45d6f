"""Where a small training step's time goes (device probe; session 15, docs/perf-notes.md).

The benchmark's training step (``bench._train_step``: scores -> ``.float()`` -> loss -> ``torch.autograd.grad``)
for the four sub-millisecond rows of issue 6, timed several ways in one process:

- ``do_bench``: as the benchmark times it (median, L2 zeroed before each call);
- ``host``: microseconds of host time per step, steps enqueued back to back without a sync (``per_call_us``);
  when this exceeds the GPU time, the step is host-bound;
- ``graph``: the same step captured in a CUDA graph and replayed: the GPU's time alone;
- the same for the *loss alone*: the loss and ``autograd.grad`` over a leaf tensor of scores (``[Nq, C]`` fp32):
  PyTorch's part of the step, which no scoring kernel can remove;
- the same three for a *null step*: the same loss and ``autograd.grad`` over scores from one tiny product of
  the first query and document tokens (one forward kernel, two backward ones): what PyTorch's side of the step
  costs whatever computes the scores;
- host time of the pieces: our forward with its autograd node and the loss, ``autograd.grad`` on a one-element
  CUDA graph (the engine's fixed cost per backward), a pure-Python loop (to compare hosts between runs);
- our pieces alone (median of 5 x 100 calls): the forward under ``no_grad``, with its autograd node, the
  backward's ``kernels.launch.backward`` called directly, and ours through the engine with no loss;
- a *hollow* autograd Function shaped as ours (same arguments, saved tensors and outputs; empty tensors instead
  of kernels), through the engine as above: what PyTorch charges for a Python autograd node;
- ``torch.profiler`` over 20 steps: CPU time per op (self), and the GPU kernels' time.

    python3 benchmarks/train_host_probe.py            # on the GPU machine
"""
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import flash_maxsim as fm  # noqa: E402
from bench import TRAIN_SHAPES, _loss_fn, _train_step, unit_tokens  # noqa: E402
from kernel_check import bench, per_call_us  # noqa: E402
from flash_maxsim import _layout  # noqa: E402
from flash_maxsim.kernels import launch  # noqa: E402

ROWS = ("ColBERT in-batch B128", "ColBERT B64 + 7", "ColPali in-batch B64", "KD 64")


def null_scores(layout):
    """Scores of the right shape from one product of the first token of each query and document."""
    if layout == "kd":
        return lambda q, d: torch.einsum("qe,qbe->qb", q[:, 0], d[:, :, 0])
    return lambda q, d: torch.einsum("qe,be->qb", q[:, 0], d[:, 0])


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class Hollow(torch.autograd.Function):
    """``ops._EagerMaxSim``'s structure without its work: outputs and gradients are empty tensors."""

    @staticmethod
    def forward(ctx, queries, documents, queries_mask, documents_mask, offsets, max_length, candidates,
                zero_masked, smooth_tau):
        scores = queries.new_empty((queries.shape[0], documents.shape[-3]), dtype=torch.float32)
        aux = queries.new_empty((queries.shape[0], documents.shape[-3], queries.shape[1]), dtype=torch.int16)
        ctx.save_for_backward(queries, documents, queries_mask, documents_mask, offsets, aux)
        ctx.max_length, ctx.candidates, ctx.smooth_tau = max_length, candidates, smooth_tau
        ctx.mark_non_differentiable(aux)
        ctx.set_materialize_grads(False)
        return scores, aux

    @staticmethod
    def backward(ctx, grad_scores, _grad_aux):
        queries, documents, *_ = ctx.saved_tensors
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        return (torch.empty_like(queries) if need_q else None), (torch.empty_like(documents) if need_d else None), \
            None, None, None, None, None, None, None


def python_loop_us(n=1_000_000):
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return (time.perf_counter() - t) * 1e6 / n * 1e3     # ns per iteration


def profile(step, q, d, n=20):
    from torch.profiler import ProfilerActivity, profile as prof
    for _ in range(5):
        step(q, d)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            step(q, d)
        torch.cuda.synchronize()
    ka = p.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(ka.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60))


def main():
    torch.manual_seed(0)
    m = SimpleNamespace(device="cuda", dtype=torch.bfloat16)
    print(f"pure Python loop: {python_loop_us():.1f} ns per iteration")
    x = torch.ones(1, device="cuda", requires_grad=True)
    print(f"autograd.grad of x.sum() (one element, CUDA): {per_call_us(lambda: torch.autograd.grad(x.sum(), x)):.1f} us host")
    for shape in TRAIN_SHAPES:
        if not shape.name.startswith(ROWS):
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        doc_shape = (shape.Nq, shape.B, shape.Ld, shape.d) if shape.layout == "kd" else (shape.B, shape.Ld, shape.d)
        q = unit_tokens((shape.Nq, shape.Lq, shape.d), m, gen, True)
        d = unit_tokens(doc_shape, m, gen, True)
        loss = _loss_fn(shape, m, gen)
        ours = _train_step(lambda q, d: fm.maxsim(q, d), loss)
        null = _train_step(null_scores(shape.layout), loss)
        print(f"\n== {shape.name} (target {shape.target_ms} ms)")
        leaf = torch.zeros(shape.Nq, shape.B, device="cuda", requires_grad=True)

        def loss_alone(q, d):
            return torch.autograd.grad(loss(leaf), leaf)
        for label, step in (("ours", ours), ("loss alone", loss_alone), ("null step", null)):
            ms = bench(lambda: step(q, d))
            host = per_call_us(lambda: step(q, d), n=200)
            gpu = bench(graphed(lambda: step(q, d)).replay)
            print(f"{label:10s} do_bench {ms * 1e3:7.1f} us   host {host:7.1f} us   graph (GPU) {gpu * 1e3:7.1f} us")
        fwd_loss = per_call_us(lambda: loss(fm.maxsim(q, d)), n=200)
        with torch.no_grad():
            fwd_only = per_call_us(lambda: fm.maxsim(q, d), n=200)
        print(f"host: forward with autograd node + loss {fwd_loss:.1f} us; forward under no_grad {fwd_only:.1f} us")
        p = _layout.canonicalize(q.detach(), d.detach())
        args = (p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets)
        s, aux = launch.forward(*args, p.candidates, False, None, True, p.max_length)
        g = torch.ones_like(s)
        pieces = {
            "forward, no_grad": lambda: fm.maxsim(q, d),
            "launch.forward with aux": lambda: launch.forward(*args, p.candidates, False, None, True, p.max_length),
            "launch.backward": lambda: launch.backward(g, *args, p.max_length, aux, p.candidates, None, True, True),
        }
        pieces["forward with autograd node"] = lambda: fm.maxsim(q, d)
        pieces["forward + autograd.grad(scores, g)"] = lambda: torch.autograd.grad(fm.maxsim(q, d), (q, d), g)
        pieces["loss alone"] = lambda: loss_alone(q, d)
        pieces["hollow Function, no_grad"] = lambda: Hollow.apply(q, d, None, None, None, 0, 0, False, None)[0]
        pieces["hollow Function with autograd node"] = pieces["hollow Function, no_grad"]
        pieces["hollow + autograd.grad(scores, g)"] = lambda: torch.autograd.grad(
            Hollow.apply(q, d, None, None, None, 0, 0, False, None)[0], (q, d), g)
        for name, fn in pieces.items():
            grad_mode = torch.no_grad() if name in ("forward, no_grad", "launch.forward with aux",
                                                    "launch.backward", "hollow Function, no_grad") \
                else torch.enable_grad()
            with grad_mode:
                us = sorted(per_call_us(fn, n=100) for _ in range(5))
            print(f"piece {name:38s} host {us[2]:7.1f} us (min {us[0]:.1f}, max {us[-1]:.1f})")
        p = args = s = aux = g = None
        profile(ours, q, d)
        q = d = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
