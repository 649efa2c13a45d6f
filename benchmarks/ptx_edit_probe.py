"""What a hand edit of a forward kernel's PTX is worth, on the device: the kernel that scores one row (default: the
int8 index's 1x10k 1024x1024, compute-bound) as the Triton on the path compiles it, against copies of its PTX with
named edits, each compiled by that Triton through its ``ir_override`` option, timed in interleaved rounds in one
process; every copy's scores must equal the unedited kernel's bit for bit.

    python benchmarks/ptx_edit_probe.py [--row "int8 1x10000 1024x1024"] [--edits all] [--rounds 5] [--clocks]
    python benchmarks/ptx_edit_probe.py --show-edits FILE.ptx     # here, offline: what each edit changes

Why (docs/perf-notes.md, sessions 43-44): from Triton 3.8 the int8 compute-bound loop's PTX has one CTA barrier
more per tile than under 3.6 (a ``bar.sync`` right before re-arming the stage's TMA barrier), and its scales'
barrier after the wait on the tile's TMA barrier instead of before it. The row is 5.5-8% slower under 3.8 / 3.9.
The edits put those two barriers where 3.6 has them: what that is worth bounds what a source change avoiding them
could gain. An edit is a probe, not a fix: the barrier it deletes is redundant in this kernel only because the
scales' layout conversion already puts one between every thread's wait and the re-arm. Not the published
benchmark (benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# instructions scanned for the barrier next to the wait or the re-arm: they sit within a few address computations
_NEAR = 8


def _is_instruction(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith(("//", ".loc", "$L__", "{", "}", ".reg", "waitLoop:"))


def _loop_span(lines: list) -> tuple:
    """First and last line of the main tile loop: from the first ``mbarrier.try_wait`` to the first
    ``mbarrier.arrive.expect_tx`` after a ``wgmma.wait_group`` (the prologue's re-arm comes before any product)."""
    wait = next(i for i, s in enumerate(lines) if "mbarrier.try_wait.parity" in s)
    products = next(i for i in range(wait, len(lines)) if "wgmma.wait_group" in lines[i])
    rearm = next(i for i in range(products, len(lines)) if "mbarrier.arrive.expect_tx" in lines[i])
    return wait, rearm


def _barrier_near(lines: list, start: int, step: int) -> "int | None":
    """The line of the ``bar.sync`` within ``_NEAR`` instructions of ``start`` (exclusive) going by ``step``."""
    seen, i = 0, start + step
    while 0 <= i < len(lines) and seen < _NEAR:
        if _is_instruction(lines[i]):
            if lines[i].strip().startswith("bar.sync"):
                return i
            if lines[i].strip().startswith(("mbarrier", "wgmma", "cp.async", "bra", "@")):
                return None
            seen += 1
        i += step
    return None


def _asm_block_start(lines: list, at: int) -> int:
    """The ``// begin inline asm`` line that opens the block holding line ``at``."""
    return max(i for i in range(at + 1) if "begin inline asm" in lines[i])


def _asm_block_end(lines: list, at: int) -> int:
    return next(i for i in range(at, len(lines)) if "end inline asm" in lines[i])


def drop_rearm_barrier(ptx: str) -> "str | None":
    """Delete the ``bar.sync`` just before the loop's ``mbarrier.arrive.expect_tx`` (Triton 3.8+); None if absent."""
    lines = ptx.split("\n")
    _, rearm = _loop_span(lines)
    bar = _barrier_near(lines, _asm_block_start(lines, rearm), -1)
    if bar is None:
        return None
    del lines[bar]
    return "\n".join(lines)


def barrier_before_wait(ptx: str) -> "str | None":
    """Move the ``bar.sync`` just after the loop's wait on its TMA barrier to just before that wait (where Triton
    3.6 has it); None if there is none after it."""
    lines = ptx.split("\n")
    wait, _ = _loop_span(lines)
    bar = _barrier_near(lines, _asm_block_end(lines, wait), 1)
    if bar is None:
        return None
    line = lines.pop(bar)
    lines.insert(_asm_block_start(lines, wait), line)
    return "\n".join(lines)


def both(ptx: str) -> "str | None":
    first = drop_rearm_barrier(ptx)
    return barrier_before_wait(first) if first is not None else None


EDITS = {"no-rearm-barrier": drop_rearm_barrier, "barrier-before-wait": barrier_before_wait, "both": both}


def _compiled_kernels():
    """Every CompiledKernel of flash_maxsim's forward kernels, from Triton's per-device caches."""
    from flash_maxsim.kernels import forward, forward_token_rows
    from flash_maxsim.kernels._launcher import compiled_kernels
    for module in (forward, forward_token_rows):
        for obj in vars(module).values():
            yield from compiled_kernels(obj)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="int8 1x10000 1024x1024", help="an ab_forward.py row name (its prefix)")
    ap.add_argument("--edits", default="all", help="comma-separated names of EDITS, or all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clocks", action="store_true", help="each timed pass with the GPU's clocks and power")
    ap.add_argument("--keep", help="directory for the original and edited PTX (default: a temporary one)")
    ap.add_argument("--show-edits", metavar="PTX", help="offline: print each edit's diff of this PTX file and exit")
    args = ap.parse_args(argv)
    names = list(EDITS) if args.edits == "all" else args.edits.split(",")
    if args.show_edits:
        import difflib
        text = open(args.show_edits).read()
        for name in names:
            edited = EDITS[name](text)
            print(f"== {name}: " + ("not applicable" if edited is None else "edited"))
            if edited is not None:
                print("\n".join(difflib.unified_diff(text.split("\n"), edited.split("\n"), lineterm="", n=2)))
        return 0

    import torch
    import triton
    sys.path.insert(0, HERE)
    import ab_forward
    import flash_maxsim as fm
    from flash_maxsim import _layout
    from flash_maxsim.kernels import _launcher, launch

    Nq, B, Lq, Ld, d, kind = next(r for r in ab_forward.ROWS
                                  if f"{r[5] or 'bf16'} {r[0]}x{r[1]} {r[2]}x{r[3]}".startswith(args.row))
    torch.manual_seed(0)
    q = torch.randn(Nq, Lq, d, device="cuda", dtype=torch.bfloat16)
    docs = torch.randn(B, Ld, d, device="cuda", dtype=torch.bfloat16)
    if kind:
        docs = fm.quantize(docs, dtype=kind)
    p = _layout.canonicalize(q, docs, None, None, masked="exclude", smooth_tau=None)
    # Triton's own launch path, so that each entry's compile options pick its kernel (the package's direct launches
    # key on the launch plan, which is the same for every entry): the same host path for all of them
    _launcher._enabled = False
    want = ab_forward.forward_scores(launch, p)
    kernels = [k for k in _compiled_kernels() if "mbarrier.arrive.expect_tx" in k.asm.get("ptx", "")]
    if len(kernels) != 1:
        print(f"expected one forward kernel with TMA copies, found {len(kernels)}")
        return 1
    ptx = kernels[0].asm["ptx"]
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, row {args.row}: kernel "
          f"{kernels[0].name}, {kernels[0].n_regs} registers", flush=True)
    with contextlib.ExitStack() as stack:
        folder = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "original.ptx"), "w") as f:
            f.write(ptx)

        def use(path):
            def before():
                _launcher.COMPILE_OPTIONS.pop("ir_override", None)
                if path:
                    _launcher.COMPILE_OPTIONS["ir_override"] = path
            return before
        def score():
            return ab_forward.forward_scores(launch, p)
        entries = [("default", score, use(None))]
        for name in names:
            edited = EDITS[name](ptx)
            if edited is None:
                print(f"edit {name}: not applicable to this PTX", flush=True)
                continue
            path = os.path.join(folder, f"{name}.ptx")
            with open(path, "w") as f:
                f.write(edited)
            entries.append((name, score, use(path)))
        clocks = None
        if args.clocks:
            from gpu_clocks import ClockSampler, smi_id
            clocks = stack.enter_context(ClockSampler(index=smi_id()))
        try:
            times = ab_forward.time_interleaved(entries, want, args.rounds, tol=0.0, clocks=clocks)
        finally:
            _launcher.COMPILE_OPTIONS.pop("ir_override", None)
    print(f"ptx {args.row} (triton {triton.__version__}): {ab_forward.ranked_line(times, 'default')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
