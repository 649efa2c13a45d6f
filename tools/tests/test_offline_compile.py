"""The kernels compile for Hopper (sm_90) and Ampere (sm_80) without a GPU, for every specialisation the launcher
picks on tools/offline_compile.py's problems, without local arrays, without spills in the tile loops of the paths
named below, and on the tensor-core instructions each path is meant to use. The interpreter checks the arithmetic
but never runs the compiler: a kernel change can pass it and still fail to compile (the last test here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from flash_maxsim.kernels import launch, tuning

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "offline_compile.py"

try:
    from triton.backends.nvidia import compiler as _nvidia
    _HAVE_TOOLS = all((Path(_nvidia.__file__).parent / "bin" / t).exists() for t in ("ptxas", "cuobjdump"))
except ImportError:
    _HAVE_TOOLS = False

pytestmark = pytest.mark.skipif(not _HAVE_TOOLS, reason="Triton's NVIDIA backend tools (ptxas, cuobjdump) absent")


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)          # the compiler, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _compile_all(tmp_path_factory, arch, sms):
    out = tmp_path_factory.mktemp(f"sm{arch}") / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--arch", str(arch), "--sms", str(sms), "--json", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=1500)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    return proc, rows


@pytest.fixture(scope="module")
def hopper(tmp_path_factory):
    return _compile_all(tmp_path_factory, 90, 132)


@pytest.fixture(scope="module")
def ampere(tmp_path_factory):
    return _compile_all(tmp_path_factory, 80, 108)


def _by_case(rows, case, kernel="maxsim_fwd_kernel", programs=None):
    """The one compiled launch of ``kernel`` in ``case`` (of maxsim_bwd_kernel: its ``programs``, "dq" or "dd",
    where the case launches it twice)."""
    found = [r for r in rows if r["case"] == case and r.get("kernel") == kernel
             and (programs is None or r["meta"].get("PROGRAMS") == programs)]
    assert len(found) == 1, f"{case} / {kernel}: {found}"
    return found[0]


def _spill_instructions(loop):
    """The local-memory loads and stores (register spills: STL, LDL and their wider or last-use forms) in a loop."""
    return sum(n for op, n in loop["ops"].items() if op.split(".")[0] in ("STL", "LDL"))


@pytest.mark.parametrize("target", ["hopper", "ampere"])
def test_every_specialisation_compiles_to_a_direct_launch_without_local_arrays(target, request):
    proc, rows = request.getfixturevalue(target)
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    assert proc.returncode == 0, proc.stdout[-3000:]
    kernels = {r["kernel"] for r in rows}
    # the token-rows kernel needs TMA: Hopper only
    assert kernels == {"maxsim_fwd_kernel", "maxsim_bwd_kernel", "maxsim_bwd_dq_gather_kernel",
                       "maxsim_bwd_dd_sparse_kernel", "maxsim_bwd_dd_binned_kernel",
                       "maxsim_combine_slices_kernel"} | (
        {"maxsim_fwd_token_rows_kernel"} if target == "hopper" else set())
    assert len(rows) >= 35
    # every launch binds all its kernel's constexprs, so later calls take the direct C launch (kernels/direct_launch.py)
    assert all(r["direct_launch"] for r in rows), [(r["case"], r["kernel"]) for r in rows if not r["direct_launch"]]
    # (register spills go to the stack frame, which several kernels use a little outside their loops: the tests
    # below check the loops of the paths they name)
    local_arrays = [(r["case"], r["kernel"], r["local_bytes"]) for r in rows if r["local_bytes"] != 0]
    assert not local_arrays, f"local arrays in: {local_arrays}"
    assert all(0 < r["registers"] <= 255 for r in rows)


def test_int8_index_uses_int8_tensor_cores(hopper):
    _, rows = hopper
    tiles = "int8 1x3k 32x300 tile kernel (several documents per program)"
    for case, instruction in ((tiles, "mma.sync s8"), ("int8 1x300 1024x1024 masked", "wgmma s8")):
        row = _by_case(rows, case)
        assert row["meta"]["QUANTIZE_Q"] and row["meta"]["HAS_SCALES"]
        assert set(row["mma"]) == {instruction}, row["mma"]
    assert _by_case(rows, tiles)["meta"]["MULTI_DOC"]
    # the default for runs of documents streaming one query: document tokens as the rows of 64-row wgmma tiles,
    # copied by TMA, in at most 64 registers (8 programs of 4 warps per SM; from Triton 3.9, 6 uncapped, at most 80),
    # nothing spilled in the tile loop
    row = _by_case(rows, "int8 1x3k 32x300 (several documents per program)", "maxsim_fwd_token_rows_kernel")
    assert set(row["mma"]) == {"wgmma s8"} and row["meta"]["TMA_DOCS"] and row["meta"]["BLOCK_N"] == 64
    assert row["registers"] <= (80 if tuning.TOKEN_ROWS_INT8_NEEDS_75_REGISTERS else 64) and row["num_warps"] == 4
    assert not any(_spill_instructions(loop) for loop in row["loops"]), row["loops"]
    assert _by_case(rows, "int8 1x300 1024x1024 masked")["meta"]["BLOCK_N"] == 128
    # the compute-bound grid reads queries quantised before the launch; the bandwidth-bound one quantises them
    assert _by_case(rows, "int8 1x300 1024x1024 masked")["meta"]["Q_QUANTIZED"]
    # runs of documents: their whole tiles copied by TMA (Hopper only); one document per program: per-thread copies
    runs = "int8 1x4k 1024x1024 (runs of documents by TMA)"
    assert _by_case(rows, runs)["meta"]["TMA_DOCS"] and _by_case(rows, runs)["meta"]["MULTI_DOC"]
    assert set(_by_case(rows, runs)["mma"]) == {"wgmma s8"}
    assert not _by_case(rows, "int8 1x300 1024x1024 masked")["meta"]["TMA_DOCS"]
    assert not _by_case(rows, tiles)["meta"]["Q_QUANTIZED"]
    # the conversion paths (switched off, d > 256) multiply in bf16
    for case in ("int8 converted", "int8 d=384 (converted)", "fp8 converted"):
        row = _by_case(rows, case)
        assert not row["meta"]["QUANTIZE_Q"] and row["meta"]["HAS_SCALES"]
        assert set(row["mma"]) == {"mma.sync bf16"}, (case, row["mma"])


def test_fp8_index_uses_fp8_tensor_cores_where_hopper_has_them(hopper):
    """fp8 x fp8 products (the query quantised to e4m3): wgmma e4m3 on the compute-bound grid (queries quantised
    first, TMA, no spills) and in the token-rows kernel (128 document tokens as a tile's rows); the tile kernel's
    32-row streaming tiles have no fp8 mma.sync on Hopper, and Triton converts the e4m3 operands to fp16 for it."""
    _, rows = hopper
    compute = _by_case(rows, "fp8 1x4k 1024x1024 (runs of documents by TMA)")
    assert compute["meta"]["QUANTIZE_Q"] and compute["meta"]["Q_QUANTIZED"] and compute["meta"]["TMA_DOCS"]
    assert not compute["meta"]["BITCAST_SUMS"]          # fp32 sums already: nothing to bit-cast
    # its 8 partial maxima per row folded in a fixed chain where tl.reduce would fold them as a tree (Triton >= 3.8)
    assert compute["meta"]["ROW_PARTIALS"] == 8
    assert compute["meta"].get("CHAINED_MAX", False) == tuning.REDUCE_IS_A_TREE
    assert set(compute["mma"]) == {"wgmma e4m3"} and compute["local_bytes"] == 0
    for case in ("fp8 1x500 32x300", "fp8 1x3k 32x300 tile kernel (runs of documents)"):
        row = _by_case(rows, case)
        assert row["meta"]["QUANTIZE_Q"] and not row["meta"]["Q_QUANTIZED"]
        assert set(row["mma"]) == {"mma.sync f16"}, (case, row["mma"])
    row = _by_case(rows, "fp8 1x3k 32x300 (runs of documents)", "maxsim_fwd_token_rows_kernel")
    assert set(row["mma"]) == {"wgmma e4m3"} and row["meta"]["TMA_DOCS"] and row["meta"]["BLOCK_N"] == 128
    assert row["local_bytes"] == 0


def test_bitcast_sums_take_no_conversion_per_similarity(hopper):
    """The int8 compute-bound grid's tile loop (128 x 128 similarities over 128 threads: 128 per thread) with the
    sums read as fp32 bits (its default for whole tiles): no int-to-float conversion left, one fewer instruction
    per similarity than with the converted sums; the exact second pass is a loop of its own, not inside the first
    (which stays pipelined: the same shared memory)."""
    _, rows = hopper
    converted = _by_case(rows, "int8 1x4k 1024x1024 converted sums")
    bitcast = _by_case(rows, "int8 1x4k 1024x1024 (runs of documents by TMA)")
    assert bitcast["meta"]["BITCAST_SUMS"] and bitcast["meta"]["Q_QUANTIZED"] and bitcast["meta"]["TMA_DOCS"]
    assert bitcast["meta"]["CHAINED_MAX"]               # its tile max folded in a fixed chain
    assert not converted["meta"]["BITCAST_SUMS"] and "CHAINED_MAX" not in converted["meta"]
    # the longest loop issuing tensor-core products: the loop over document tiles
    before = next(loop for loop in converted["loops"] if any(op.startswith("IGMMA") for op in loop["ops"]))
    conversions = sum(n for op, n in before["ops"].items() if op.startswith("I2F"))
    assert conversions >= 128
    first_pass = next(loop for loop in bitcast["loops"] if any(op.startswith("IGMMA") for op in loop["ops"])
                      and not any(op.startswith("I2F") for op in loop["ops"]))
    assert first_pass["instructions"] <= before["instructions"] - 96, (first_pass, before)
    assert any(any(op.startswith("I2F") for op in loop["ops"]) for loop in bitcast["loops"])   # the second pass
    assert bitcast["shared_bytes"] == converted["shared_bytes"] and bitcast["local_bytes"] == 0


@pytest.mark.parametrize("case", ["int8 1x3k 32x300 (several documents per program)",
                                  "fp8 1x3k 32x300 (runs of documents)"])
def test_token_rows_kernel_copies_its_query_to_shared_memory_once(hopper, case):
    """The token-rows kernel's products read the quantized query tile (their second operand) from shared memory: it
    is copied there once, before the tile loop, not stored again every tile (Triton 3.9 keeps that copy inside the
    loop where the query's transpose is there, from registers it spills); and the programs its grid puts on each SM
    fit the register file together."""
    row = _by_case(hopper[1], case, "maxsim_fwd_token_rows_kernel")
    assert row["loop_allocations"] == [], row["loop_allocations"]
    per_sm = -(-row["grid"][0] // 132)
    allocated = -(-row["registers"] // 8) * 8          # registers are allocated to a warp in units of 8 per thread
    assert per_sm * row["num_warps"] * 32 * allocated <= 65536, (per_sm, row["num_warps"], row["registers"])


def test_hard_max_gradients_gather_and_bin_in_two_launches(hopper, ampere):
    """ColPali B256's backward (8192 arg-max entries per document): dQ a gather of 8 query rows x 8 columns per step
    on the CUDA cores (1024 programs, no partial sums), then the binned dD, one program of 4 warps per block of 64
    tokens (256 x 17 of them), each holding its document's 8192 entries in registers to pick its own, which it
    multiplies by their query rows on the tensor cores (wgmma on Hopper, mma.sync before), its registers capped at
    128 for 4 programs per SM, which spills a little to the stack (faster so); no local memory, at most 48 KiB of
    shared memory."""
    case = "train bf16 ColPali B256"
    for rows, mma in ((hopper[1], "wgmma bf16"), (ampere[1], "mma.sync bf16")):
        gather = _by_case(rows, case, "maxsim_bwd_dq_gather_kernel")
        binned = _by_case(rows, case, "maxsim_bwd_dd_binned_kernel")
        assert not gather["mma"] and binned["num_warps"] == 4 and set(binned["mma"]) == {mma}
        for row in (gather, binned):
            assert row["local_bytes"] == 0 and row["shared_bytes"] <= 48 * 1024
        assert gather["stack_bytes"] == 0
        assert binned["registers"] <= tuning.BINNED_DD_MAXNREG and binned["stack_bytes"] <= 256
        assert gather["grid"] == [256 * 32 // 8] and binned["grid"] == [256 * 17]


def test_compute_bound_tiles_take_hopper_wgmma(hopper, ampere):
    for case in ("bf16 64x1k 32x300 (256 rows)", "bf16 1x300 1024x1024 (256 rows)"):
        row = _by_case(hopper[1], case)
        assert row["num_warps"] == 8 and row["meta"]["TOKB"] * row["meta"]["QPB"] == 256
        assert set(row["mma"]) == {"wgmma bf16"}, row["mma"]
        assert set(_by_case(ampere[1], case)["mma"]) == {"mma.sync bf16"}   # no wgmma before Hopper
    assert set(_by_case(hopper[1], "fp32 tf32")["mma"]) == {"wgmma tf32"}
    assert not _by_case(ampere[1], "int8 1x4k 1024x1024 (runs of documents by TMA)")["meta"]["TMA_DOCS"]  # no TMA
    assert _by_case(hopper[1], "fp32 highest (CUDA cores)")["mma"] == {}   # full fp32: FMA, no tensor cores
    assert _by_case(hopper[1], "bf16 16x32 32x8192 (token split)")["meta"]["ROW_OUT"]


def test_partial_row_maxima_fold_a_tile_without_shuffles(hopper):
    """256-row tiles keep 8 partial maxima per row across a document's tiles (``ROW_PARTIALS``): a tile folds in
    with no shuffle across threads (the columns each partial covers are those one thread of the wgmma accumulator
    holds) and fewer maxima, in the same shared memory (no layout change through it); one running max per row
    shuffles in every tile."""
    partial = _by_case(hopper[1], "bf16 64x1k 32x300 (256 rows) one document per program")
    single = _by_case(hopper[1], "bf16 64x1k 32x300 (256 rows) one max per row")
    assert (partial["meta"]["ROW_PARTIALS"], single["meta"]["ROW_PARTIALS"]) == (8, 1)
    assert partial["shared_bytes"] == single["shared_bytes"]
    assert len(partial["loops"]) == len(single["loops"]) == 2          # whole tiles, then the peeled last one
    for p, s in zip(partial["loops"], single["loops"]):
        assert p["ops"].get("SHFL.BFLY", 0) == 0 < s["ops"].get("SHFL.BFLY", 0), (p["ops"], s["ops"])
        assert p["ops"]["FMNMX.NAN"] < s["ops"]["FMNMX.NAN"]


def test_partial_maxima_over_pairs_fit_the_int8_grids_registers(hopper):
    """4 partial row maxima over column pairs (one per thread of a quad) on the int8 compute-bound grid: its
    168-register cap holds them with nothing stored to the stack in the bit-cast tile loop, as one max per row."""
    pairs = _by_case(hopper[1], "int8 1x4k 1024x1024 partial maxima over pairs")
    default = _by_case(hopper[1], "int8 1x4k 1024x1024 (runs of documents by TMA)")
    assert (pairs["meta"]["ROW_PARTIALS"], default["meta"]["ROW_PARTIALS"]) == (4, 1)
    assert pairs["meta"]["BITCAST_SUMS"] and pairs["registers"] <= 168
    for row in (pairs, default):
        loops = [loop for loop in row["loops"] if "IGMMA.64x128x32.S8.S8" in loop["ops"]]
        assert loops and not any(_spill_instructions(loop) for loop in loops)


def test_narrow_tail_tiles_take_narrow_products_in_the_tail_loop_only(hopper):
    """``TAIL_N``: the peeled tail's loop multiplies 16- or 32-token tiles (wgmma m64n16 / m64n32) while the loop of
    whole tiles keeps its 64-token products, in the same shared memory and with nothing spilled."""
    default = _by_case(hopper[1], "bf16 64x1k 32x300 (256 rows) one document per program")
    for tail in (16, 32):
        row = _by_case(hopper[1], f"bf16 64x1k 32x300 (256 rows) {tail}-token tail")
        assert row["meta"]["TAIL_N"] == tail and "TAIL_N" not in default["meta"]
        assert row["local_bytes"] == 0 and row["shared_bytes"] == default["shared_bytes"]
        products = sorted(op for loop in row["loops"] for op in loop["ops"] if "GMMA" in op)
        assert products == sorted(["HGMMA.64x64x16.F32.BF16", f"HGMMA.64x{tail}x16.F32.BF16"]), products


def test_several_documents_each_peeled_keep_the_tile_loops_of_one(hopper):
    """``PEEL_EACH_DOC`` at 128 registers (2 programs of 8 warps per SM, as one document per program runs): the
    loops over a document's whole tiles and its last tile are those of one document per program within a few
    instructions (the same products, the last tile's per-element tests only there), nothing spilled inside them."""
    one = _by_case(hopper[1], "bf16 64x1k 32x300 (256 rows) one document per program")
    each = _by_case(hopper[1], "bf16 64x1k 32x300 (256 rows) 4 documents, each peeled, 128 registers")
    assert each["meta"]["PEEL_EACH_DOC"] and each["meta"]["MULTI_DOC"] and each["registers"] <= 128
    assert each["shared_bytes"] == one["shared_bytes"] and len(each["loops"]) == len(one["loops"]) == 2
    for e, o in zip(each["loops"], one["loops"]):
        assert e["ops"]["HGMMA.64x64x16.F32.BF16"] == o["ops"]["HGMMA.64x64x16.F32.BF16"]
        assert e["ops"].get("FSEL", 0) == o["ops"].get("FSEL", 0)
        assert not _spill_instructions(e)
        assert abs(e["instructions"] - o["instructions"]) <= 0.1 * o["instructions"]


def test_documents_ending_inside_a_tile_default_to_peeled_runs_at_128_registers(hopper):
    """The 256-row default where documents end inside a tile: about 2 programs per SM, each scoring a
    share of the documents with a loop per document, its last tile in 16-token products; within 128 registers (2
    programs of 8 warps per SM), nothing spilled in a loop."""
    row = _by_case(hopper[1], "bf16 64x1k 32x300 (256 rows)")
    assert row["meta"]["PEEL_EACH_DOC"] and row["meta"]["MULTI_DOC"] and row["meta"]["TAIL_N"] == 16
    assert row["registers"] <= 128 and row["grid"] == [2 * 132]
    # the whole-tile loop and the tail loop (the TMA copies' barrier wait is a loop of its own, a few instructions)
    tile_loops = [loop for loop in row["loops"] if loop["instructions"] > 16]
    assert len(tile_loops) == 2, row["loops"]
    for loop in row["loops"]:
        assert not _spill_instructions(loop)
    products = sorted(op for loop in tile_loops for op in loop["ops"] if "GMMA" in op)
    assert products == ["HGMMA.64x16x16.F32.BF16", "HGMMA.64x64x16.F32.BF16"], products
    # the whole tiles arrive by TMA (no per-thread copies in their loop), the tail's by the threads
    whole, tail = sorted(tile_loops, key=lambda loop: "HGMMA.64x16x16.F32.BF16" in loop["ops"])
    assert any(op.startswith("UTMALDG") for op in whole["ops"]) and not any("LDGSTS" in op for op in whole["ops"])
    assert any("LDGSTS" in op for op in tail["ops"])


def _tile_loops(row):
    """The tile loops of a compiled kernel (a TMA copy's barrier wait is a loop of its own, of a few instructions)."""
    return [loop for loop in row["loops"] if loop["instructions"] > 16]


def test_training_forward_on_long_documents_takes_256_rows_without_spills(hopper):
    """The training forward's default on ColPali-length documents: 256-row tiles on 8 warps, 3 stages,
    the last tile in 16-token products, nothing spilled in either loop."""
    for case in ("train bf16 ColPali B64 32x1030 (256 rows)", "train bf16 ColPali B64 32x1030 (256 rows), one max "
                 "per row"):
        row = _by_case(hopper[1], case)
        assert row["meta"]["SAVE_AUX"] and row["meta"]["QPB"] * row["meta"]["TOKB"] == 256
        assert (row["num_warps"], row["num_stages"], row["meta"]["TAIL_N"]) == (8, 3, 16)
        assert row["local_bytes"] == 0 and len(_tile_loops(row)) == 2
        for loop in row["loops"]:
            assert not _spill_instructions(loop)
        products = sorted(op for loop in row["loops"] for op in loop["ops"] if "GMMA" in op)
        assert products == ["HGMMA.64x16x16.F32.BF16", "HGMMA.64x64x16.F32.BF16"], products


@pytest.mark.parametrize("case", ["train bf16 in-batch B128 32x300", "train bf16 B64 + 7 negatives 32x300",
                                  "train bf16 ColPali B64 32x1030 (256 rows)"])
def test_training_forward_arg_max_pairs_fold_tiles_without_shuffles(hopper, case):
    """The training forward's hard max: 8 partial (max, arg-max) pairs per row fold each tile with a compare, a max
    and a select per similarity and no shuffle or integer min-reduction, in fewer instructions per tile than one max
    and arg-max per row, on no more shared memory (the splits move no data), nothing spilled; Hopper copies the whole
    tiles by TMA, the tail by the threads."""
    pairs = _by_case(hopper[1], case)
    single = _by_case(hopper[1], case + ", one max per row")
    assert (pairs["meta"]["ROW_PARTIALS"], single["meta"]["ROW_PARTIALS"]) == (8, 1)
    assert pairs["meta"]["TMA_DOCS"] and not single["meta"]["TMA_DOCS"]
    # TMA's barrier takes a few bytes
    assert pairs["shared_bytes"] <= single["shared_bytes"] + 64 and pairs["local_bytes"] == 0
    loops, single_loops = _tile_loops(pairs), _tile_loops(single)
    assert len(loops) == len(single_loops) == 2
    for p, s in zip(loops, single_loops):        # longest first: the partial tile's loop, then the whole tiles'
        assert p["ops"].get("SHFL.BFLY", 0) == 0 < s["ops"].get("SHFL.BFLY", 0), (p["ops"], s["ops"])
        assert not any(op.startswith("VIMNMX") for op in p["ops"]), p["ops"]
        assert p["instructions"] < s["instructions"]
        assert not _spill_instructions(p)
    whole = next(loop for loop in loops if "HGMMA.64x64x16.F32.BF16" in loop["ops"] and not any(
        "LDGSTS" in op for op in loop["ops"]))
    assert any(op.startswith("UTMALDG") for op in whole["ops"])


def test_smooth_gradients_load_each_streamed_tile_once(hopper):
    """The smooth max's dQ (document tiles) and dD (blocks of query rows) load each streamed tile once for their two
    products: half the 128-bit loads per iteration of the tile loops of the two loads before (``RELOAD_TILE``), and
    dQ in one pipeline buffer less of shared memory."""
    for programs in ("dq", "dd"):
        once = _by_case(hopper[1], "train bf16 smooth ColPali B16 unmasked", "maxsim_bwd_kernel", programs)
        twice = _by_case(hopper[1], "train bf16 smooth ColPali B16 unmasked, tiles loaded twice",
                         "maxsim_bwd_kernel", programs)

        def wide_loads(row):
            return sum(n for loop in row["loops"] for op, n in loop["ops"].items()
                       if op in ("LDGSTS.E.BYPASS.128", "LDG.E.128"))
        assert 0 < 2 * wide_loads(once) <= wide_loads(twice), programs
        assert once["shared_bytes"] <= twice["shared_bytes"] and once["local_bytes"] == 0, programs
    assert (_by_case(hopper[1], "train bf16 smooth ColPali B16 unmasked", "maxsim_bwd_kernel", "dq")["shared_bytes"]
            < _by_case(hopper[1], "train bf16 smooth ColPali B16 unmasked, tiles loaded twice", "maxsim_bwd_kernel",
                       "dq")["shared_bytes"])


def test_padded_features_and_128_rows_stream_in_runs(hopper):
    """d = 96 (features padded to 128) streaming one query: several documents per program (a run whose tiles
    straddle them), 2 warps in at most 128 registers (8 programs per SM); 128 query rows over runs of whole tiles:
    8 warps. Both copy whole tiles by TMA on Hopper (the direct launch encodes the descriptor once per index)."""
    h = _by_case(hopper[1], "bf16 d=96 1x2.1k 31x257 (runs of 8 per SM)")
    assert h["meta"]["MULTI_DOC"] and h["meta"]["TMA_DOCS"] and h["meta"]["BLOCK_D"] == 128
    assert h["num_warps"] == 2 and h["registers"] <= 128
    h = _by_case(hopper[1], "bf16 1x300 128x1024 (runs on 8 warps)")
    assert h["meta"]["MULTI_DOC"] and h["meta"]["TMA_DOCS"] and h["num_warps"] == 8
    assert set(h["mma"]) == {"wgmma bf16"}


def test_fp8_documents_are_not_compiled_for_ampere(ampere):
    assert not any(r["case"].startswith("fp8") for r in ampere[1])


@triton.jit
def _dot_with_k8(A, B, C, K: tl.constexpr):
    rows = tl.arange(0, 16)
    ks = tl.arange(0, K)
    a = tl.load(A + rows[:, None] * K + ks[None, :])
    b = tl.load(B + ks[:, None] * 16 + rows[None, :])
    tl.store(C + rows[:, None] * 16 + rows[None, :], tl.dot(a, b))


_BROKEN = f"""
import sys, torch
sys.path.insert(0, {str(SCRIPT.parent)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
import offline_compile
from test_offline_compile import _dot_with_k8
from triton.backends.compiler import GPUTarget
a, b, c = torch.empty(16, 8, dtype=torch.bfloat16), torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(16, 16)
try:
    offline_compile.compile_launch((_dot_with_k8, (1,), (a, b, c), (), {{"K": 8}}), GPUTarget("cuda", 90, 32))
except Exception as exc:
    print("compile error:", type(exc).__name__)
else:
    print("compiled")
"""


@pytest.mark.skipif(not launch.interpreting(), reason="shows what the interpreter accepts")
def test_catches_what_the_interpreter_accepts():
    """A dot with an inner dimension of 8 runs under the interpreter but does not compile (tensor cores need
    K >= 16): the offline compile reports it."""
    a = torch.randn(16, 8, dtype=torch.bfloat16)
    b = torch.randn(8, 16, dtype=torch.bfloat16)
    c = torch.empty(16, 16)
    _dot_with_k8[(1,)](a.float(), b.float(), c, K=8)
    torch.testing.assert_close(c, a.float() @ b.float())
    proc = subprocess.run([sys.executable, "-c", _BROKEN], capture_output=True, text=True, env=_env(), timeout=300)
    assert "compile error: CompilationError" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
