"""Tile configurations and the policy that chooses them per problem.

Every tuning decision of the kernels lives here: the tiles, warps, stages and grid shape of a forward launch
(:class:`ForwardConfig`, chosen by :func:`forward_config`) and of the backward's launches (:class:`BackwardConfig`,
:func:`backward_config`); whether quantized documents are scored with 8-bit products (:func:`eight_bit_products`);
the flags that follow the installed Triton; the target GPU's facts the choices read (SM count, TMA).
``kernels/launch.py`` turns a config into cached launch plans; nothing here launches.

Each choice carries its reason and one measurement (kernel time unless said; the GPU and Triton it held for);
docs/design.md tells the whole story of each.

Overrides, for tests and the developer tools (tools/): ``FORWARD_OVERRIDES`` and ``BACKWARD_OVERRIDES`` map config
field names to values that replace the policy's choices in every launch plan built while they are set (the plan
caches are keyed by them); names are checked against the config's fields (an unknown one raises ``TypeError``). Set
them for a block with ::

    with tuning.override_forward(BLOCK_N=16, ROWS=32), tuning.override_backward(DD_METHOD="binned"):
        ...

(nested blocks add to the outer ones), or in a test with ``monkeypatch.setitem(tuning.FORWARD_OVERRIDES, name,
value)``. :func:`override_target` sets the SM count and compute capability the policy tunes for (compiling for a GPU
that is not there).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ContextManager, Iterable, Iterator, Optional

import torch
import triton

from .forward import INTERPRETED
from .. import _types


def cdiv(a: int, b: int) -> int:
    # not triton.cdiv: that is a @jit function, and calling it from Python costs ~10 us per call
    return -(-a // b)


def pow2(x: int) -> int:
    """The least power of two >= x (1 for x <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


# --- the installed Triton -------------------------------------------------------------------------------------------

def triton_at_least(version: str, major: int, minor: int) -> bool:
    """Whether a Triton version string ("3.9.0", "3.10.0+git1234") is ``major.minor`` or later."""
    try:
        found = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return True                     # a build not numbered so: assume a recent one
    return found >= (major, minor)


# From Triton 3.9 the int8 token-rows kernel's loop needs 75 registers where 3.6-3.8 fit it in 64 (capped at 64 it
# spills in every tile): 6 programs per SM, uncapped, there
TOKEN_ROWS_INT8_NEEDS_75_REGISTERS = triton_at_least(triton.__version__, 3, 9)

# From Triton 3.8 tl.reduce / tl.max reduce a thread's values as a balanced tree (3.6-3.7: a chain); partial maxima
# folded in a fixed chain (CHAINED_MAX) are faster there
REDUCE_IS_A_TREE = triton_at_least(triton.__version__, 3, 8)


# --- the target GPU -------------------------------------------------------------------------------------------------

_SM_COUNT: dict = {}


def sm_count() -> int:
    """The SM count of the current device (``override_target``'s, if set; 4 without CUDA: the interpreter)."""
    if _target is not None and _target[0] is not None:
        return _target[0]
    if not torch.cuda.is_available():
        return 4
    dev = torch.cuda.current_device()
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SM_COUNT[dev]


def has_tma(queries: torch.Tensor) -> bool:
    """Whether this Triton has host tensor descriptors and the target copies tiles by TMA (compute capability 9+;
    ``override_target``'s capability if set; the interpreter emulates TMA)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    if _target is not None and _target[1] is not None:
        return _target[1] >= (9, 0)
    if INTERPRETED:
        return True
    return queries.is_cuda and torch.cuda.get_device_capability(queries.device) >= (9, 0)


# --- tiles shared by the forward and the backward -----------------------------------------------------------------

def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for inputs of ``dtype``: "tf32" for fp32 below torch's "highest" matmul precision."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def on_cuda_cores(dtype: torch.dtype) -> bool:
    """fp32 inputs at "highest": full-fp32 products, which run on CUDA cores (FMA), not tensor cores (fp16/bf16
    products are "ieee" too, on tensor cores)."""
    return dtype == torch.float32 and precision(dtype) == "ieee"


def feature_tiling_for(d: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_D, D_CHUNKS) for inputs of this dtype, forward and backward alike."""
    if on_cuda_cores(dtype):
        # FMA operand tiles live in registers: 32-wide feature chunks keep them there (128-wide ones spill: PyLate's
        # fp32 scoring 8x slower than PyTorch's, H200)
        block_d = min(32, max(16, pow2(d)))
    else:
        block_d = max(16, pow2(d)) if d <= 256 else 128
    return block_d, cdiv(d, block_d)


def row_tiling(Nq: int, Lq: int, paired: bool, rows: int) -> tuple[int, int]:
    """(TOKB, QPB): tiles of up to ``rows`` query-token rows, ``QPB`` queries of ``TOKB`` tokens (one query when
    ``paired``)."""
    tokb = min(max(16, pow2(Lq)), rows)
    qpb = 1 if paired else max(1, min(pow2(Nq), rows // tokb))
    return tokb, qpb


def _programs(Nq, C, Lq, paired, tokb, qpb):
    """Programs of one document slice each: (query block, column, query-token split) triples."""
    return (1 if paired else cdiv(Nq, qpb)) * C * cdiv(Lq, tokb)


def _tiling_of_256_rows(Nq, C, Lq, paired, programs_per_sm):
    """(TOKB, QPB) of 256-row tiles where the queries fill all 256 rows and leave at least ``programs_per_sm``
    programs per SM; None otherwise."""
    tokb, qpb = row_tiling(Nq, Lq, paired, 256)
    if tokb * qpb == 256 and _programs(Nq, C, Lq, paired, tokb, qpb) >= programs_per_sm * sm_count():
        return tokb, qpb
    return None


# --- the forward ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ForwardConfig:
    """The forward's tiles and grid for one problem. Upper-case fields are the kernels' meta-parameters of the same
    name (kernels/forward.py, forward_token_rows.py) or the grid choices that shape them; the launch plan derives
    the kernel's flags from them and the problem's layout."""

    TOKB: int                      # query tokens per row tile (a power of two, or a slice of a long query)
    QPB: int                       # queries per row tile: TOKB * QPB rows
    BLOCK_N: int                   # document tokens per tile
    BLOCK_D: int                   # features per tile
    D_CHUNKS: int                  # feature tiles per token (d > BLOCK_D)
    num_warps: int = 4
    num_stages: int = 2            # software-pipelining depth of the document loop
    DSPLIT: int = 1                # document-token slices over programs (combined by a second launch)
    PEEL_TAIL: bool = True         # whole tiles unmasked, the last tile peeled (else one masked loop)
    DOCS: int = 1                  # padded documents per program (PROGRAMS_PER_SM, if set, decides instead)
    PROGRAMS_PER_SM: int = 0       # a grid of about this many programs per SM, each an equal share of documents
    WHOLE_TILE_MASKS: bool = False  # whole tiles keep the token mask on their loads
    MAXNREG: int = 0               # register cap per thread (0: none)
    PREFETCH_TOKENS: bool = False  # a run's per-token scales and mask loaded a tile ahead
    QUANTIZE_FIRST: bool = False   # 8-bit products: the queries quantised before the launch, not in the kernel
    TMA_DOCS: bool = False         # whole document tiles of a run copied by TMA
    BITCAST_SUMS: bool = False     # int8 x int8 sums read as fp32 bits, not converted
    ROW_PARTIALS: int = 1          # partial maxima per row across a document's tiles
    TAIL_N: int = 0                # the peeled tail in tiles of this many tokens (0: BLOCK_N)
    PEEL_EACH_DOC: bool = False    # several documents per program: a loop per document, its tail peeled
    TMA_ONE_DOC: bool = False      # one padded document per program, its whole tiles copied by TMA
    CHAINED_MAX: bool = False      # a tile's maxima folded in a fixed chain, not in tl.max's order
    PEELED_RUNS: bool = False      # PROGRAMS_PER_SM etc. are the peeled runs' (see one_document_per_program)
    FLAT_RUN: bool = True          # documents that lie end to end may stream as one run of tokens
    BITCAST_REDO: bool = True      # tests only: False skips the exact second pass of BITCAST_SUMS
    PRECISION: Optional[str] = None  # tl.dot's input precision (None: the inputs' dtype decides)
    # the token-rows kernel (kernels/forward_token_rows.py): 8-bit products over runs of documents, document tokens
    # as the rows of the tensor-core tiles
    TOKEN_ROWS: bool = False
    TOKEN_ROWS_TMA: bool = False   # its tiles copied by TMA
    TOKEN_ROWS_BLOCK_N: Optional[int] = None          # None: BLOCK_N
    TOKEN_ROWS_PROGRAMS_PER_SM: Optional[int] = None  # None: PROGRAMS_PER_SM
    TOKEN_ROWS_MAXNREG: int = 0
    TOKEN_ROWS_WARPS: int = 4
    TOKEN_ROWS_STAGES: int = 2

    def for_token_rows(self) -> "ForwardConfig":
        """This config with the token-rows kernel's tile width and grid in place of the tile kernel's."""
        return dataclasses.replace(
            self, BLOCK_N=self.BLOCK_N if self.TOKEN_ROWS_BLOCK_N is None else self.TOKEN_ROWS_BLOCK_N,
            PROGRAMS_PER_SM=(self.PROGRAMS_PER_SM if self.TOKEN_ROWS_PROGRAMS_PER_SM is None
                             else self.TOKEN_ROWS_PROGRAMS_PER_SM))

    def one_document_per_program(self) -> "ForwardConfig":
        """This config without the peeled runs (PEELED_RUNS), for a layout their loop cannot take: the choices of
        one document per program, as measured (a field overridden explicitly keeps its override)."""
        return dataclasses.replace(self, **{k: v for k, v in ONE_DOCUMENT_PER_PROGRAM.items()
                                            if k not in FORWARD_OVERRIDES})


_FORWARD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ForwardConfig)
                     if f.default is not dataclasses.MISSING}

# the 256-row tiles' one-document-per-program choices, which the peeled runs (PEELED_RUNS) replace
ONE_DOCUMENT_PER_PROGRAM = dict(PROGRAMS_PER_SM=0, PEEL_EACH_DOC=False, MAXNREG=0, TAIL_N=0, PEELED_RUNS=False,
                                TMA_DOCS=False)

# forward overrides that are switches of the policy rather than config fields: ROWS (the row tile's size, 128 by
# default; setting it also turns off the 256-row choices), INT8_PRODUCTS / FP8_PRODUCTS (False: quantized documents
# converted to the queries' dtype instead of 8-bit products)
FORWARD_SWITCHES = ("ROWS", "INT8_PRODUCTS", "FP8_PRODUCTS")


def eight_bit_products(documents: torch.Tensor, document_scales: Optional[torch.Tensor], d: int,
                       save_aux: bool) -> Optional[str]:
    """:func:`flash_maxsim._types.eight_bit_products` under this module's switches (INT8_PRODUCTS / FP8_PRODUCTS)."""
    return _types.eight_bit_products(documents, document_scales, d, save_aux,
                                     int8=FORWARD_OVERRIDES.get("INT8_PRODUCTS", True),
                                     fp8=FORWARD_OVERRIDES.get("FP8_PRODUCTS", True))


def forward_config(Nq: int, C: int, Lq: int, max_len: int, d: int, paired: bool, save_aux: bool,
                   dtype: torch.dtype = torch.bfloat16, products: Optional[str] = None,
                   smooth: bool = False) -> ForwardConfig:
    """The forward's tiles and grid for ``Nq`` queries of ``Lq`` tokens against ``C`` documents (or candidates per
    query, ``paired``) of up to ``max_len`` tokens of ``d`` features. ``save_aux``: the training forward (arg-max or
    log-sum-exp saved); ``products``: ``"int8"`` / ``"fp8"`` for 8-bit products (``eight_bit_products``), None
    otherwise; ``smooth``: the smooth max. Measurements: bf16, d = 128 unless said; "1x10k 32x300" is one query of
    32 tokens against 10,000 documents of 300."""
    overrides = FORWARD_OVERRIDES
    tokb, qpb = row_tiling(Nq, Lq, paired, overrides.get("ROWS", 128))
    block_d, d_chunks = feature_tiling_for(d, dtype)
    # fp8 products take int8's tiles (fp8's own choices are unmeasured)
    eight_bit = products is not None
    if eight_bit:
        # 8-bit tensor-core products reduce over at least 32 features (Triton refuses a narrower 8-bit tl.dot on the
        # GPU; the interpreter does not check): d < 32 is zero-padded to 32 by the masked loads
        block_d, d_chunks = max(block_d, 32), 1
    # 4 warps; 3 stages from d = 128 with the last tile peeled (512x1024: 17% faster than 2, H200, Triton 3.6), 2
    # below; 128-token tiles when d > 256 (features chunked)
    cfg = dict(_FORWARD_DEFAULTS, TOKB=tokb, QPB=qpb, BLOCK_N=64 if d <= 256 else 128, BLOCK_D=block_d,
               D_CHUNKS=d_chunks, num_stages=3 if d >= 128 and not save_aux else 2)
    if on_cuda_cores(dtype):
        # FMA products: 2 stages, 4 warps, no 256-row tiles (PyLate-shaped fp32 64x512 32x180: 8 warps 1.6x slower,
        # H200, Triton 3.6)
        cfg["num_stages"] = 2
    elif "ROWS" not in overrides and not save_aux and d <= 256:
        # compute-bound scoring (many query-token rows, many documents): 256-row tiles on 8 warps read each
        # document tile once for twice the rows (1x10k 1024x1024: 10% faster, H200, Triton 3.6)
        rows256 = _tiling_of_256_rows(Nq, C, Lq, paired, 8)
        if rows256 is not None:
            if eight_bit:
                _compute_bound_8_bit(cfg, products, max_len)
            else:
                # whole tiles keep the token mask on their loads in the loop over one document's tiles (1x10k
                # 1024x1024: 2% faster, H200, Triton 3.6); partial maxima per row across a document's tiles, no
                # shuffle per tile in the wgmma accumulator's layout (3% faster there)
                tokb, qpb = rows256
                cfg.update(TOKB=tokb, QPB=qpb, num_warps=8, WHOLE_TILE_MASKS=True, ROW_PARTIALS=8)
                if max_len % cfg["BLOCK_N"] != 0:
                    # documents that end inside a tile: peeled runs, about 2 programs per SM each scoring a share of
                    # the documents, the query tile loaded once, each document's last tile peeled in 16-token tiles,
                    # at 128 registers, whole tiles copied by TMA (64x1k 32x300: 16% faster, H200, Triton 3.6). The
                    # plan takes them only where their loop runs (ForwardConfig.one_document_per_program)
                    cfg.update(PROGRAMS_PER_SM=2, PEEL_EACH_DOC=True, MAXNREG=128, TAIL_N=16, PEELED_RUNS=True,
                               TMA_DOCS=True)
    elif ("ROWS" not in overrides and save_aux and dtype in (torch.bfloat16, torch.float16) and d <= 128
          and max_len >= 512):
        # the training forward on long documents: 256-row tiles on 8 warps, 3 stages, the peeled tail in 16-token
        # tiles (ColPali B64 32x1030: 10% faster, H200, Triton 3.6). Not on 300-token documents, where it was 3%
        # slower
        rows256 = _tiling_of_256_rows(Nq, C, Lq, paired, 2)
        if rows256 is not None:
            tokb, qpb = rows256
            cfg.update(TOKB=tokb, QPB=qpb, num_warps=8, num_stages=3, TAIL_N=16)
    if (save_aux and not smooth and dtype in (torch.bfloat16, torch.float16) and d <= 128
            and cfg["TOKB"] * cfg["QPB"] >= 128):
        # the training forward's hard max: 8 partial (max, arg-max) pairs per row, folded with no reduction or
        # shuffle per tile, whole tiles copied by TMA (ColPali B256: 12% faster, H200, Triton 3.6). Not the smooth
        # max, nor tiles of fewer than 128 rows, whose mma.sync layout may split a row's columns across warps
        cfg.update(ROW_PARTIALS=8, TMA_ONE_DOC=True)
    # few (query block, document) pairs with long documents: split the documents' tokens over programs
    programs = _programs(Nq, C, Lq, paired, tokb, qpb)
    if not save_aux and programs < 2 * sm_count() and max_len >= 1024:
        # about 2 programs per SM, rounded down, at least 2 slices (16x32 32x8192: 2 slices 8% faster than 3, H200,
        # Triton 3.6)
        cfg["DSPLIT"] = max(1, min(max(2, 2 * sm_count() // programs), max_len // 512))
        cfg["num_warps"] = 8
        if tokb * qpb >= 128:
            # partial maxima per row (16x32 32x8192: 4% faster, H200, Triton 3.6). Not for 32-row tiles, whose
            # mma.sync layout splits the columns across warps (the partials' max then crosses shared memory)
            cfg["ROW_PARTIALS"] = 8
    if not save_aux and (Lq if paired else Nq * Lq) <= 32 and d <= 256:
        _bandwidth_bound(cfg, Nq, C, d, max_len, paired, dtype, products)
    if (dtype in (torch.bfloat16, torch.float16) and not eight_bit and not save_aux and cfg["DSPLIT"] == 1
            and (max_len % cfg["BLOCK_N"] == 0 or cfg["D_CHUNKS"] > 1)):
        # 16-bit documents of whole tiles (or chunked features): runs of several documents, 2 programs per SM
        # (1x10k 1024x1024: 6% faster than one document per program, H200, Triton 3.6). Not where tiles would
        # straddle documents (d=96 31x257: 40% slower)
        cfg["PROGRAMS_PER_SM"] = 2
        if tokb * qpb == 128 and cfg["num_warps"] == 4:
            # 128-row runs on 8 warps, whole tiles copied by TMA (1x1k 128x1024: 3% faster, H200, Triton 3.6). Not
            # the 32-row runs (no faster)
            cfg.update(num_warps=8, TMA_DOCS=True)
    config = ForwardConfig(**cfg)
    fields = {k: v for k, v in overrides.items() if k not in FORWARD_SWITCHES}
    return dataclasses.replace(config, **fields) if fields else config


def _compute_bound_8_bit(cfg: dict, products: str, max_len: int) -> None:
    """8-bit products on the compute-bound grid (256 rows would fit)."""
    # 128 rows x 128-token tiles on 4 warps instead of 256 x 64 (1x10k 1024x1024: 26% faster, H200, Triton 3.6);
    # a grid of 3 programs per SM (8 waves), each a share of the documents so that it quantises its query rows
    # once; at 168 registers; the run's per-token scales and mask loaded a tile ahead; the queries quantised before
    # the launch, so that the tensor cores read the query tile from shared memory (12% faster together); whole
    # document tiles copied by TMA (no per-thread copy addresses: 4% faster)
    cfg.update(BLOCK_N=128, PROGRAMS_PER_SM=24, MAXNREG=168, PREFETCH_TOKENS=True, QUANTIZE_FIRST=True,
               TMA_DOCS=True)
    if products == "fp8":
        # partial maxima per row across a document's tiles (3% faster, H200, Triton 3.6; not int8's bit-cast sums,
        # which spill at this register cap), folded in a fixed chain where tl.reduce makes a tree (Triton 3.8+: 4%
        # faster, H100, Triton 3.9; no gain under 3.6, whose tl.reduce is that chain)
        cfg.update(ROW_PARTIALS=8, CHAINED_MAX=REDUCE_IS_A_TREE)
    if max_len % 128 == 0 and products == "int8":
        # documents of whole tiles: the int32 sums read as fp32 bits, not converted (14% faster, H200, Triton 3.6;
        # straddling runs keep the conversion, which spills otherwise), their tile max folded in a fixed chain
        # (within 1% under Triton 3.6 and 3.9: one order for every Triton), on 3 stages, where each tile's copy is
        # issued early enough not to be waited for (7% faster than 2, H100, Triton 3.9)
        cfg.update(BITCAST_SUMS=True, num_stages=3, CHAINED_MAX=True)


def _bandwidth_bound(cfg: dict, Nq, C, d, max_len, paired, dtype, products) -> None:
    """Scoring where each document token meets at most 32 query tokens (d <= 256): bound by reading documents."""
    eight_bit = products is not None
    # one loop with a masked last tile streams better than a peeled one (1x10k 32x300: 3% faster, H200, Triton
    # 3.6); d = 384 (128-token tiles, chunked features) keeps its peeled tail
    cfg["PEEL_TAIL"] = False
    streamed_tokens = (Nq * C if paired else C) * max_len
    if cfg["DSPLIT"] == 1 and streamed_tokens >= 2**19:
        # 2 warps: more programs resident per SM keep more loads in flight (d=96 1x10k 31x257: 9% faster, H200,
        # Triton 3.6). Not below ~0.5M streamed tokens (1x1k 32x300: 10% slower) nor for d > 256
        cfg["num_warps"] = 2
        if (dtype in (torch.bfloat16, torch.float16) and not eight_bit and cfg["D_CHUNKS"] == 1
                and d < cfg["BLOCK_D"] and max_len % cfg["BLOCK_N"] != 0):
            # features padded to the tile (d=96 in 128): runs of documents (no partial tile per document) at 8
            # programs per SM in 128 registers, whole tiles copied by TMA, which zero-fills the features past d
            # (1x5k 31x257 d=96: 4% faster, H200, Triton 3.6)
            cfg.update(PROGRAMS_PER_SM=8, MAXNREG=128, TMA_DOCS=True)
    if eight_bit:
        # several documents per program, the query tile loaded and quantised once for all of them: as many as make
        # 8 programs per SM, an equal share each (1x10k 32x300: 12% faster than 4 documents per program, H200, Triton
        # 3.6); below 8 x SMs documents, one per program. Not for 16-bit documents (no faster). At most 128
        # registers: 8 programs of 2 warps per SM (runs whose tiles straddle two documents take 160 otherwise)
        cfg.update(PROGRAMS_PER_SM=8, MAXNREG=128)
        # where the documents form runs (and TMA is there), the token-rows kernel: document tokens as the rows of 64-
        # or 128-token wgmma tiles read by TMA, 8-bit values straight from shared memory; int8 on 64-token tiles at
        # 8 programs per SM and 64 registers (1x10k 32x300: 3% faster than the tile kernel, H200, Triton 3.6)
        cfg.update(TOKEN_ROWS=True, TOKEN_ROWS_TMA=True, TOKEN_ROWS_STAGES=2, TOKEN_ROWS_WARPS=4)
        if products == "fp8":
            # fp8 on 128-token tiles, 4 programs per SM (1x10k 32x300: 16% faster than the tile kernel, H200, Triton
            # 3.6)
            cfg.update(TOKEN_ROWS_BLOCK_N=128, TOKEN_ROWS_PROGRAMS_PER_SM=4, TOKEN_ROWS_MAXNREG=0)
        elif TOKEN_ROWS_INT8_NEEDS_75_REGISTERS:
            # 6 per SM, uncapped (1x10k 32x300: 10% faster than 8 per SM at 64 registers, H100, Triton 3.9)
            cfg.update(TOKEN_ROWS_BLOCK_N=64, TOKEN_ROWS_PROGRAMS_PER_SM=6, TOKEN_ROWS_MAXNREG=0)
        else:
            cfg.update(TOKEN_ROWS_BLOCK_N=64, TOKEN_ROWS_PROGRAMS_PER_SM=8, TOKEN_ROWS_MAXNREG=64)
        if products == "fp8" and cfg["num_warps"] == 2:
            # fp8 x fp8 products on 32-row tiles are mma.sync f16 after converting each document tile in registers:
            # one warp per program, registers uncapped, issues fewer instructions per token (1x10k 32x300: 5% faster,
            # H200, Triton 3.6). Not int8 (no faster)
            cfg.update(num_warps=1, MAXNREG=0)


# --- the backward ---------------------------------------------------------------------------------------------------

# The hard-max dQ in its own launch is a gather of DQ_GATHER_ROWS query rows x as many columns as keep its fp32 sums
# at DQ_GATHER_ELEMENTS (64 registers a thread on 4 warps) per step (kernels/backward.py,
# maxsim_bwd_dq_gather_kernel): ColPali B64 dQ 5.5x faster than a row at a time (H200, Triton 3.6); 8 rows x 8
# columns beat the other shapes tried
DQ_GATHER_ROWS = 8
DQ_GATHER_ELEMENTS = 8192

# The binned dD (kernels/backward.py, maxsim_bwd_dd_binned_kernel): one program of 4 warps per block of
# BINNED_DD_BLOCK_N tokens of a document picks that block's entries out of the document's arg-max entries, all held
# in its registers (at most BINNED_DD_MAX_ENTRIES: more entries per document take the dense kernel), then multiplies
# their one-hot by the gathered query rows. The hard max's default for documents of BINNED_DD_MIN_TOKENS tokens or
# BINNED_DD_MIN_ENTRIES arg-max entries or more (ColPali B256: 1.5x faster than sorting the entries per row, H200,
# Triton 3.6); below that the dense dD, fused with dQ in one launch, is faster
BINNED_DD_MAX_ENTRIES = 8192
BINNED_DD_BLOCK_N = 64
BINNED_DD_MIN_TOKENS = 1024
BINNED_DD_MIN_ENTRIES = 1024
# its registers capped at 128 (167 uncapped): 4 programs per SM instead of 3, for a kernel that waits on latency, at
# the cost of a small spill (ColPali B256 dD: 21% faster, H200, Triton 3.6); faster or even on most shapes swept,
# slightly slower on two small ones: a cap for every shape (a rule by waves mispredicted)
BINNED_DD_MAXNREG = 128


@dataclass(frozen=True)
class BackwardConfig:
    """The backward's methods, tiles and grid for one problem (kernels/backward.py). ``DQ_METHOD`` is None when dQ
    is not asked for, ``DD_METHOD`` when dD is not; the fields of a method not taken keep their defaults."""

    TOKB: int                      # the row-at-a-time dQ and the dense dD: query tokens per row tile
    QPB: int                       # queries per row tile
    BLOCK_N: int                   # document tokens per tile of the row-at-a-time dQ
    BLOCK_D: int                   # features per tile
    D_CHUNKS: int
    DD_METHOD: Optional[str] = None  # "dense" | "binned" | "sparse" (the last two: hard max only)
    DQ_METHOD: Optional[str] = None  # "rows" | "gather" (the gather: hard max only)
    FUSED: bool = False            # the hard max's dQ (rows) and dense dD in one launch
    DD_BLOCK_N: int = 64           # document tokens per dD program (dense, binned)
    DD_WARPS: int = 4
    DD_STAGES: int = 1
    DD_CHUNK: int = 64             # the binned dD's entries per product
    DD_MAXNREG: int = 0            # the binned dD's register cap (0: none)
    G_SPLIT: bool = False          # the upstream gradient multiplied as two 16-bit parts (kept whole)
    DQ_WARPS: int = 4
    DQ_STAGES: int = 2
    DQ_ROWS: int = DQ_GATHER_ROWS  # the gather's query rows per program
    DQ_COLS: int = 1               # the gather's columns per step
    DQ_BLOCK_D: int = 16           # the gather's features per program
    DQ_D_CHUNKS: int = 1
    DQ_PARTIAL_BYTES: int = 0      # memory cap of the dQ column splits' fp32 partial sums (0: no split)
    DQ_COLUMN_SPLITS: int = 1      # dQ's column loop split over this many programs (partial sums added after)
    FUSED_STAGES: int = 1
    RELOAD_TILE: bool = False      # the smooth max's gradients load each streamed tile twice, once per product


# the backward overrides honoured (override_backward): its config's choices; the tiles and the column split count
# follow from them
BACKWARD_OVERRIDABLE = ("DD_METHOD", "DQ_METHOD", "FUSED", "DD_BLOCK_N", "DD_WARPS", "DD_STAGES", "DD_CHUNK",
                        "DD_MAXNREG", "G_SPLIT", "DQ_WARPS", "DQ_STAGES", "DQ_ROWS", "DQ_COLS", "DQ_PARTIAL_BYTES",
                        "FUSED_STAGES", "RELOAD_TILE")


def default_dd_method(longest: int, entries_per_document: int) -> str:
    """The hard max's dD kernel when no override picks one: "binned" or "dense" (see BINNED_DD_MIN_TOKENS)."""
    if longest >= BINNED_DD_MIN_TOKENS or entries_per_document >= BINNED_DD_MIN_ENTRIES:
        return "binned"
    return "dense"


def dq_column_splits(programs: int, C: int, partial_bytes: int, budget_bytes: int, per_sm: int = 4) -> int:
    """Split the column loop so that the dQ grid has ``per_sm`` programs per SM. Partial sums cost
    ``splits * partial_bytes`` (fp32 Nq*Lq*d each), kept within ``budget_bytes``; summed in a fixed order."""
    target = per_sm * sm_count()
    splits = 1
    while programs * splits < target and C // (splits * 2) >= 8 and (splits * 2) * partial_bytes <= budget_bytes:
        splits *= 2
    return splits


def backward_config(Nq: int, C: int, Lq: int, d: int, longest: int, paired: bool, dtype: torch.dtype,
                    smooth: bool, need_dq: bool, need_dd: bool, grad_dtype: Optional[torch.dtype] = None,
                    upcast: bool = False) -> BackwardConfig:
    """The backward's methods and tiles for ``Nq`` queries of ``Lq`` tokens against ``C`` documents (or candidates
    per query, ``paired``), the longest of ``longest`` tokens, inputs of ``dtype``; ``grad_dtype``: the gradients'
    dtype when asked for (fp32), else the inputs'; ``upcast``: the interpreter's fp32 products."""
    overrides = BACKWARD_OVERRIDES
    block_d, d_chunks = feature_tiling_for(d, dtype)
    tokb, qpb = row_tiling(Nq, Lq, paired, 128)
    block_n = 64 if d <= 256 else 32
    cfg = dict(TOKB=tokb, QPB=qpb, BLOCK_N=block_n, BLOCK_D=block_d, D_CHUNKS=d_chunks)
    if smooth and overrides.get("RELOAD_TILE"):
        cfg["RELOAD_TILE"] = True
    n_entries = Lq if paired else Nq * Lq          # arg-max entries per document
    dd_method = ("dense" if smooth else overrides.get("DD_METHOD", default_dd_method(longest, n_entries))) \
        if need_dd else None
    e_pow2 = pow2(max(n_entries, 16))
    if dd_method == "binned" and not (d_chunks == 1 and e_pow2 <= BINNED_DD_MAX_ENTRIES):
        # the binning holds a document's entries in registers
        dd_method = "dense"
    dq_warps = overrides.get("DQ_WARPS", 4)
    # dense dD: the smooth max recomputes every similarity tile, so 128-token blocks on 8 warps halve the query-row
    # re-reads (ColPali smooth B128: 8% faster, H200, Triton 3.6); the hard max keeps 64 on 4 warps
    wide = smooth and d <= 256 and not on_cuda_cores(dtype)
    dd_block_n = overrides.get("DD_BLOCK_N", 128 if wide else block_n)
    dd_warps = overrides.get("DD_WARPS", 8 if wide else 4)
    # both gradients in one launch, dQ's programs first, then dD's: one launch less per step, where small steps are
    # host-bound (ColBERT B128 step: 26% faster than two launches, H200, Triton 3.6); the hard max, where both
    # kernels' tiles agree
    fused = bool(need_dq and dd_method == "dense" and not smooth and dd_block_n == block_n and dd_warps == dq_warps
                 and overrides.get("FUSED", True))
    cfg.update(DD_METHOD=dd_method, FUSED=fused)
    if need_dq:
        dq_method = "rows" if (fused or smooth) else overrides.get("DQ_METHOD", "gather")
        if dq_method not in ("rows", "gather"):
            raise ValueError(f"override_backward(DQ_METHOD=...) must be 'rows' or 'gather', got {dq_method!r}")
        cfg.update(DQ_METHOD=dq_method, DQ_WARPS=dq_warps)
        if dq_method == "gather":
            # features in one slice up to 256 (no tensor-core tiling here), else slices of 128
            gather_d = max(16, pow2(d)) if d <= 256 else 128
            g_chunks = cdiv(d, gather_d)
            g_rows = overrides.get("DQ_ROWS", DQ_GATHER_ROWS)
            g_cols = overrides.get("DQ_COLS", max(1, DQ_GATHER_ELEMENTS // (g_rows * gather_d)))
            base_programs = cdiv(Nq * Lq, g_rows) * g_chunks
            cfg.update(DQ_ROWS=g_rows, DQ_COLS=g_cols, DQ_BLOCK_D=gather_d, DQ_D_CHUNKS=g_chunks,
                       DQ_STAGES=overrides.get("DQ_STAGES", 1))
        else:
            base_programs = (Nq if paired else cdiv(Nq, qpb)) * cdiv(Lq, tokb) * d_chunks
            cfg["DQ_STAGES"] = overrides.get("DQ_STAGES", 2)
        # partial sums may use as much memory as the queries' fp32 gradient itself, and at least 8 MiB
        partial = Nq * Lq * d * 4
        # no split over at most 64 columns: the unsplit loop is short, and the split's partial sums, their sum and
        # cast cost more host time than they save in the host-bound steps such sizes make (ColPali B64 step: 8%
        # faster unsplit, H200, Triton 3.6)
        budget = 0 if C <= 64 else max(8 << 20, partial)
        if fused:
            # beside the dD programs, split only long column loops (ColBERT B128 step: 18% faster unsplit, H200,
            # Triton 3.6)
            budget = 0 if C <= 256 else budget
        budget = overrides.get("DQ_PARTIAL_BYTES", budget)
        # the gather's programs keep 64 document rows in flight each: 2 per SM before splitting the columns
        n_cs = dq_column_splits(base_programs, C, partial, budget, 2 if dq_method == "gather" else 4)
        cfg.update(DQ_PARTIAL_BYTES=budget, DQ_COLUMN_SPLITS=cdiv(C, cdiv(C, n_cs)))
    # hard max, 16-bit inputs, fp32 gradients asked for: the upstream gradient multiplied as two 16-bit parts, whole.
    # By default it is rounded to the inputs' dtype, as PyTorch's own 16-bit autograd rounds it: the split doubles
    # the tensor-core work (ColPali B256 dD: 1.7x slower, H200, Triton 3.6)
    cfg["G_SPLIT"] = bool(overrides.get("G_SPLIT", grad_dtype == torch.float32 and not smooth and not upcast
                                        and dtype in (torch.float16, torch.bfloat16)))
    if dd_method == "dense":
        # 1 stage, no software pipelining (B128 32x300 dD: 17% faster than 2, H200, Triton 3.6)
        cfg.update(DD_BLOCK_N=dd_block_n, DD_WARPS=dd_warps, DD_STAGES=overrides.get("DD_STAGES", 1))
        if fused:
            cfg["FUSED_STAGES"] = overrides.get("FUSED_STAGES", 1)
    elif dd_method == "binned":
        cfg.update(DD_BLOCK_N=overrides.get("DD_BLOCK_N", BINNED_DD_BLOCK_N),
                   DD_WARPS=overrides.get("DD_WARPS", 4), DD_STAGES=overrides.get("DD_STAGES", 1),
                   DD_CHUNK=overrides.get("DD_CHUNK", 64), DD_MAXNREG=overrides.get("DD_MAXNREG", BINNED_DD_MAXNREG))
    elif dd_method not in (None, "sparse"):
        raise ValueError(f"override_backward(DD_METHOD=...) must be 'dense', 'binned' or 'sparse', got {dd_method!r}")
    return BackwardConfig(**cfg)


# --- overrides ------------------------------------------------------------------------------------------------------

class Overrides(collections.abc.MutableMapping):
    """Config fields by name, each replacing the policy's choice of that field in every launch plan built while
    this mapping is the active one (``FORWARD_OVERRIDES`` / ``BACKWARD_OVERRIDES``). Names are checked when set:
    an unknown one raises ``TypeError``. ``key`` is a hashable stand-in for the contents and the target
    (``override_target``), None when both are empty: part of the plan caches' keys."""

    __slots__ = ("kind", "names", "target", "_values", "key")

    def __init__(self, kind: str, names: Iterable[str], values: Any = (), target: Optional[tuple] = None) -> None:
        self.kind, self.names, self.target = kind, frozenset(names), target
        self._values: dict = {}
        self.key = None
        self.update(values)
        self._refresh()

    @classmethod
    def forward(cls, values: Any = (), **fields: Any) -> "Overrides":
        """Forward overrides holding only ``values`` and ``fields`` (e.g. for ``monkeypatch.setattr(tuning,
        "FORWARD_OVERRIDES", ...)``), for the active target."""
        return cls("forward", _FORWARD_NAMES, {**dict(values), **fields}, _target)

    @classmethod
    def backward(cls, values: Any = (), **fields: Any) -> "Overrides":
        """Backward overrides holding only ``values`` and ``fields``, for the active target."""
        return cls("backward", _BACKWARD_NAMES, {**dict(values), **fields}, _target)

    def merged(self, fields: dict, target: Optional[tuple] = None) -> "Overrides":
        """A new mapping of these overrides and ``fields`` (theirs win), for ``target`` (default: this one's)."""
        return Overrides(self.kind, self.names, {**self._values, **fields},
                         self.target if target is None else target)

    def _refresh(self) -> None:
        self.key = None if not self._values and self.target is None else (tuple(self._values.items()), self.target)

    def __setitem__(self, name, value):
        if name not in self.names:
            raise TypeError(f"no {self.kind} config field {name!r}; known: {', '.join(sorted(self.names))}")
        self._values[name] = value
        self._refresh()

    def __delitem__(self, name):
        del self._values[name]
        self._refresh()

    def __getitem__(self, name):
        return self._values[name]

    def __contains__(self, name):
        return name in self._values

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        return f"Overrides({self.kind}, {self._values!r})"


_FORWARD_NAMES = frozenset(f.name for f in dataclasses.fields(ForwardConfig)) | frozenset(FORWARD_SWITCHES)
_BACKWARD_NAMES = frozenset(BACKWARD_OVERRIDABLE)
_target = None              # (SM count or None, compute capability or None) while override_target is active

#: The active forward overrides: ForwardConfig's fields and the switches ROWS, INT8_PRODUCTS, FP8_PRODUCTS
#: (FORWARD_SWITCHES). Each replaces the policy's choice of that field; the plan still derives the kernel's flags
#: from the layout.
FORWARD_OVERRIDES = Overrides.forward()
#: The active backward overrides (BACKWARD_OVERRIDABLE): DD_METHOD and DQ_METHOD pick the hard max's kernels (the
#: smooth max has one of each; dQ beside the dense dD in one launch is always "rows"; FUSED=False keeps two
#: launches), the others its tiles.
BACKWARD_OVERRIDES = Overrides.backward()


@contextlib.contextmanager
def _overridden(name: str, fields: dict):
    """Within the block, the module's overrides ``name`` with ``fields`` added."""
    saved = globals()[name]
    globals()[name] = saved.merged(fields)
    try:
        yield globals()[name]
    finally:
        globals()[name] = saved


def override_forward(**fields: Any) -> ContextManager[Overrides]:
    """A context within which forward plans take these fields (``FORWARD_OVERRIDES`` with them added)."""
    return _overridden("FORWARD_OVERRIDES", fields)


def override_backward(**fields: Any) -> ContextManager[Overrides]:
    """A context within which backward plans take these fields (``BACKWARD_OVERRIDES`` with them added)."""
    return _overridden("BACKWARD_OVERRIDES", fields)


@contextlib.contextmanager
def override_target(sms: Optional[int] = None, capability: Optional[tuple] = None) -> Iterator[None]:
    """Within the block, the policy tunes for a GPU of ``sms`` SMs and this compute capability (whether it copies
    tiles by TMA) instead of the current device's: e.g. to compile for a GPU that is not there."""
    global _target, FORWARD_OVERRIDES, BACKWARD_OVERRIDES
    saved = _target, FORWARD_OVERRIDES, BACKWARD_OVERRIDES
    old_sms, old_capability = saved[0] or (None, None)
    _target = (sms if sms is not None else old_sms,
               tuple(capability) if capability is not None else old_capability)
    FORWARD_OVERRIDES = FORWARD_OVERRIDES.merged({}, _target)
    BACKWARD_OVERRIDES = BACKWARD_OVERRIDES.merged({}, _target)
    try:
        yield
    finally:
        _target, FORWARD_OVERRIDES, BACKWARD_OVERRIDES = saved
