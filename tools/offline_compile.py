"""Compile the kernels for a GPU on a machine without one: every specialisation the launcher picks for a set of
problems that covers its tile choices (bandwidth- and compute-bound scoring, long documents split over programs,
the several-documents loop, int8 x int8 products, converted int8 / fp8, CUDA-core fp32, masks, ragged, paired,
smooth max, training forward and backward), compiled by Triton for the target down to a cubin, and reported:
registers, the stack frame (where ptxas spills registers), local arrays, shared memory, the tensor-core
instructions in the PTX, the shared-memory copies made inside loops (TTGIR), the instructions of each innermost
loop in the SASS (per iteration and thread: a tile loop's cost, counted before and after a change), and a digest
of the code (equal before and after a refactor: the compiled kernels did not change).

    python tools/offline_compile.py [--arch 90] [--sms 132] [--only TEXT] [--json OUT.json]

Why: the CPU interpreter runs the kernels' arithmetic but never the compiler, so a kernel change can pass every
CPU test and still fail to compile, spill, or lose its tensor-core path on the GPU. This catches those without a
GPU (tools/tests/test_offline_compile.py runs it). It does not time anything.

Nothing is launched: the launcher is replaced by a recorder while the real host code (layout, tile choice,
launch plans) runs on CPU tensors that are never read (``torch.empty``, so the large shapes cost no memory). The
SM count is the target's (``--sms``), since tile choices depend on it. Needs Triton's NVIDIA backend (its bundled
ptxas and cuobjdump) and TRITON_INTERPRET unset. Uses Triton internals (the kernel's argument binder), pinned to
the version CI installs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

import flash_maxsim as fm
from flash_maxsim import _layout, ops
from flash_maxsim.kernels import direct_launch, launch, tuning

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass
class Case:
    """One problem. ``build`` returns (queries, documents, queries_mask, documents_mask)."""

    name: str
    build: Callable
    masked: str = "exclude"
    smooth_tau: Optional[float] = None
    training: bool = False                       # forward saving the arg-max / log-sum-exp, then both gradients
    fp32_precision: str = "highest"
    forward_overrides: dict = field(default_factory=dict)
    backward_overrides: dict = field(default_factory=dict)
    min_arch: int = 0                            # fp8 documents need 89


def _q(nq, lq, d, dt=BF16):
    return torch.empty(nq, lq, d, dtype=dt)


def _docs(b, ld, d, dt=BF16):
    return torch.empty(b, ld, d, dtype=dt)


def _mask(*shape):
    m = torch.ones(shape, dtype=torch.bool)
    m[..., -1] = False
    return m


# the quantized cases' scale dtype: bf16, as flash_maxsim.quantize stores them (--scale-dtype fp32: an index with
# fp32 scales)
scale_dtype = BF16


def _quantized(b, ld, d, kind="int8", mask=False):
    values = torch.empty(b, ld, d, dtype=torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    return fm.QuantizedDocuments(values=values, scales=torch.empty(b, ld, dtype=scale_dtype),
                                 mask=_mask(b, ld) if mask else None, kind=kind)


def _ragged(lengths, d, dt=BF16):
    return [torch.empty(n, d, dtype=dt) for n in lengths]


# the 256-row tiles with one document per program instead of the peeled runs (kernels/tuning.py, PEELED_RUNS)
_ONE_DOCUMENT = tuning.ONE_DOCUMENT_PER_PROGRAM
# the training forward's hard max with one max per row and the threads' copies, instead of its partial (max,
# arg-max) pairs and TMA copies
_ONE_MAX_PER_ROW = dict(ROW_PARTIALS=1, TMA_ONE_DOC=False)

CASES = [
    # scoring, bf16 unless said; the sizes are the smallest that keep the tile choice of the benchmark row named
    Case("bf16 1x1k 32x300", lambda: (_q(1, 32, 128), _docs(1000, 300, 128), None, None)),
    Case("bf16 1x2k 32x300 (streaming on 2 warps)", lambda: (_q(1, 32, 128), _docs(2000, 300, 128), None, None)),
    # the default: a share of the documents per program (2 per SM), each peeled, 16-token tails, the whole tiles
    # copied by TMA (and copied by the threads)
    Case("bf16 64x1k 32x300 (256 rows)", lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None)),
    Case("bf16 64x1k 32x300 (256 rows) peeled runs, copied by the threads",
         lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None), forward_overrides=dict(TMA_DOCS=False)),
    # one document per program, and the variants measured against it
    Case("bf16 64x1k 32x300 (256 rows) one document per program",
         lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None), forward_overrides=_ONE_DOCUMENT),
    # with one running max per row (no partial row maxima)
    Case("bf16 64x1k 32x300 (256 rows) one max per row", lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None,
                                                                  None), forward_overrides=dict(_ONE_DOCUMENT,
                                                                                                ROW_PARTIALS=1)),
    # the peeled tail in 16- or 32-token tiles (TAIL_N): 48 columns for the last 44 tokens
    Case("bf16 64x1k 32x300 (256 rows) 16-token tail", lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None),
         forward_overrides=dict(_ONE_DOCUMENT, TAIL_N=16)),
    Case("bf16 64x1k 32x300 (256 rows) 32-token tail", lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None),
         forward_overrides=dict(_ONE_DOCUMENT, TAIL_N=32)),
    # several documents per program, a loop per document with its last tile peeled (PEEL_EACH_DOC): the query tile
    # loaded once per program
    Case("bf16 64x1k 32x300 (256 rows) 4 documents, each peeled",
         lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None),
         forward_overrides=dict(_ONE_DOCUMENT, DOCS=4, PEEL_EACH_DOC=True)),
    Case("bf16 64x1k 32x300 (256 rows) 4 documents, each peeled, 128 registers",
         lambda: (_q(64, 32, 128), _docs(1000, 300, 128), None, None),
         forward_overrides=dict(_ONE_DOCUMENT, DOCS=4, PEEL_EACH_DOC=True, MAXNREG=128)),
    Case("bf16 1x300 1024x1024 (256 rows)", lambda: (_q(1, 1024, 128), _docs(300, 1024, 128), None, None)),
    Case("bf16 16x32 32x8192 (token split)", lambda: (_q(16, 32, 128), _docs(32, 8192, 128), None, None)),
    Case("bf16 smooth 4x8 32x4096 masks (token split)", lambda: (_q(4, 32, 128), _docs(8, 4096, 128), _mask(4, 32),
                                                                  _mask(8, 4096)), smooth_tau=0.1),
    Case("bf16 d=384 1x1k 32x180", lambda: (_q(1, 32, 384), _docs(1000, 180, 384), None, None)),
    Case("bf16 d=96 masks zero", lambda: (_q(2, 31, 96), _docs(50, 257, 96), _mask(2, 31), _mask(50, 257)),
         masked="zero"),
    Case("bf16 1x300 128x1024 (runs on 8 warps)", lambda: (_q(1, 128, 128), _docs(300, 1024, 128), None, None)),
    Case("bf16 d=96 1x2.1k 31x257 (runs of 8 per SM)",
         lambda: (_q(1, 31, 96), _docs(2100, 257, 96), None, None)),
    Case("bf16 d=1024", lambda: (_q(2, 7, 1024), _docs(3, 33, 1024), None, None)),
    Case("fp16 ragged masks", lambda: (_q(3, 20, 128, FP16), _ragged([5, 70, 33], 128, FP16), _mask(3, 20),
                                       [_mask(5), _mask(70), _mask(33)])),
    Case("bf16 paired K=8 masks", lambda: (_q(4, 32, 128), _docs(4 * 8, 300, 128).view(4, 8, 300, 128),
                                           None, _mask(4, 8, 300))),
    Case("bf16 smooth zero", lambda: (_q(4, 32, 128), _docs(64, 1030, 128), None, _mask(64, 1030)),
         masked="zero", smooth_tau=0.1),
    Case("fp32 highest (CUDA cores)", lambda: (_q(4, 32, 128, FP32), _docs(100, 180, 128, FP32), None, None)),
    Case("fp32 tf32", lambda: (_q(4, 32, 128, FP32), _docs(100, 180, 128, FP32), None, None),
         fp32_precision="high"),
    # compressed index
    # runs of documents: the token-rows kernel on Hopper (kernels/forward_token_rows.py), the tile kernel elsewhere
    Case("int8 1x3k 32x300 (several documents per program)", lambda: (_q(1, 32, 128), _quantized(3000, 300, 128),
                                                                None, None)),
    Case("int8 1x3k 32x300 tile kernel (several documents per program)",
         lambda: (_q(1, 32, 128), _quantized(3000, 300, 128), None, None), forward_overrides={"TOKEN_ROWS": False}),
    # the default: whole tiles' sums read as fp32 bits (kernels/forward.py, _tile_similarities), on 3 stages
    Case("int8 1x4k 1024x1024 (runs of documents by TMA)", lambda: (_q(1, 1024, 128), _quantized(4000, 1024, 128),
                                                                  None, None)),
    Case("int8 1x300 1024x1024 masked", lambda: (_q(1, 1024, 128), _quantized(300, 1024, 128, mask=True),
                                                 None, None)),
    # 4 partial row maxima over column pairs (an option): no more registers than one max per row
    Case("int8 1x4k 1024x1024 partial maxima over pairs", lambda: (_q(1, 1024, 128), _quantized(4000, 1024, 128),
                                                                   None, None), forward_overrides={"ROW_PARTIALS": 4}),
    # the bit-cast sums' tile max by tl.max (a tree from Triton 3.8), not folded in a fixed chain (the default)
    Case("int8 1x4k 1024x1024 tile max by tl.max", lambda: (_q(1, 1024, 128), _quantized(4000, 1024, 128), None,
                                                            None), forward_overrides={"CHAINED_MAX": False}),
    # the same grid with the sums converted, and the bit-cast sums where they are an option
    Case("int8 1x4k 1024x1024 converted sums", lambda: (_q(1, 1024, 128), _quantized(4000, 1024, 128), None, None),
         forward_overrides={"BITCAST_SUMS": False, "num_stages": 3}),
    Case("int8 1x3k 32x300 bit-cast sums", lambda: (_q(1, 32, 128), _quantized(3000, 300, 128), None, None),
         forward_overrides={"BITCAST_SUMS": True, "TOKEN_ROWS": False}),
    Case("int8 1x4k 1030x1030 masked bit-cast sums (straddling)",
         lambda: (_q(1, 1030, 128), _quantized(4000, 1030, 128, mask=True), None, None),
         forward_overrides={"BITCAST_SUMS": True}),
    Case("int8 1x4k 1030x1030 masked (straddling)",
         lambda: (_q(1, 1030, 128), _quantized(4000, 1030, 128, mask=True), None, None)),
    Case("int8 d=16 (products over 32 zero-padded features)", lambda: (_q(3, 4, 16), _quantized(7, 9, 16),
                                                                      None, None)),
    Case("int8 converted", lambda: (_q(1, 32, 128), _quantized(1000, 300, 128), None, None),
         forward_overrides={"INT8_PRODUCTS": False}),
    Case("int8 d=384 (converted)", lambda: (_q(1, 32, 384), _quantized(1000, 180, 384), None, None)),
    # fp8 x fp8 products: one document per program, runs of documents (the streaming grid), the compute-bound grid
    # (queries quantised first, TMA), and the conversion to the queries' dtype they replace
    Case("fp8 1x500 32x300", lambda: (_q(1, 32, 128), _quantized(500, 300, 128, kind="fp8"), None, None),
         min_arch=89),
    Case("fp8 1x3k 32x300 (runs of documents)", lambda: (_q(1, 32, 128), _quantized(3000, 300, 128, kind="fp8"),
                                                        None, None), min_arch=89),
    Case("fp8 1x3k 32x300 tile kernel (runs of documents)",
         lambda: (_q(1, 32, 128), _quantized(3000, 300, 128, kind="fp8"), None, None), min_arch=89,
         forward_overrides={"TOKEN_ROWS": False}),
    Case("fp8 1x4k 1024x1024 (runs of documents by TMA)",
         lambda: (_q(1, 1024, 128), _quantized(4000, 1024, 128, kind="fp8"), None, None), min_arch=89),
    # its 8 partial maxima per row by tl.reduce (a tree from Triton 3.8), not folded in a fixed chain (the default
    # from Triton 3.8)
    Case("fp8 1x4k 1024x1024 partial maxima by tl.reduce",
         lambda: (_q(1, 1024, 128), _quantized(4000, 1024, 128, kind="fp8"), None, None), min_arch=89,
         forward_overrides={"CHAINED_MAX": False}),
    Case("fp8 converted", lambda: (_q(1, 32, 128), _quantized(1000, 300, 128, kind="fp8"), None, None),
         min_arch=89, forward_overrides={"FP8_PRODUCTS": False}),
    # training: forward saving what the backward needs, then dQ and dD
    Case("train bf16 in-batch B128 32x300", lambda: (_q(128, 32, 128), _docs(128, 300, 128), _mask(128, 32),
                                                     _mask(128, 300)), training=True),
    # the training forward on long documents: 256-row tiles, 3 stages, 16-token tail tiles
    Case("train bf16 ColPali B64 32x1030 (256 rows)", lambda: (_q(64, 32, 128), _docs(64, 1030, 128), None, None),
         training=True),
    # the training forward's hard max with one max and arg-max per row and the threads' copies, beside the default
    # (partial (max, arg-max) pairs per row, whole tiles copied by TMA)
    Case("train bf16 in-batch B128 32x300, one max per row", lambda: (_q(128, 32, 128), _docs(128, 300, 128),
                                                                      _mask(128, 32), _mask(128, 300)),
         training=True, forward_overrides=_ONE_MAX_PER_ROW),
    Case("train bf16 ColPali B64 32x1030 (256 rows), one max per row",
         lambda: (_q(64, 32, 128), _docs(64, 1030, 128), None, None), training=True,
         forward_overrides=_ONE_MAX_PER_ROW),
    Case("train bf16 B64 + 7 negatives 32x300", lambda: (_q(64, 32, 128), _docs(512, 300, 128), None, None),
         training=True),
    Case("train bf16 B64 + 7 negatives 32x300, one max per row",
         lambda: (_q(64, 32, 128), _docs(512, 300, 128), None, None), training=True,
         forward_overrides=_ONE_MAX_PER_ROW),
    Case("train bf16 smooth ColPali B16", lambda: (_q(16, 32, 128), _docs(16, 1030, 128), None,
                                                   _mask(16, 1030)), masked="zero", smooth_tau=0.1, training=True),
    # the benchmark's smooth row (no masks): the gradients' streamed tiles loaded once
    Case("train bf16 smooth ColPali B16 unmasked", lambda: (_q(16, 32, 128), _docs(16, 1030, 128), None, None),
         smooth_tau=0.1, training=True),
    Case("train bf16 smooth ColPali B16 unmasked, tiles loaded twice",
         lambda: (_q(16, 32, 128), _docs(16, 1030, 128), None, None), smooth_tau=0.1, training=True,
         backward_overrides={"RELOAD_TILE": True}),
    Case("train bf16 KD 8x8 paired", lambda: (_q(8, 32, 128), _docs(64, 300, 128).view(8, 8, 300, 128),
                                              None, None), training=True),
    Case("train fp16 ragged", lambda: (_q(3, 20, 128, FP16), _ragged([5, 70, 33], 128, FP16), None, None),
         training=True),
    Case("train fp32 d=96", lambda: (_q(2, 31, 96, FP32), _docs(6, 57, 96, FP32), None, None), training=True),
    Case("train bf16 d=384", lambda: (_q(2, 13, 384), _docs(3, 40, 384), None, None), training=True),
    Case("train bf16 sparse dD", lambda: (_q(4, 32, 128), _docs(8, 300, 128), None, None), training=True,
         backward_overrides={"DD_METHOD": "sparse"}),
    # the binned dD (the default for documents of 1024 tokens or 1024 arg-max entries or more; forced on the 300-token
    # candidates): one program per 64-token block picks its entries out of the document's (8192 at ColPali B256) and
    # multiplies them; the hard-max dQ in its own launch a gather of several columns per step
    Case("train bf16 ColPali B256", lambda: (_q(256, 32, 128), _docs(256, 1030, 128), None, None), training=True),
    Case("train bf16 KD 8x8 paired binned dD", lambda: (_q(8, 32, 128), _docs(64, 300, 128).view(8, 8, 300, 128),
                                                        None, None), training=True,
         backward_overrides={"DD_METHOD": "binned"}),
    # the hard-max dQ a row at a time in its own launch, the gather on ragged documents beside the binned dD, and
    # over feature slices (d = 384)
    Case("train bf16 B64 + 7 negatives 32x300, dQ a row at a time",
         lambda: (_q(64, 32, 128), _docs(512, 300, 128), None, None), training=True,
         backward_overrides={"DQ_METHOD": "rows"}),
    Case("train fp16 ragged binned dD", lambda: (_q(3, 20, 128, FP16), _ragged([5, 70, 33], 128, FP16), None, None),
         training=True, backward_overrides={"DD_METHOD": "binned"}),
    Case("train bf16 d=384 dQ gather", lambda: (_q(2, 13, 384), _docs(3, 40, 384), None, None), training=True,
         backward_overrides={"FUSED": False}),
    Case("train bf16 dD, gradient not split", lambda: (_q(4, 32, 128), _docs(8, 300, 128), _mask(4, 32),
                                                        _mask(8, 300)), training=True,
         backward_overrides={"G_SPLIT": False, "DD_STAGES": 2}),
    Case("train bf16 dQ and dD in separate launches", lambda: (_q(16, 32, 128), _docs(16, 300, 128), _mask(16, 32),
                                                                _mask(16, 300)),
         training=True, backward_overrides={"FUSED": False}),
]


@contextlib.contextmanager
def launches_recorded(sms: int, fp32_precision: str = "highest", forward_overrides=None, backward_overrides=None,
                      keep_tensors: bool = True, capability: tuple = (9, 0)):
    """The library's GPU host path on CPU tensors, with every kernel launch recorded instead of run: calls go
    to the Triton backend whatever the device, the launcher appends (kernel, grid, tensors, scalars, meta) to the
    list yielded (without the tensors unless ``keep_tensors``: holding them would change what memory is alive),
    the tile policy tunes for the target's SM count and compute capability. Outputs hold whatever memory they were
    allocated with."""
    calls = []
    saved = (direct_launch.launch, torch.get_float32_matmul_precision(), ops._forced_backend)
    direct_launch.launch = lambda kernel, grid, tensors, scalars, meta, meta_key=None, plan=None: \
        calls.append((kernel, grid, tensors if keep_tensors else None, scalars, dict(meta)))
    ops._forced_backend = "triton"        # not force_backend(): it refuses without CUDA, rightly for real runs
    torch.set_float32_matmul_precision(fp32_precision)
    try:
        with tuning.override_target(sms=sms, capability=capability), \
                tuning.override_forward(**(forward_overrides or {})), \
                tuning.override_backward(**(backward_overrides or {})):
            yield calls
    finally:
        direct_launch.launch, ops._forced_backend = saved[0], saved[2]
        torch.set_float32_matmul_precision(saved[1])


def record_launches(case: Case, sms: int, arch: int = 90) -> list:
    """The (kernel, grid, tensors, scalars, meta) of every launch the library makes for ``case``."""
    queries, documents, qmask, dmask = case.build()
    p = _layout.canonicalize(queries, documents, qmask, dmask, masked=case.masked, smooth_tau=case.smooth_tau)
    with launches_recorded(sms, case.fp32_precision, case.forward_overrides, case.backward_overrides,
                           capability=(arch // 10, arch % 10)) as calls:
        _, aux = launch.forward(p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets, p.candidates,
                                case.masked == "zero", case.smooth_tau, case.training, p.max_length,
                                p.document_scales)
        if case.training:
            # the recorder ran nothing: an arg-max that is valid for the sparse dD kernel's host-side sort
            if aux.dtype == torch.int32:
                aux.zero_()
            grad = torch.empty(p.queries.shape[0], p.num_columns, dtype=FP32)
            launch.backward(grad, p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets,
                            p.max_length, aux, p.candidates, case.smooth_tau, True, True)
    return calls


_MMA = re.compile(r"\b(wgmma\.mma_async|mma\.sync)(\.[\w]+)*")
_OPERAND_TYPES = re.compile(r"\.(s8|u8|bf16|f16|tf32|e4m3|e5m2)\b")


def mma_kinds(ptx: str) -> dict:
    """Tensor-core instructions in a PTX text: {'wgmma s8': count, 'mma.sync bf16': count, ...}."""
    kinds: dict = {}
    for m in _MMA.finditer(ptx):
        text = m.group(0)
        types = _OPERAND_TYPES.findall(text)
        key = ("wgmma" if text.startswith("wgmma") else "mma.sync") + " " + (types[-1] if types else "?")
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def code_digest(ptx: str) -> str:
    """A digest of the PTX's instructions, without source locations and debug sections: equal digests mean a
    change (a refactor, say) left the compiled kernel as it was."""
    body = ptx.split("\t.section\t.debug")[0]
    lines = (line.split("//")[0].strip() for line in body.splitlines())
    # "$L__tmp" labels only anchor the debug line table
    kept = "\n".join(line for line in lines if line and not line.startswith((".loc", ".file", "$L__tmp")))
    return hashlib.sha256(kept.encode()).hexdigest()[:16]


_ALLOC_FROM_REGISTERS = re.compile(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+x\w+)")


def loop_allocations(ttgir: str) -> list:
    """The shared-memory copies of register values made inside a loop (``ttg.local_alloc`` of a tensor within an
    ``scf.for``), as their shapes (``"32x128xi8"``): a tensor-core operand copied there is stored again every
    iteration, where a loop-invariant one (a query tile) belongs before the loop (Triton 3.9 keeps it inside when a
    transpose of it is)."""
    scopes, found = [], []
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}") and scopes:
            scopes.pop()
        if "for" in scopes:
            found += _ALLOC_FROM_REGISTERS.findall(text)
        if text.endswith("{"):
            scopes.append("for" if "scf.for" in text else "other")
    return found


def _cuobjdump(cubin: bytes, option: str) -> str:
    """What Triton's bundled cuobjdump prints for a cubin with ``option`` (``-res-usage``, ``-sass``)."""
    from triton.backends.nvidia import compiler as nvidia_compiler
    tool = os.path.join(os.path.dirname(nvidia_compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout


def _resource_usage(cubin: bytes) -> dict:
    """Registers, ``local_bytes`` (local arrays: none expected) and ``stack_bytes`` (the frame ptxas spills registers
    to; spill instructions inside a tile loop show in ``sass_loops``' counts of STL / LDL)."""
    out = _cuobjdump(cubin, "-res-usage")
    usage = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", out)}
    return {"registers": usage.get("reg", -1), "local_bytes": usage.get("local", -1),
            "stack_bytes": usage.get("stack", -1)}


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BACK_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


def sass_code(sass: str) -> list:
    """A SASS listing (cuobjdump ``-sass``) as ``[(address, instruction text)]``, in address order."""
    return [(int(a, 16), text.strip()) for a, text in _SASS_LINE.findall(sass)]


def sass_opcode(text: str) -> str:
    """An instruction's opcode, its predicate (``@P0``, ``@!UP1``) left out."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def sass_back_branch_spans(code: list) -> list:
    """Each backward branch of ``sass_code``'s listing as ``(target address, branch address)``: a loop's span."""
    spans = []
    for addr, text in code:
        m = _BACK_BRANCH.search(text)
        if m and m.group(1) and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    return spans


def sass_loops(sass: str) -> list:
    """The innermost loops of a kernel's SASS (a backward branch and the instructions it jumps back over, holding no
    other such loop), each as ``{"instructions": n, "ops": {opcode: count}}``, longest first: what one iteration
    of a tile loop issues per thread, to count before and after a kernel change without a GPU."""
    code = sass_code(sass)
    spans = sass_back_branch_spans(code)
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    loops = []
    for lo, hi in sorted(set(inner)):
        ops: dict = {}
        for addr, text in code:
            if lo <= addr <= hi:
                op = sass_opcode(text)
                ops[op] = ops.get(op, 0) + 1
        loops.append({"instructions": sum(ops.values()), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    return sorted(loops, key=lambda loop: -loop["instructions"])


def compile_call(call, target: GPUTarget, **extra_options):
    """Triton's CompiledKernel of one recorded launch for ``target``, as Triton would compile it on that GPU (same
    specialisation of every argument: dtypes, 16-byte alignment, integers equal to 1 or divisible by 16).
    ``extra_options``: more compile options (e.g. ``ir_override``, to compile an edited PTX)."""
    kernel, grid, tensors, scalars, meta = call
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**meta, **direct_launch.COMPILE_OPTIONS, **extra_options}      # what every launch gives Triton
    bound, specialization, options = binder(*tensors, *direct_launch._tritons_scalars(tensors, scalars), **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_launch(call, target: GPUTarget) -> dict:
    """Compile one recorded launch for ``target`` (``compile_call``): what the record keeps of it."""
    kernel, grid, tensors, scalars, meta = call
    compiled = compile_call(call, target)
    md = compiled.metadata
    # whether the direct C launch can bind this launch's constexprs (else every call of it takes Triton's slower
    # launch path, silently)
    direct = direct_launch._constexpr_tail(kernel, len(tensors) + len(scalars), meta) is not None
    return {"kernel": kernel.__name__, "grid": list(grid), "direct_launch": direct,
            "num_warps": md.num_warps, "num_stages": md.num_stages,
            "shared_bytes": md.shared, "mma": mma_kinds(compiled.asm["ptx"]), "code": code_digest(compiled.asm["ptx"]),
            "loop_allocations": loop_allocations(compiled.asm["ttgir"]),
            **_resource_usage(compiled.asm["cubin"]), "loops": sass_loops(_cuobjdump(compiled.asm["cubin"], "-sass"))}


_SHOWN_META = ("QUANTIZE_Q", "Q_QUANTIZED", "TMA_DOCS", "BITCAST_SUMS", "HAS_SCALES", "PAIRED", "RAGGED", "SMOOTH",
               "SAVE_AUX", "ROW_OUT", "QPB", "TOKB", "BLOCK_N", "BLOCK_D", "D_CHUNKS", "PRECISION", "PEEL_TAIL",
               "MULTI_DOC", "ROW_PARTIALS", "TAIL_N", "PEEL_EACH_DOC", "CHAINED_MAX", "PROGRAMS")


def run_cases(cases, arch: int, sms: int, log=print) -> list:
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for case in cases:
        if arch < case.min_arch:
            continue
        try:
            calls = record_launches(case, sms, arch)
        except Exception as exc:              # a host-side failure is a finding too
            rows.append({"case": case.name, "error": f"host: {type(exc).__name__}: {exc}"})
            log(f"FAIL {case.name}: host code raised {type(exc).__name__}: {exc}")
            continue
        for call in calls:
            meta = {k: v for k, v in call[4].items() if k in _SHOWN_META}
            start = time.time()
            try:
                row = {"case": case.name, "meta": meta, **compile_launch(call, target)}
            except Exception as exc:
                row = {"case": case.name, "meta": meta, "kernel": call[0].__name__,
                       "error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
            row["compile_s"] = round(time.time() - start, 2)
            rows.append(row)
            if "error" in row:
                log(f"FAIL {case.name} {row['kernel']}: {row['error']}")
            else:
                loops = "/".join(str(loop["instructions"]) for loop in row["loops"][:3])
                log(f"ok   {case.name:45s} {row['kernel']:28s} warps={row['num_warps']} regs={row['registers']:3d} "
                    f"stack={row['stack_bytes']} smem={row['shared_bytes']} mma={row['mma']} loops={loops} "
                    f"({row['compile_s']} s)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 80: A100)")
    ap.add_argument("--sms", type=int, default=132, help="the target's SM count (tile choices depend on it)")
    ap.add_argument("--only", default="", help="only the cases whose name contains this text")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--scale-dtype", choices=("bf16", "fp32"), default="bf16", help="the quantized documents' "
                    "scales: bf16 (flash_maxsim.quantize's) or fp32")
    args = ap.parse_args(argv)
    global scale_dtype
    scale_dtype = BF16 if args.scale_dtype == "bf16" else FP32
    if launch.interpreting():
        print("offline_compile: unset TRITON_INTERPRET (the interpreter never compiles)", file=sys.stderr)
        return 2
    cases = [c for c in CASES if args.only in c.name]
    print(f"offline compile for sm_{args.arch} ({args.sms} SMs), Triton {triton.__version__}, {len(cases)} cases",
          flush=True)
    rows = run_cases(cases, args.arch, args.sms, log=lambda s: print(s, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "sms": args.sms, "triton": triton.__version__, "rows": rows}, f, indent=1)
    failed = sum("error" in r for r in rows)
    print(f"{len(rows) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
