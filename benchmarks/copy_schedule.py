"""Where ptxas puts the TMA re-arm and the next tile's copy in a forward kernel's tile loop, offline (no GPU): the
kernel of one ``offline_compile.py`` case (default: the int8 index's compute-bound default), as the Triton on the path
compiles it for sm_90a, its PTX assembled again by each ptxas named, with and without the option Triton 3.9 adds.

    python benchmarks/copy_schedule.py [--case NAME] [--stages N] [--ptxas PATH ...] [--ptx FILE] [--ptx-version 8.7]

For each assembly it prints the tile loop's length in instructions (the innermost loop that holds the tensor-core
products, in address order) and the positions in it of the wait on the tile's TMA barrier, the re-arm of a stage's
barrier, the next copy and the CTA barriers.

Why (docs/perf-notes.md, sessions 44-45): from Triton 3.8 the int8 1024x1024 row is slower than under 3.6, and most of
it is the wait for each tile's copy, which 3.8 and 3.9 issue at the tile's end and 3.6 three quarters in. On 3 stages
(the default since session 44) 3.6's PTX gets its copy late from 3.9's ptxas (CUDA 13.4) too, and 3.9's ptxas sinks a
copy moved by hand to the top of its PTX: a compiler's schedule, to check again on each new Triton or ptxas. ``--ptx``
assembles a PTX file given (a hand edit); ``--ptx-version`` lowers its ``.version`` line so that an older ptxas reads
it. Not timed: for what a schedule is worth on the GPU see ``ptx_edit_probe.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import offline_compile as oc  # noqa: E402  (a sibling script: the cases, the compiler call, SASS parsing)

DEFAULT_CASE = "int8 1x4k 1024x1024 (runs of documents by TMA)"
#: the option Triton 3.9 gives ptxas with every compilation (a workaround for a ptxas 13 bug, says its compiler.py)
REG_ALLOC_OPTION = "--regAllocOptLevel=2"

_MARKS = {"SYNCS.PHASECHK": "wait", "SYNCS.ARRIVE": "re-arm", "UTMALDG": "copy", "BAR.SYNC": "barrier"}


def tile_loop_marks(sass: str) -> dict:
    """The tile loop of a kernel's SASS (the innermost backward-branch loop around the first ``WARPGROUP.ARRIVE``)
    and the positions in it, in address order, of each instruction kind in ``_MARKS``: ``{"instructions": n,
    "wait": [...], "re-arm": [...], "copy": [...], "barrier": [...]}``."""
    code = oc.sass_code(sass)
    first_product = next(a for a, text in code if "WARPGROUP.ARRIVE" in text)
    spans = [(lo, hi) for lo, hi in oc.sass_back_branch_spans(code) if lo <= first_product <= hi]
    if not spans:
        raise ValueError("no loop around the kernel's tensor-core products")
    lo, hi = min(spans, key=lambda span: span[1] - span[0])
    body = [text for addr, text in code if lo <= addr <= hi]
    marks: dict = {"instructions": len(body), **{name: [] for name in _MARKS.values()}}
    for i, text in enumerate(body):
        op = oc.sass_opcode(text)
        for prefix, name in _MARKS.items():
            if op.startswith(prefix):
                marks[name].append(i)
    return marks


def default_ptxas() -> str:
    """The ptxas this Triton runs for sm_90 (3.9: ``ptxas-blackwell``, CUDA 13; 3.6-3.8: ``ptxas``)."""
    from triton.backends.nvidia import compiler
    return compiler.get_ptxas(90).path


def ptxas_version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def assemble(ptx: str, ptxas: str, options=()) -> bytes:
    """The cubin ``ptxas`` makes of ``ptx`` for sm_90a, with the options every Triton gives it (line info, verbose)
    and ``options``."""
    with tempfile.TemporaryDirectory() as folder:
        src, out = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-lineinfo", "-v", *options, "--gpu-name=sm_90a", src, "-o", out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-600:])
        with open(out, "rb") as f:
            return f.read()


def compiled_ptx(case_name: str, stages: "int | None" = None) -> str:
    """The PTX of the forward kernel of ``offline_compile.py``'s case ``case_name`` for sm_90a (with ``stages``
    pipeline stages in place of the launcher's, if given), compiled by the Triton on the path."""
    from triton.backends.compiler import GPUTarget

    case = next((c for c in oc.CASES if c.name == case_name), None)
    if case is None:
        raise SystemExit(f"no offline_compile.py case named {case_name!r}")
    if stages is not None:
        case = dataclasses.replace(case, forward_overrides={**(case.forward_overrides or {}), "num_stages": stages})
    calls = [c for c in oc.record_launches(case, 132, 90) if c[0].__name__.startswith("maxsim_fwd")]
    return oc.compile_call(calls[0], GPUTarget("cuda", 90, 32)).asm["ptx"]


def schedules(ptx: str, ptxas_paths) -> list:
    """One row per ptxas and option set: ``{"ptxas", "version", "options", **tile_loop_marks}``."""
    rows = []
    for ptxas in ptxas_paths:
        version = ptxas_version(ptxas)
        for options in ((), (REG_ALLOC_OPTION,)):
            try:
                marks = tile_loop_marks(oc._cuobjdump(assemble(ptx, ptxas, options), "-sass"))
            except RuntimeError as exc:      # e.g. an older ptxas and a newer PTX .version
                marks = {"error": str(exc)}
            rows.append({"ptxas": ptxas, "version": version, "options": list(options), **marks})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default=DEFAULT_CASE, help="an offline_compile.py case name")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages instead of the launcher's choice")
    ap.add_argument("--ptxas", nargs="*", default=[], help="more ptxas binaries (e.g. another Triton's)")
    ap.add_argument("--ptx", default=None, help="assemble this PTX file instead of compiling the case")
    ap.add_argument("--ptx-version", default=None, help="rewrite the PTX's .version line (e.g. 8.7 for CUDA 12.8)")
    args = ap.parse_args(argv)

    import triton
    if args.ptx:
        with open(args.ptx) as f:
            ptx = f.read()
    else:
        ptx = compiled_ptx(args.case, args.stages)
    if args.ptx_version:
        ptx = re.sub(r"^\.version \S+", f".version {args.ptx_version}", ptx, count=1, flags=re.M)
    source = args.ptx or f"{args.case!r} under Triton {triton.__version__}" + (
        f", {args.stages} stages" if args.stages else "")
    print(f"PTX: {source}")
    for row in schedules(ptx, [default_ptxas(), *args.ptxas]):
        head = f"ptxas {row['version']} {' '.join(row['options']) or '(no extra option)'}"
        if "error" in row:
            print(f"{head}: {row['error']}")
            continue
        where = "  ".join(f"{name} {row[name]}" for name in ("wait", "re-arm", "copy", "barrier"))
        print(f"{head}: tile loop {row['instructions']} instructions; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
