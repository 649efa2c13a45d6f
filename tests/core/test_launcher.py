"""The host side of the kernels: the direct launch (kernels/direct_launch.py) against stand-ins for Triton's JIT
function, compiled kernel and C launcher; the tile policy (kernels/tuning.py) as tables of shape -> config fields;
the launch plans (kernels/launch.py) a layout gets from a config."""

from types import SimpleNamespace
from typing import NamedTuple, Optional

import pytest
import torch

from flash_maxsim.kernels import direct_launch, launch, tuning


class FakeTensor:
    is_cuda = True

    def __init__(self, ptr, dtype=torch.float32):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self):
        return self.ptr


class Compiled:
    """Triton's compiled kernel: ``compiled[grid]`` is a runner reading grid[0..2] and taking every argument."""

    def __init__(self, jit):
        self.jit = jit

    def __getitem__(self, grid):
        def runner(*args):
            if self.jit.fail_direct:
                raise TypeError("runner takes other arguments")
            self.jit.direct.append(((grid[0], grid[1], grid[2]), args))
        return runner


class FakeJIT:
    """Triton's JIT function: ``kernel[grid](*args, **meta)`` binds (recorded) and returns the compiled kernel."""

    def __init__(self):
        names = [("X", False), ("Y", False), ("n", False), ("BLOCK", True), ("FLAG", True)]
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in names]
        self.bound, self.direct = [], []
        self.fail_direct = False

    def __getitem__(self, grid):
        def bind(*args, **meta):
            self.bound.append((grid, args, meta))
            return Compiled(self)
        return bind


@pytest.fixture
def fresh_launcher(monkeypatch):
    monkeypatch.setattr(direct_launch, "_RUNNERS", {})
    monkeypatch.setattr(direct_launch, "_enabled", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_second_launch_reuses_the_compiled_kernel_with_constexprs_appended(fresh_launcher):
    kernel = FakeJIT()
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True, num_warps=4)
    direct_launch.launch(kernel, (7,), (x, y), (5,), meta)
    direct_launch.launch(kernel, (7,), (x, y), (5,), meta)
    assert len(kernel.bound) == 1 and kernel.bound[0][1] == (x, y, 5)
    assert kernel.direct == [((7, 1, 1), (x, y, 5, 64, True))]


@pytest.mark.parametrize("on_cuda", [True, False])
def test_triton_compiles_with_fp_fusion_requested_explicitly(fresh_launcher, on_cuda):
    """Every binding through Triton asks for fp fusion by name (its default up to 3.9, which 3.9 warns about and
    3.10 turns off), next to the launch's own meta, on the cached path and on Triton's own."""
    kernel = FakeJIT()
    x = FakeTensor(1024)
    x.is_cuda = on_cuda
    direct_launch.launch(kernel, (3,), (x,), (5,), dict(BLOCK=64, FLAG=False, num_warps=4))
    assert kernel.bound[0][2] == dict(BLOCK=64, FLAG=False, num_warps=4, enable_fp_fusion=True)


def test_constexprs_the_launch_leaves_out_take_their_defaults(fresh_launcher):
    """A constexpr parameter with a default that the launch's meta omits is bound to that default, as Triton's own
    binding does, so the launch still goes direct (a missing one without default keeps Triton's path)."""
    kernel = FakeJIT()
    kernel.params.append(SimpleNamespace(name="OPTION", is_constexpr=True, has_default=True, default=7))
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True, num_warps=4)
    direct_launch.launch(kernel, (7,), (x, y), (5,), meta)
    direct_launch.launch(kernel, (7,), (x, y), (5,), meta)
    assert kernel.direct == [((7, 1, 1), (x, y, 5, 64, True, 7))]
    kernel.params.append(SimpleNamespace(name="REQUIRED", is_constexpr=True, has_default=False))
    assert direct_launch._constexpr_tail(kernel, 3, meta) is None


def test_new_scalars_dtype_or_alignment_bind_again(fresh_launcher):
    kernel = FakeJIT()
    meta = dict(BLOCK=64, FLAG=False)
    x, y = FakeTensor(1024), FakeTensor(2048)
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    direct_launch.launch(kernel, (3,), (x, y), (6,), meta)                       # another integer argument
    direct_launch.launch(kernel, (3,), (FakeTensor(1026), y), (5,), meta)        # 2-byte aligned pointer
    direct_launch.launch(kernel, (3,), (FakeTensor(1024, torch.bfloat16), y), (5,), meta)
    direct_launch.launch(kernel, (3,), (x, y), (5,), dict(BLOCK=32, FLAG=False))  # another constexpr
    assert len(kernel.bound) == 5 and kernel.direct == []
    direct_launch.launch(kernel, (3,), (FakeTensor(4096), y), (5,), meta)        # same key, other (aligned) data
    assert kernel.direct == [((3, 1, 1), (kernel.direct[0][1][0], y, 5, 64, False))]
    assert kernel.direct[0][1][0].ptr == 4096


def test_runner_failure_falls_back_to_tritons_path(fresh_launcher):
    kernel = FakeJIT()
    meta = dict(BLOCK=64, FLAG=False)
    x, y = FakeTensor(1024), FakeTensor(2048)
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    kernel.fail_direct = True
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    assert len(kernel.bound) == 2 and kernel.direct == []
    assert not direct_launch._enabled
    kernel.fail_direct = False
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    assert len(kernel.bound) == 3 and kernel.direct == []


def test_a_plan_keys_its_launches_by_identity_and_alignment(fresh_launcher):
    """With a plan (an object fixing grid, scalars, meta and dtypes) the key is the plan itself plus the pointers'
    alignment: the same plan with aligned data reuses the runner; a misaligned pointer, or another plan object with
    equal contents, binds again."""
    kernel = FakeJIT()
    meta = dict(BLOCK=64, FLAG=False)
    plan, twin = object(), object()
    x, y = FakeTensor(1024), FakeTensor(2048)
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta, None, plan)
    direct_launch.launch(kernel, (3,), (FakeTensor(4096), y), (5,), meta, None, plan)   # other aligned data
    assert len(kernel.bound) == 1 and kernel.direct[0][1][0].ptr == 4096
    direct_launch.launch(kernel, (3,), (FakeTensor(1026), y), (5,), meta, None, plan)   # 2-byte aligned pointer
    direct_launch.launch(kernel, (3,), (FakeTensor(1026), y), (5,), meta, None, plan)
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta, None, twin)
    assert len(kernel.bound) == 3 and len(kernel.direct) == 2
    assert kernel.direct[1][1][0].ptr == 1026


def test_cpu_tensors_always_take_tritons_path(fresh_launcher):
    kernel = FakeJIT()
    x = FakeTensor(1024)
    x.is_cuda = False
    for _ in range(2):
        direct_launch.launch(kernel, (3,), (x,), (5,), dict(BLOCK=64, FLAG=False))
    assert len(kernel.bound) == 2 and kernel.direct == []



# --- Triton's C launcher called directly (the layouts of Triton 3.6 and of 3.7-3.9) -------------------------------

@pytest.mark.parametrize("version, base_args_format, layout", [
    ("3.6.0", "iiiKKppOOOOOO", direct_launch.LAYOUT_ARGUMENTS),
    ("3.6.1", "iiiKKppOOOOOOO", None),                      # a 3.6 laid out otherwise
    ("3.7.0", None, direct_launch.LAYOUT_SEQUENCE),
    ("3.8.0", None, direct_launch.LAYOUT_SEQUENCE),
    ("3.9.1", None, direct_launch.LAYOUT_SEQUENCE),
    ("3.10.0", None, None),                                 # not read: Triton's own runner
    ("3.5.0", None, None),
])
def test_c_launcher_layout_by_triton_version(version, base_args_format, layout):
    assert direct_launch._launcher_layout(version, base_args_format) == layout


class CLauncher:
    """Triton's C launcher: no ``__code__`` (a built-in), records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class HookChain:
    def __init__(self):
        self.calls = []


class CompiledWithLauncher(Compiled):
    """A compiled kernel whose ``run`` is laid out as Triton 3.6's CudaLauncher; ``wrapped``: its ``launch`` is
    the tensor-descriptor wrapper, a closure over the C function."""

    def __init__(self, jit, c_launch, wrapped=False, scratch=0, desc_meta=None, annotations=None):
        super().__init__(jit)
        if wrapped:
            launch = (lambda launcher: lambda *args: launcher(*args))(c_launch)
        else:
            launch = c_launch
        self.run = SimpleNamespace(launch=launch, global_scratch_size=scratch, profile_scratch_size=0,
                                   launch_cooperative_grid=False, launch_pdl=True)
        if annotations is not None:       # the sequence layout's (Triton 3.7-3.9) annotations and C signature
            self.run.arg_annotations, self.run.kernel_signature = annotations, b"signature"
        self.function, self.packed_metadata = 0xF00, (4, 1, 0)
        self.metadata = SimpleNamespace(tensordesc_meta=desc_meta)


class JITWithLauncher(FakeJIT):
    def __init__(self, **compiled_kwargs):
        super().__init__()
        self.c_launch = CLauncher()
        self.compiled_kwargs = compiled_kwargs

    def __getitem__(self, grid):
        def bind(*args, **meta):
            self.bound.append((grid, args, meta))
            return CompiledWithLauncher(self, self.c_launch, **self.compiled_kwargs)
        return bind


def _launch_parts(monkeypatch, layout):
    """Triton's launch parts with the given C launcher layout: an encoder that records what it encodes, hooks, a
    stream."""
    encoded = []

    def encode(desc, meta):
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape), meta))
        return [f"tma@{desc.base.data_ptr()}", *desc.shape, *desc.strides]
    runtime = SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain())
    monkeypatch.setattr(direct_launch, "_triton_launch_parts",
                        lambda: (layout, encode, runtime, lambda device: 77 + device))
    return SimpleNamespace(encoded=encoded, runtime=runtime)


@pytest.fixture
def c_launches(fresh_launcher, monkeypatch):
    """Triton 3.6's launch parts."""
    return _launch_parts(monkeypatch, direct_launch.LAYOUT_ARGUMENTS)


@pytest.fixture
def sequence_launches(fresh_launcher, monkeypatch):
    """Triton 3.7-3.9's launch parts."""
    return _launch_parts(monkeypatch, direct_launch.LAYOUT_SEQUENCE)


def test_repeated_launches_call_tritons_c_launcher_with_integer_pointers(c_launches):
    kernel = JITWithLauncher()
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True)
    direct_launch.launch(kernel, (7,), (x, y), (5,), meta)
    direct_launch.launch(kernel, (7,), (FakeTensor(4096), y), (5,), meta)
    assert len(kernel.bound) == 1 and kernel.direct == []
    # grid, the current stream, function, cooperative, PDL, no scratch, the kernel's metadata, no launch metadata
    # or hooks, then the arguments in order: addresses, scalars, constexprs
    assert kernel.c_launch.calls == [(7, 1, 1, 77, 0xF00, False, True, None, None, (4, 1, 0), None, None, None,
                                      4096, 2048, 5, 64, True)]


def test_launch_hooks_send_the_call_through_the_runner(c_launches):
    kernel = JITWithLauncher()
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=False)
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    c_launches.runtime.launch_enter_hook.calls.append(print)      # a profiler's hook
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    assert kernel.c_launch.calls == [] and kernel.direct == [((3, 1, 1), (x, y, 5, 64, False))]
    c_launches.runtime.launch_enter_hook.calls.clear()
    direct_launch.launch(kernel, (3,), (x, y), (5,), meta)
    assert len(kernel.c_launch.calls) == 1 and len(kernel.direct) == 1


@pytest.mark.parametrize("layout", [dict(scratch=256), dict(desc_meta=None), dict(desc_meta=[None])])
def test_kernels_laid_out_otherwise_keep_the_runner(c_launches, layout):
    """Scratch memory to allocate, or a descriptor Triton did not lower to TMA: the compiled runner, as before."""
    kernel = JITWithLauncher(wrapped=True, **layout)
    kernel.params.insert(2, SimpleNamespace(name="DESC", is_constexpr=False))
    x = FakeTensor(1024, torch.bfloat16)
    desc = direct_launch.TensorDesc(0, (64, 32), (32, 1), (16, 32))
    direct_launch.launch(kernel, (3,), (x, FakeTensor(2048)), (desc, 5), dict(BLOCK=64, FLAG=False))
    direct_launch.launch(kernel, (3,), (x, FakeTensor(2048)), (desc, 5), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1
    runner_desc = kernel.direct[0][1][2]
    assert (runner_desc.base, runner_desc.shape, runner_desc.block_shape) == (x, [64, 32], [16, 32])


def test_another_c_launcher_format_keeps_the_runner(c_launches, monkeypatch):
    monkeypatch.setattr(direct_launch, "_triton_launch_parts", lambda: (None, None, None, None))
    kernel = JITWithLauncher()
    for _ in range(2):
        direct_launch.launch(kernel, (3,), (FakeTensor(1024), FakeTensor(2048)), (5,), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1


def test_tensor_descriptors_are_encoded_once_per_address(c_launches):
    """A descriptor argument reaches Triton's first launch as its TensorDescriptor, and the C launcher as its
    encoded arguments, encoded again only for documents at another address; the cache holds no tensor."""
    import weakref
    kernel = JITWithLauncher(wrapped=True, desc_meta=[{"swizzle": 128}])
    kernel.params.insert(2, SimpleNamespace(name="DESC", is_constexpr=False))
    q = FakeTensor(1024)
    desc = direct_launch.TensorDesc(1, (64, 32), (32, 1), (16, 32))
    meta = dict(BLOCK=64, FLAG=False)
    plan = object()
    docs = [FakeTensor(4096, torch.bfloat16), FakeTensor(8192, torch.bfloat16)]
    for d in (docs[0], docs[0], docs[1], docs[0]):
        direct_launch.launch(kernel, (3,), (q, d), (desc, 5), meta, None, plan)
    first = kernel.bound[0][1][2]
    assert len(kernel.bound) == 1 and (first.base, first.shape, first.strides) == (docs[0], [64, 32], [32, 1])
    assert c_launches.encoded == [(4096, (64, 32), (32, 1), (16, 32), {"swizzle": 128}),
                                  (8192, (64, 32), (32, 1), (16, 32), {"swizzle": 128})]
    args = [call[13:] for call in kernel.c_launch.calls]
    assert args == [(1024, 4096, "tma@4096", 64, 32, 32, 1, 5, 64, False),
                    (1024, 8192, "tma@8192", 64, 32, 32, 1, 5, 64, False),
                    (1024, 4096, "tma@4096", 64, 32, 32, 1, 5, 64, False)]
    alive = weakref.ref(docs[1])
    del docs[1], d
    assert alive() is None, "the launch cache keeps the documents alive"


def test_sequence_layout_passes_the_arguments_as_one_tuple_after_annotations_and_signature(sequence_launches):
    """Triton 3.7-3.9: grid, stream, function, cooperative, PDL, the kernel's metadata, no launch metadata, hooks
    or scratch, the annotations and C signature, then every argument (addresses, scalars, constexprs) in one
    tuple."""
    annotations = ["ptr", "ptr", "i32", "constexpr", "constexpr"]
    kernel = JITWithLauncher(annotations=annotations)
    y = FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True)
    direct_launch.launch(kernel, (7,), (FakeTensor(1024), y), (5,), meta)
    direct_launch.launch(kernel, (7,), (FakeTensor(4096), y), (5,), meta)
    assert len(kernel.bound) == 1 and kernel.direct == []
    assert kernel.c_launch.calls == [(7, 1, 1, 77, 0xF00, False, True, (4, 1, 0), None, None, None, None, None,
                                      annotations, b"signature", (4096, 2048, 5, 64, True))]


def test_sequence_layout_encodes_descriptors_inside_the_tuple(sequence_launches):
    kernel = JITWithLauncher(wrapped=True, desc_meta=[{"swizzle": 128}], annotations=[None] * 10)
    kernel.params.insert(2, SimpleNamespace(name="DESC", is_constexpr=False))
    q, docs = FakeTensor(1024), FakeTensor(4096, torch.bfloat16)
    desc = direct_launch.TensorDesc(1, (64, 32), (32, 1), (16, 32))
    for _ in range(2):
        direct_launch.launch(kernel, (3,), (q, docs), (desc, 5), dict(BLOCK=64, FLAG=False))
    assert sequence_launches.encoded == [(4096, (64, 32), (32, 1), (16, 32), {"swizzle": 128})]
    assert [call[-1] for call in kernel.c_launch.calls] == [(1024, 4096, "tma@4096", 64, 32, 32, 1, 5, 64, False)]


@pytest.mark.parametrize("annotations", [4, 6], ids=["fewer", "more"])
def test_sequence_layout_with_another_argument_count_keeps_the_runner(sequence_launches, annotations):
    """Triton's C code reads one argument per annotation without counting them: a kernel whose annotations do not
    match what the launch passes is never launched directly."""
    kernel = JITWithLauncher(annotations=[None] * annotations)
    for _ in range(2):
        direct_launch.launch(kernel, (3,), (FakeTensor(1024), FakeTensor(2048)), (5,), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1


def test_sequence_layout_without_annotations_keeps_the_runner(sequence_launches):
    kernel = JITWithLauncher()
    for _ in range(2):
        direct_launch.launch(kernel, (3,), (FakeTensor(1024), FakeTensor(2048)), (5,), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1


# --- the tile policy (kernels/tuning.py) --------------------------------------------------------------------------

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Shape(NamedTuple):
    """A problem as the policy sees it: ``Nq`` queries of ``Lq`` tokens against ``C`` documents (or ``C`` candidates
    per query, ``paired``) of ``Ld`` tokens; ``train``: the forward saves the backward's state."""
    Nq: int
    C: int
    Lq: int
    Ld: int
    d: int = 128
    paired: bool = False
    train: bool = False
    dtype: torch.dtype = BF16
    products: Optional[str] = None
    smooth: bool = False


@pytest.fixture
def h100():
    """The policy tuned for an H100 (132 SMs, TMA), fp32 products at the "highest" precision, no overrides."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with tuning.override_target(sms=132, capability=(9, 0)):
            yield
    finally:
        torch.set_float32_matmul_precision(previous)


def forward_fields(shape: Shape) -> dict:
    """The shape's ForwardConfig as a dict, with ``rows`` (TOKB * QPB) added."""
    cfg = tuning.forward_config(shape.Nq, shape.C, shape.Lq, shape.Ld, shape.d, shape.paired, shape.train,
                                shape.dtype, shape.products, shape.smooth)
    return dict(cfg.__dict__, rows=cfg.TOKB * cfg.QPB)


def _row(shape, expected, id):
    return pytest.param(shape, expected, id=id)


# shape -> expected ForwardConfig fields (the rest as the policy chooses them), on an H100
FORWARD_CONFIGS = [
    # compute-bound scoring: 256-row tiles on 8 warps with 8 partial maxima per row
    _row(Shape(1, 10000, 1024, 1024), dict(rows=256, num_warps=8, ROW_PARTIALS=8, WHOLE_TILE_MASKS=True,
                                          PROGRAMS_PER_SM=2, TMA_DOCS=False), "1x10k-1024x1024"),
    _row(Shape(1, 1000, 512, 1024), dict(rows=256, ROW_PARTIALS=8), "1x1k-512x1024"),
    _row(Shape(1, 1000, 1024, 1024), dict(rows=256, ROW_PARTIALS=8), "1x1k-1024x1024"),
    # documents that end inside a tile: peeled runs of a share of the documents, 2 programs per SM
    _row(Shape(64, 1000, 32, 300), dict(TOKB=32, QPB=8, num_warps=8, ROW_PARTIALS=8, PEELED_RUNS=True,
                                        PROGRAMS_PER_SM=2, PEEL_EACH_DOC=True, MAXNREG=128, TAIL_N=16,
                                        TMA_DOCS=True, PEEL_TAIL=True), "64x1k-32x300"),
    # 128-row runs of whole tiles: 8 warps, copied by TMA
    _row(Shape(1, 1000, 128, 1024), dict(rows=128, num_warps=8, TMA_DOCS=True, PROGRAMS_PER_SM=2, ROW_PARTIALS=1),
         "1x1k-128x1024"),
    # int8 / fp8 products on the compute-bound grid: 128 x 128 tiles, 3 programs per SM, queries quantised first
    _row(Shape(1, 10000, 1024, 1024, products="int8"),
         dict(rows=128, BLOCK_N=128, PROGRAMS_PER_SM=24, MAXNREG=168, QUANTIZE_FIRST=True, PREFETCH_TOKENS=True,
              TMA_DOCS=True, BITCAST_SUMS=True, num_stages=3, CHAINED_MAX=True, ROW_PARTIALS=1),
         "int8-1x10k-1024x1024"),
    _row(Shape(1, 10000, 1024, 1030, products="int8"), dict(BITCAST_SUMS=False, num_stages=3, CHAINED_MAX=False),
         "int8-1x10k-1024x1030"),
    _row(Shape(1, 10000, 1024, 1024, products="fp8"),
         dict(BLOCK_N=128, PROGRAMS_PER_SM=24, ROW_PARTIALS=8, BITCAST_SUMS=False,
              CHAINED_MAX=tuning.REDUCE_IS_A_TREE), "fp8-1x10k-1024x1024"),
    _row(Shape(1, 8, 1024, 1024, products="int8"), dict(PROGRAMS_PER_SM=0), "int8-too-few-pairs"),
    # bandwidth-bound scoring (at most 32 query tokens per document token): one masked loop, 2 warps from 2^19
    # streamed tokens
    _row(Shape(1, 1000, 32, 300), dict(PEEL_TAIL=False, num_warps=4, PROGRAMS_PER_SM=0, ROW_PARTIALS=1),
         "1x1k-32x300"),
    _row(Shape(1, 10000, 32, 300), dict(PEEL_TAIL=False, num_warps=2, PROGRAMS_PER_SM=0), "1x10k-32x300"),
    _row(Shape(1, 10000, 32, 1030), dict(num_warps=2, ROW_PARTIALS=1), "1x10k-32x1030"),
    _row(Shape(1, 1000, 32, 1024), dict(num_warps=2, PROGRAMS_PER_SM=2, TMA_DOCS=False), "1x1k-32x1024"),
    _row(Shape(1, 1000, 32, 1024, dtype=FP16), dict(PROGRAMS_PER_SM=2), "fp16-1x1k-32x1024"),
    _row(Shape(4, 8, 32, 300, paired=True), dict(PEEL_TAIL=False), "candidates-4x8-32x300"),
    _row(Shape(64, 30, 32, 300, paired=True), dict(num_warps=2), "candidates-64x30-32x300"),
    # features padded to the tile (d=96 in 128): runs of documents straddled by the tiles, 8 per SM, TMA copies
    _row(Shape(1, 5000, 31, 257, 96), dict(PEEL_TAIL=False, num_warps=2, PROGRAMS_PER_SM=8, MAXNREG=128,
                                          TMA_DOCS=True, BLOCK_D=128), "d96-1x5k-31x257"),
    _row(Shape(1, 5000, 31, 256, 96), dict(PROGRAMS_PER_SM=2), "d96-whole-tiles"),
    _row(Shape(1, 5000, 31, 257, 128), dict(PROGRAMS_PER_SM=0), "d128-1x5k-31x257"),
    _row(Shape(1, 50, 31, 257, 96), dict(PROGRAMS_PER_SM=0), "d96-few-tokens"),
    # chunked features (d > 256): 128-token tiles, a peeled tail, 4 warps, runs of documents
    _row(Shape(1, 10000, 32, 180, 384), dict(BLOCK_N=128, D_CHUNKS=3, PEEL_TAIL=True, num_warps=4,
                                            PROGRAMS_PER_SM=2), "d384-1x10k-32x180"),
    # few long documents: their tokens split over about 2 programs per SM, on 8 warps
    _row(Shape(16, 32, 32, 8192), dict(rows=128, DSPLIT=2, num_warps=8, ROW_PARTIALS=8), "16x32-32x8192"),
    _row(Shape(1, 100, 32, 8192), dict(DSPLIT=2, num_warps=8, ROW_PARTIALS=1), "1x100-32x8192"),
    _row(Shape(1, 32, 32, 8192), dict(DSPLIT=8, ROW_PARTIALS=1), "1x32-32x8192"),
    # 8-bit products streaming one query: 8 programs per SM, the token-rows kernel where runs form
    _row(Shape(1, 10000, 32, 300, products="int8"),
         dict(num_warps=2, MAXNREG=128, PROGRAMS_PER_SM=8, TOKEN_ROWS=True, TOKEN_ROWS_TMA=True, TOKEN_ROWS_BLOCK_N=64,
              PEEL_TAIL=False), "int8-1x10k-32x300"),
    _row(Shape(1, 10000, 32, 1030, products="int8"), dict(num_warps=2, MAXNREG=128, PROGRAMS_PER_SM=8),
         "int8-1x10k-32x1030"),
    _row(Shape(1, 10000, 32, 300, products="fp8"),
         dict(num_warps=1, MAXNREG=0, PROGRAMS_PER_SM=8, TOKEN_ROWS=True, TOKEN_ROWS_BLOCK_N=128,
              TOKEN_ROWS_PROGRAMS_PER_SM=4, TOKEN_ROWS_MAXNREG=0), "fp8-1x10k-32x300"),
    _row(Shape(1, 10000, 32, 1030, products="fp8"), dict(num_warps=1, MAXNREG=0, PROGRAMS_PER_SM=8),
         "fp8-1x10k-32x1030"),
    _row(Shape(1, 1000, 32, 300, products="fp8"), dict(num_warps=4), "fp8-1x1k-32x300"),
    # 8-bit products reduce over at least 32 features, in one chunk
    *[_row(Shape(1, 100, 32, 300, d, products="int8"), dict(BLOCK_D=block_d, D_CHUNKS=1), f"int8-d{d}")
      for d, block_d in ((1, 32), (16, 32), (24, 32), (32, 32), (96, 128), (256, 256))],
    # the training forward
    _row(Shape(64, 1000, 32, 300, train=True), dict(rows=128, num_warps=4, num_stages=2, DSPLIT=1, TAIL_N=0,
                                                    PROGRAMS_PER_SM=0, ROW_PARTIALS=8, TMA_ONE_DOC=True),
         "train-64x1k-32x300"),
    _row(Shape(64, 512, 32, 300, train=True), dict(rows=128, num_warps=4, num_stages=2, TAIL_N=0, ROW_PARTIALS=8),
         "train-b64-7neg"),
    _row(Shape(128, 128, 32, 300, train=True), dict(rows=128, num_warps=4, num_stages=2, TAIL_N=0),
         "train-colbert-b128"),
    _row(Shape(64, 64, 32, 1030, train=True), dict(rows=256, num_warps=8, num_stages=3, TAIL_N=16, ROW_PARTIALS=8),
         "train-colpali-b64"),
    _row(Shape(64, 64, 32, 1030, train=True, dtype=FP16), dict(rows=256, num_warps=8, num_stages=3, TAIL_N=16,
                                                               ROW_PARTIALS=8), "train-colpali-b64-fp16"),
    _row(Shape(256, 256, 32, 1030, train=True), dict(rows=256, num_warps=8, num_stages=3, TAIL_N=16),
         "train-colpali-b256"),
    _row(Shape(16, 16, 32, 1030, train=True), dict(rows=128, num_warps=4, num_stages=2, TAIL_N=0),
         "train-colpali-b16"),
    _row(Shape(64, 64, 32, 1030, train=True, dtype=FP32), dict(rows=128, ROW_PARTIALS=1, TMA_ONE_DOC=False),
         "train-colpali-b64-fp32"),
    _row(Shape(64, 64, 32, 1030, paired=True, train=True), dict(rows=32, ROW_PARTIALS=1), "train-candidates"),
    _row(Shape(64, 1000, 32, 300, train=True, smooth=True), dict(ROW_PARTIALS=1, TMA_ONE_DOC=False),
         "train-smooth"),
    _row(Shape(64, 1000, 32, 300, 384, train=True), dict(ROW_PARTIALS=1), "train-d384"),
    _row(Shape(1, 8, 32, 300, train=True), dict(rows=32, ROW_PARTIALS=1), "train-32-rows"),
    _row(Shape(1, 10000, 1024, 1024, train=True), dict(PROGRAMS_PER_SM=0), "train-1x10k-1024x1024"),
    _row(Shape(1, 10000, 32, 300, train=True), dict(num_warps=4, PEEL_TAIL=True), "train-1x10k-32x300"),
    _row(Shape(4, 8, 32, 300, paired=True, train=True), dict(PEEL_TAIL=True), "train-candidates-4x8"),
    # fp32 at "highest" (FMA products): 32-wide feature chunks, 4 warps, 2 stages, no 256-row tiles or runs
    _row(Shape(64, 512, 32, 180, dtype=FP32), dict(rows=128, num_warps=4, num_stages=2, BLOCK_D=32, D_CHUNKS=4),
         "fp32-64x512-32x180"),
    _row(Shape(1, 10000, 1024, 1024, dtype=FP32), dict(PROGRAMS_PER_SM=0, rows=128), "fp32-1x10k-1024x1024"),
]


@pytest.mark.parametrize("shape, expected", FORWARD_CONFIGS)
def test_forward_config(h100, shape, expected):
    got = forward_fields(shape)
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize("needs_75, programs_per_sm, maxnreg", [(False, 8, 64), (True, 6, 0)],
                         ids=["triton-3.6-3.8", "triton-3.9"])
def test_int8_token_rows_grid_follows_the_triton_version(h100, monkeypatch, needs_75, programs_per_sm, maxnreg):
    monkeypatch.setattr(tuning, "TOKEN_ROWS_INT8_NEEDS_75_REGISTERS", needs_75)
    got = forward_fields(Shape(1, 10000, 32, 300, products="int8"))
    assert (got["TOKEN_ROWS_PROGRAMS_PER_SM"], got["TOKEN_ROWS_MAXNREG"]) == (programs_per_sm, maxnreg)


@pytest.mark.parametrize("version, at_least_3_9", [("3.9.0", True), ("3.10.0+git1234abcd", True), ("4.0.0", True),
                                                   ("3.8.0", False), ("3.6.0", False), ("main", True)])
def test_triton_versions_compare_by_major_and_minor(version, at_least_3_9):
    assert tuning.triton_at_least(version, 3, 9) == at_least_3_9


@pytest.mark.parametrize("d, dtype, precision, tiling", [
    (128, BF16, "highest", (128, 1)), (96, BF16, "highest", (128, 1)), (1024, BF16, "highest", (128, 8)),
    (128, FP16, "highest", (128, 1)), (96, FP16, "highest", (128, 1)), (1024, FP16, "highest", (128, 8)),
    (128, FP32, "highest", (32, 4)), (96, FP32, "highest", (32, 3)), (128, FP32, "high", (128, 1)),
], ids=lambda v: str(v).replace("torch.", ""))
def test_feature_tiling(d, dtype, precision, tiling):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert tuning.feature_tiling_for(d, dtype) == tiling
    finally:
        torch.set_float32_matmul_precision(previous)


def test_overrides_replace_the_policy_and_refuse_unknown_fields(h100):
    shape = Shape(1, 10000, 1024, 1024)
    with tuning.override_forward(num_stages=4), tuning.override_forward(BLOCK_N=32):
        assert (forward_fields(shape)["num_stages"], forward_fields(shape)["BLOCK_N"]) == (4, 32)
        assert tuning.FORWARD_OVERRIDES.key is not None
    assert forward_fields(shape)["num_stages"] == 3
    with tuning.override_forward(ROWS=128):               # the row tile set: no 256-row tiles
        assert forward_fields(shape)["rows"] == 128
    with pytest.raises(TypeError, match="NUM_STAGES"):
        with tuning.override_forward(NUM_STAGES=4):
            pass
    with pytest.raises(TypeError, match="BLOCK_M"):
        tuning.FORWARD_OVERRIDES["BLOCK_M"] = 64
    with pytest.raises(TypeError, match="num_warps"):     # a forward field is not a backward one
        with tuning.override_backward(num_warps=8):
            pass
    assert not tuning.FORWARD_OVERRIDES and not tuning.BACKWARD_OVERRIDES


# --- the forward's launch plans (kernels/launch.py) -------------------------------------------------------------

def forward_plan(Nq, B, Lq, Ld, d=128, *, layout="padded", candidates=0, dtype=BF16, max_len=None, save_aux=False,
                 smooth_tau=None, index=None):
    """The launch plan of a problem on empty tensors: ``layout`` "padded", "ragged" (packed, every document of Ld
    tokens) or "transposed" (padded documents whose token rows are strided by B * d); ``index``: "int8" / "fp8"
    documents with scales."""
    q = torch.empty(Nq, Lq, d, dtype=dtype)
    dtype_d = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(index, dtype)
    offsets = None
    if layout == "ragged":
        docs, offsets = torch.empty(B * Ld, d, dtype=dtype_d), torch.arange(B + 1) * Ld
    elif layout == "transposed":
        docs = torch.empty(Ld, B, d, dtype=dtype_d).transpose(0, 1)
    else:
        docs = torch.empty(*((Nq, candidates) if candidates else (B,)), Ld, d, dtype=dtype_d)
        docs = docs.flatten(0, 1) if candidates else docs
    scales = torch.empty(docs.shape[:-1]) if index else None
    return launch._forward_plan(q, docs, None, None, offsets, candidates, False, smooth_tau, save_aux,
                                max_len or Ld, scales)


def meta_of(plan, *names):
    """``plan``'s meta values (None where the plan leaves an option out), and its documents per program and grid."""
    fields = dict(plan.meta, docs=plan.docs, grid=plan.grid[0], kernel=plan.kernel.__name__)
    return {name: fields.get(name) for name in names}


# (problem, forward overrides) -> expected plan meta; ONE_DOCUMENT: the 256-row tiles' one-document-per-program
# choices instead of the peeled runs
ONE_DOCUMENT = tuning.ONE_DOCUMENT_PER_PROGRAM
FORWARD_PLANS = [
    # partial row maxima: the hard max, not in runs whose tiles straddle two documents
    pytest.param(dict(Nq=1, B=10000, Lq=1024, Ld=1024), {}, dict(ROW_PARTIALS=8, FLAT_RUN=True), id="partials"),
    pytest.param(dict(Nq=1, B=10000, Lq=1024, Ld=1024, smooth_tau=0.1), {}, dict(ROW_PARTIALS=1),
                 id="partials-not-smooth"),
    pytest.param(dict(Nq=1, B=10000, Lq=1024, Ld=1024, save_aux=True), {}, dict(ROW_PARTIALS=8),
                 id="partials-arg-max"),
    pytest.param(dict(Nq=1, B=10000, Lq=1024, Ld=1024, smooth_tau=0.1, save_aux=True), {}, dict(ROW_PARTIALS=1),
                 id="partials-not-smooth-training"),
    pytest.param(dict(Nq=1, B=10000, Lq=32, Ld=300), dict(ROW_PARTIALS=8, PROGRAMS_PER_SM=8),
                 dict(FLAT_RUN=True, STRADDLE=True, ROW_PARTIALS=1), id="partials-not-straddling"),
    # the peeled tail in narrow tiles: only where a loop over one document's tiles peels a tail that can exist
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), ONE_DOCUMENT, dict(TAIL_N=None), id="tail-off"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=16), dict(TAIL_N=16), id="tail-16"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=32), dict(TAIL_N=32), id="tail-32"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300, save_aux=True), dict(ONE_DOCUMENT, TAIL_N=16), dict(TAIL_N=16),
                 id="tail-training"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=256, layout="ragged"), dict(ONE_DOCUMENT, TAIL_N=16),
                 dict(TAIL_N=16), id="tail-ragged"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=256), dict(ONE_DOCUMENT, TAIL_N=16), dict(TAIL_N=None),
                 id="tail-whole-tiles"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=8), dict(TAIL_N=None),
                 id="tail-narrower-than-a-dot"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=64), dict(TAIL_N=None),
                 id="tail-as-wide-as-a-tile"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=16, PEEL_TAIL=False),
                 dict(TAIL_N=None), id="tail-one-masked-loop"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=16, DOCS=2), dict(TAIL_N=None),
                 id="tail-one-loop-over-documents"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, TAIL_N=16, DOCS=2, PEEL_EACH_DOC=True),
                 dict(TAIL_N=16), id="tail-each-document"),
    # several documents per program, each peeled: only in a loop over their tiles with the last one peeled
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, DOCS=4), dict(PEEL_EACH_DOC=None),
                 id="each-peeled-off"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, DOCS=4, PEEL_EACH_DOC=True),
                 dict(MULTI_DOC=True, FLAT_RUN=False, PEEL_EACH_DOC=True), id="each-peeled"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, PROGRAMS_PER_SM=2, PEEL_EACH_DOC=True),
                 dict(MULTI_DOC=True, PEEL_EACH_DOC=True), id="each-peeled-share"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, PEEL_EACH_DOC=True),
                 dict(PEEL_EACH_DOC=None), id="each-peeled-one-document"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), dict(ONE_DOCUMENT, DOCS=4, PEEL_EACH_DOC=True, PEEL_TAIL=False),
                 dict(PEEL_EACH_DOC=None), id="each-peeled-no-tail"),
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=256), dict(ONE_DOCUMENT, DOCS=4, PEEL_EACH_DOC=True),
                 dict(FLAT_RUN=True, PEEL_EACH_DOC=None), id="each-peeled-whole-tiles-run"),
    # the peeled runs (the 256-row default where documents end inside a tile) only where their loop runs
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=300), {},
                 dict(PEEL_EACH_DOC=True, MULTI_DOC=True, FLAT_RUN=False, TAIL_N=16, maxnreg=128, TMA_DOCS=True,
                      grid=2 * 132), id="peeled-runs"),
    *[pytest.param(problem, {}, dict(MULTI_DOC=False, PEEL_EACH_DOC=None, TAIL_N=None, maxnreg=None,
                                     TMA_DOCS=tma), id=f"peeled-runs-not-{name}")
      for name, problem, tma in (("ragged", dict(Nq=64, B=1000, Lq=32, Ld=300, layout="ragged"), False),
                                 ("training", dict(Nq=64, B=1000, Lq=32, Ld=300, save_aux=True), True),
                                 ("candidates", dict(Nq=64, B=0, Lq=32, Ld=300, candidates=16), False),
                                 ("padded-to-whole-tiles", dict(Nq=64, B=1000, Lq=32, Ld=320, max_len=300), False))],
    pytest.param(dict(Nq=64, B=1000, Lq=32, Ld=256), {}, dict(FLAT_RUN=True, PEEL_EACH_DOC=None, TAIL_N=None),
                 id="peeled-runs-not-whole-tiles"),
    # the training forward on long documents: 256 rows, 8 warps, 3 stages, 16-token tails, one document per program
    pytest.param(dict(Nq=64, B=64, Lq=32, Ld=1030, save_aux=True), {},
                 dict(TOKB=32, QPB=8, num_warps=8, num_stages=3, TAIL_N=16, SAVE_AUX=True, MULTI_DOC=False),
                 id="training-long-documents"),
    # the training forward's hard max: (max, arg-max) pairs, one padded document per program copied by TMA
    *[pytest.param(dict(Nq=64, B=512, Lq=32, Ld=Ld, save_aux=True), {},
                   dict(SAVE_AUX=True, MULTI_DOC=False, ROW_PARTIALS=8, TMA_DOCS=True), id=f"training-tma-{Ld}")
      for Ld in (300, 1030)],
    *[pytest.param(dict(Nq=64, B=512, Lq=32, Ld=Ld, save_aux=True, smooth_tau=0.1), {},
                   dict(ROW_PARTIALS=1, TMA_DOCS=False), id=f"training-smooth-{Ld}") for Ld in (300, 1030)],
    pytest.param(dict(Nq=64, B=512, Lq=32, Ld=300, save_aux=True, layout="ragged"), {},
                 dict(ROW_PARTIALS=8, TMA_DOCS=False), id="training-ragged"),
    pytest.param(dict(Nq=64, B=512, Lq=32, Ld=300, save_aux=True, layout="transposed"), {},
                 dict(ROW_PARTIALS=8, TMA_DOCS=False), id="training-transposed"),
    # runs of documents may straddle tiles only where Triton 3.6 compiles them: 32 rows, or 128-token tiles of up to
    # 128 rows (not 64-token tiles of 64, 128 or 256 rows)
    *[pytest.param(dict(Nq=Nq, B=1000, Lq=Lq, Ld=Ld, d=d), dict(DOCS=4, PROGRAMS_PER_SM=0), expected, id=name)
      for name, Nq, Lq, Ld, d, expected in (
          ("straddle-256-rows", 64, 32, 300, 128, dict(TOKB=32, QPB=8, MULTI_DOC=True, FLAT_RUN=False)),
          ("run-256-rows-whole-tiles", 64, 32, 1024, 128, dict(FLAT_RUN=True, STRADDLE=False)),
          ("straddle-32-rows", 1, 32, 300, 128, dict(FLAT_RUN=True, STRADDLE=True)),
          ("straddle-64-rows", 1, 64, 300, 128, dict(TOKB=64, MULTI_DOC=True, FLAT_RUN=False)),
          ("straddle-128-rows", 1, 128, 300, 128, dict(TOKB=128, MULTI_DOC=True, FLAT_RUN=False)),
          ("straddle-128-token-tiles", 1, 128, 180, 384, dict(BLOCK_N=128, FLAT_RUN=True, STRADDLE=True)))],
    # int8 documents: runs of documents in the token-rows kernel (TMA), the tile kernel without TMA
    pytest.param(dict(Nq=1, B=10000, Lq=32, Ld=300, index="int8"), {},
                 dict(kernel="maxsim_fwd_token_rows_kernel", TMA_DOCS=True, STRADDLE=True, BLOCK_N=64, num_warps=4,
                      MULTI_DOC=None), id="int8-token-rows"),
    pytest.param(dict(Nq=1, B=10000, Lq=32, Ld=1024, index="int8"), {},
                 dict(kernel="maxsim_fwd_token_rows_kernel", STRADDLE=False), id="int8-token-rows-whole-tiles"),
    pytest.param(dict(Nq=1, B=10000, Lq=1024, Ld=1024, index="int8"), {},
                 dict(kernel="maxsim_fwd_kernel", docs=26, grid=385 * 8, MULTI_DOC=True, FLAT_RUN=True,
                      PREFETCH_TOKENS=True, Q_QUANTIZED=True, maxnreg=168, TMA_DOCS=True, BITCAST_SUMS=True,
                      num_stages=3), id="int8-compute-bound"),
    pytest.param(dict(Nq=1, B=10000, Lq=1024, Ld=1030, index="int8"), {},
                 dict(FLAT_RUN=True, STRADDLE=True, BITCAST_SUMS=False, num_stages=3), id="int8-compute-straddling"),
    pytest.param(dict(Nq=1, B=500, Lq=32, Ld=300, index="int8"), {}, dict(docs=1, grid=500, MULTI_DOC=False),
                 id="int8-one-document-per-program"),
]


@pytest.mark.parametrize("problem, overrides, expected", FORWARD_PLANS)
def test_forward_plan(h100, problem, overrides, expected):
    with tuning.override_forward(**overrides):
        plan = forward_plan(**problem)
    assert meta_of(plan, *expected) == expected


@pytest.mark.parametrize("needs_75, docs, grid, maxnreg", [(False, 10, 1000, 64), (True, 13, 770, None)],
                         ids=["triton-3.6-3.8", "triton-3.9"])
def test_int8_token_rows_plan_follows_the_triton_version(h100, monkeypatch, needs_75, docs, grid, maxnreg):
    """1,056 program slots (8 per SM) of 10 documents, or 792 (6 per SM) of 13."""
    monkeypatch.setattr(tuning, "TOKEN_ROWS_INT8_NEEDS_75_REGISTERS", needs_75)
    plan = forward_plan(1, 10000, 32, 300, index="int8")
    assert meta_of(plan, "docs", "grid", "maxnreg") == dict(docs=docs, grid=grid, maxnreg=maxnreg)


def test_without_tma_int8_runs_take_the_tile_kernel(monkeypatch):
    with tuning.override_target(sms=132, capability=(8, 0)):
        plan = forward_plan(1, 10000, 32, 300, index="int8")
    assert meta_of(plan, "kernel", "docs", "MULTI_DOC", "FLAT_RUN", "PREFETCH_TOKENS", "num_warps") == dict(
        kernel="maxsim_fwd_kernel", docs=10, MULTI_DOC=True, FLAT_RUN=True, PREFETCH_TOKENS=False, num_warps=2)


@pytest.mark.parametrize("capability, tma", [((9, 0), True), ((8, 0), False)], ids=["hopper", "ampere"])
def test_training_forward_copies_tiles_by_tma_only_where_there_is_tma(capability, tma):
    with tuning.override_target(sms=132, capability=capability):
        plan = forward_plan(64, 512, 32, 300, save_aux=True)
    assert meta_of(plan, "ROW_PARTIALS", "TMA_DOCS") == dict(ROW_PARTIALS=8, TMA_DOCS=tma)


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_scoring_launch_allocates_no_auxiliary_tensor(monkeypatch, smooth_tau):
    """Scoring returns no aux and hands the kernel a stand-in pointer; training gets aux [Nq, C, Lq]; a smooth max
    split over document tokens keeps its per-slice sums in one, which one combine launch reads."""
    launched, kernels = [], []
    monkeypatch.setattr(launch.direct_launch, "launch",
                        lambda kernel, grid, tensors, *rest: launched.append(tensors) or kernels.append(kernel))
    queries, documents = torch.randn(2, 8, 32), torch.randn(5, 40, 32)
    scores, aux = launch.forward(queries, documents, None, None, None, 0, False, smooth_tau, False)
    assert scores.shape == (2, 5) and aux is None
    assert launched[-1][6] is queries                       # AUX: the stand-in, never read
    scores, aux = launch.forward(queries, documents, None, None, None, 0, False, smooth_tau, True)
    assert aux.shape == (2, 5, 8) and aux.dtype == (torch.int16 if smooth_tau is None else torch.float32)
    assert launched[-1][6] is aux
    long_documents = torch.randn(5, 200, 32)
    with tuning.override_forward(DSPLIT=2):
        launch.forward(queries, long_documents, None, None, None, 0, False, smooth_tau, False, 200)
    assert kernels[-2:] == [launch.maxsim_fwd_kernel, launch.maxsim_combine_slices_kernel]
    row_states, row_sums = launched[-2][5], launched[-2][6]
    assert launched[-1][0] is row_states and (launched[-1][1] is (row_states if smooth_tau is None else row_sums))
    assert row_states.shape == (2, 2, 5, 8)                 # two token slices: per-row states
    assert (row_sums is queries) == (smooth_tau is None)
    if smooth_tau is not None:
        assert row_sums.shape == (2, 2, 5, 8)


# --- the backward's policy and launch plans -----------------------------------------------------------------------

def backward_fields(Nq, C, Lq, Ld, d=128, *, paired=False, dtype=BF16, smooth=False, need=(True, True),
                    grad_dtype=None) -> dict:
    return tuning.backward_config(Nq, C, Lq, d, Ld, paired, dtype, smooth, *need, grad_dtype).__dict__


# problem -> expected BackwardConfig fields, on an H100
BACKWARD_CONFIGS = [
    # the hard max with many arg-max entries per document, or long documents: dQ a gather, dD binned
    pytest.param(dict(Nq=128, C=128, Lq=32, Ld=300),
                 dict(DQ_METHOD="gather", DD_METHOD="binned", FUSED=False, DD_BLOCK_N=64, DD_WARPS=4,
                      DD_MAXNREG=128, DQ_ROWS=8, DQ_COLS=8, DQ_COLUMN_SPLITS=1), id="colbert-b128"),
    pytest.param(dict(Nq=64, C=512, Lq=32, Ld=300), dict(DQ_METHOD="gather", DD_METHOD="binned"),
                 id="colbert-b64-7neg"),
    pytest.param(dict(Nq=64, C=64, Lq=32, Ld=1030), dict(DQ_METHOD="gather", DD_METHOD="binned"), id="colpali-b64"),
    pytest.param(dict(Nq=256, C=256, Lq=32, Ld=1030), dict(DQ_METHOD="gather", DD_METHOD="binned"),
                 id="colpali-b256"),
    # few entries per document (per-query candidates): dQ a row at a time beside the dense dD, in one launch
    pytest.param(dict(Nq=64, C=64, Lq=32, Ld=300, paired=True),
                 dict(DQ_METHOD="rows", DD_METHOD="dense", FUSED=True, DD_BLOCK_N=64, DD_WARPS=4, DD_STAGES=1,
                      DQ_STAGES=2, FUSED_STAGES=1), id="kd-64x64"),
    pytest.param(dict(Nq=2, C=3, Lq=8, Ld=300), dict(DQ_METHOD="rows", DD_METHOD="dense", FUSED=True),
                 id="few-entries"),
    # the smooth max: a row at a time and the dense dD on 128-token blocks of 8 warps, in two launches
    pytest.param(dict(Nq=128, C=128, Lq=32, Ld=1030, smooth=True),
                 dict(DQ_METHOD="rows", DD_METHOD="dense", FUSED=False, DD_BLOCK_N=128, DD_WARPS=8),
                 id="colpali-smooth-b128"),
    pytest.param(dict(Nq=128, C=128, Lq=32, Ld=1030, d=384, smooth=True),
                 dict(DD_BLOCK_N=32, DD_WARPS=4, BLOCK_N=32), id="smooth-d384"),
    pytest.param(dict(Nq=2, C=3, Lq=8, Ld=300, dtype=FP32, smooth=True), dict(DD_BLOCK_N=64, DD_WARPS=4),
                 id="smooth-fp32-fma"),
    # more entries per document than a program holds, or chunked features: the dense dD
    pytest.param(dict(Nq=512, C=512, Lq=32, Ld=300), dict(DD_METHOD="dense", FUSED=True), id="binned-too-many"),
    pytest.param(dict(Nq=64, C=64, Lq=32, Ld=1030, d=384), dict(DD_METHOD="dense"), id="binned-chunked-features"),
    # one gradient
    pytest.param(dict(Nq=128, C=128, Lq=32, Ld=300, need=(True, False)),
                 dict(DQ_METHOD="gather", DD_METHOD=None, FUSED=False), id="dq-alone"),
    pytest.param(dict(Nq=128, C=128, Lq=32, Ld=300, need=(False, True)),
                 dict(DQ_METHOD=None, DD_METHOD="binned"), id="dd-alone"),
    # the upstream gradient kept whole (two 16-bit parts) only where fp32 gradients are asked for
    pytest.param(dict(Nq=2, C=3, Lq=8, Ld=300, grad_dtype=FP32), dict(G_SPLIT=True), id="fp32-gradients"),
    pytest.param(dict(Nq=2, C=3, Lq=8, Ld=300), dict(G_SPLIT=False), id="input-dtype-gradients"),
    pytest.param(dict(Nq=2, C=3, Lq=8, Ld=300, grad_dtype=FP32, smooth=True), dict(G_SPLIT=False),
                 id="fp32-gradients-smooth"),
    # dQ's column loop split (fp32 partial sums) only past 64 columns in its own launch, 256 beside dD
    pytest.param(dict(Nq=2, C=64, Lq=8, Ld=40, need=(True, False)), dict(DQ_COLUMN_SPLITS=1), id="split-64"),
    pytest.param(dict(Nq=2, C=65, Lq=8, Ld=40, need=(True, False)), dict(DQ_COLUMN_SPLITS=8), id="split-65"),
    pytest.param(dict(Nq=2, C=256, Lq=8, Ld=40), dict(FUSED=True, DQ_COLUMN_SPLITS=1), id="split-fused-256"),
    pytest.param(dict(Nq=2, C=257, Lq=8, Ld=40), dict(FUSED=True, DQ_COLUMN_SPLITS=29), id="split-fused-257"),
]


@pytest.mark.parametrize("problem, expected", BACKWARD_CONFIGS)
def test_backward_config(h100, problem, expected):
    got = backward_fields(**problem)
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize("longest, entries, method", [
    (300, 128 * 32, "binned"),      # ColBERT in-batch B128
    (300, 64 * 32, "binned"),       # ColBERT B64 + 7 negatives
    (300, 32, "dense"),             # KD, 64 candidates per query: 32 entries per document
    (1030, 64 * 32, "binned"),      # ColPali in-batch B64
    (1030, 256 * 32, "binned"),     # ColPali in-batch B256
    (1024, 8, "binned"), (1023, 1023, "dense"), (1023, 1024, "binned"),
], ids=["colbert-b128", "colbert-b64-7neg", "kd", "colpali-b64", "colpali-b256", "1024-tokens", "below-both",
        "1024-entries"])
def test_default_dd_method(longest, entries, method):
    assert tuning.default_dd_method(longest, entries) == method


def _recorded_launches(monkeypatch):
    """(kernel, tensors, scalars, meta) of every launch, recorded instead of run."""
    launched = []
    monkeypatch.setattr(launch.direct_launch, "launch", lambda kernel, grid, tensors, scalars, meta, *keys:
                        launched.append((kernel, tensors, scalars, dict(meta))))
    return launched


def _programs(launches):
    """Each launch's kernel name, with maxsim_bwd_kernel's programs ("dq", "dd", "both")."""
    return [kernel.__name__ + (f":{meta['PROGRAMS']}" if "PROGRAMS" in meta else "")
            for kernel, _, _, meta in launches]


BWD, GATHER, BINNED, SPARSE = ("maxsim_bwd_kernel", "maxsim_bwd_dq_gather_kernel", "maxsim_bwd_dd_binned_kernel",
                               "maxsim_bwd_dd_sparse_kernel")


# (Nq, T, Lq, Ld, smooth, backward overrides) -> the launches of a backward with both gradients
BACKWARD_LAUNCHES = [
    pytest.param((2, 3, 8, 1024), {}, [GATHER, BINNED], id="long-documents"),
    pytest.param((32, 2, 32, 300), {}, [GATHER, BINNED], id="many-entries"),
    pytest.param((2, 3, 8, 300), {}, [BWD + ":both"], id="few-entries"),
    pytest.param((31, 8, 32, 300), {}, [BWD + ":both"], id="below-1024-entries"),
    pytest.param((2, 3, 8, 1024), dict(DD_METHOD="dense"), [BWD + ":both"], id="dense"),
    pytest.param((2, 3, 8, 300), dict(DD_METHOD="binned"), [GATHER, BINNED], id="binned"),
    pytest.param((2, 3, 8, 300), dict(DD_METHOD="binned", DQ_METHOD="rows"), [BWD + ":dq", BINNED],
                 id="binned-dq-rows"),
    pytest.param((2, 3, 8, 300), dict(DD_METHOD="dense", FUSED=False), [GATHER, BWD + ":dd"], id="dense-unfused"),
    pytest.param((2, 3, 8, 300), dict(DD_METHOD="sparse"), [GATHER, SPARSE], id="sparse"),
    pytest.param((2, 3, 8, 300, 0.1), {}, [BWD + ":dq", BWD + ":dd"], id="smooth"),
    pytest.param((2, 3, 8, 300, 0.1), dict(DD_METHOD="binned", DQ_METHOD="gather"), [BWD + ":dq", BWD + ":dd"],
                 id="smooth-ignores-hard-max-methods"),
]


@pytest.mark.parametrize("problem, overrides, kernels", BACKWARD_LAUNCHES)
def test_backward_launches(monkeypatch, problem, overrides, kernels):
    Nq, T, Lq, Ld, *smooth = problem
    tau = smooth[0] if smooth else None
    launched = _recorded_launches(monkeypatch)
    queries, documents = torch.randn(Nq, Lq, 32), torch.randn(T, Ld, 32)
    aux = torch.zeros(Nq, T, Lq, dtype=torch.float32 if tau else torch.int16)
    with tuning.override_backward(**overrides):
        launch.backward(torch.randn(Nq, T), queries, documents, None, None, None, Ld, aux, 0, tau, True, True)
    assert _programs(launched) == kernels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("problem, overrides, kernels", [p for p in BACKWARD_LAUNCHES if p.id != "sparse"] + [
    pytest.param((2, 200, 8, 40), {}, [BWD + ":both"], id="both-split"),
    pytest.param((2, 200, 8, 40), dict(FUSED=False, DD_METHOD="dense"), [GATHER, BWD + ":dd"], id="gather-split")])
def test_backward_output_strides_are_the_outputs(monkeypatch, problem, overrides, kernels, packed):
    """The output strides a backward plan holds are those of the tensors each launch writes: dQ as a
    [1, Nq, Lq, d] tensor, or the column splits' partial sums; dD padded, or packed rows with a zero document
    stride."""
    Nq, T, Lq, Ld, *smooth = problem
    tau = smooth[0] if smooth else None
    launched = _recorded_launches(monkeypatch)
    queries = torch.randn(Nq, Lq, 32)
    documents = torch.randn(T * Ld, 32) if packed else torch.randn(T, Ld, 32)
    offsets = torch.arange(T + 1) * Ld if packed else None
    aux = torch.zeros(Nq, T, Lq, dtype=torch.float32 if tau else torch.int16)
    with tuning.override_backward(**overrides):
        dq, dd = launch.backward(torch.randn(Nq, T), queries, documents, None, None, offsets, Ld, aux, 0, tau,
                                 True, True)
    assert _programs(launched) == kernels
    checked = 0
    for kernel, tensors, scalars, meta in launched:
        args = dict(zip(kernel.arg_names, (*tensors, *scalars)))
        if "DQ" in args and meta.get("PROGRAMS", "dq") in ("dq", "both"):
            target = args["DQ"]
            want = target.unsqueeze(0).stride() if target.dim() == 3 else target.stride()
            assert tuple(args[f"stride_o{a}"] for a in "snld") == want
            assert target.data_ptr() == dq.data_ptr() or target.dim() == 4
            checked += 1
        if "DD" in args and meta.get("PROGRAMS", "dd") in ("dd", "both"):
            assert args["DD"] is dd
            want = (0, *dd.stride()) if packed else dd.stride()
            assert tuple(args[f"stride_od{a}"] for a in "tld") == want
            checked += 1
    assert checked == 2


@pytest.mark.parametrize("overrides, maxnreg", [({}, tuning.BINNED_DD_MAXNREG), (dict(DD_MAXNREG=96), 96),
                                                (dict(DD_MAXNREG=0), None)], ids=["default", "96", "none"])
def test_binned_dd_register_cap_reaches_its_launch(monkeypatch, overrides, maxnreg):
    launched = _recorded_launches(monkeypatch)
    queries, documents = torch.randn(2, 8, 32), torch.randn(3, 1024, 32)
    aux = torch.zeros(2, 3, 8, dtype=torch.int16)
    with tuning.override_backward(**overrides):
        launch.backward(torch.randn(2, 3), queries, documents, None, None, None, 1024, aux, 0, None, True, True)
    (_, _, _, dq_meta), (_, _, _, dd_meta) = launched
    assert "maxnreg" not in dq_meta and dd_meta.get("maxnreg") == maxnreg


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_backward_plan_is_built_once_per_problem_and_launches_the_same(monkeypatch, smooth_tau):
    """A repeated step builds no plan and launches what the first one did; other strides, or a tuning override, get
    their own plan."""
    launched = _recorded_launches(monkeypatch)
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    built = []
    real_plan = launch._backward_plan
    monkeypatch.setattr(launch, "_backward_plan", lambda *a: built.append(1) or real_plan(*a))
    queries, documents = torch.randn(2, 8, 32), torch.randn(64, 40, 32)
    mask = torch.rand(64, 40) > 0.2
    aux = (torch.zeros(2, 64, 8, dtype=torch.int16) if smooth_tau is None else torch.zeros(2, 64, 8))
    grad = torch.randn(2, 64)

    def step(g=grad):
        launched.clear()
        launch.backward(g, queries, documents, None, mask, None, 40, aux, 0, smooth_tau, True, True)
        return [(kernel, scalars, meta) for kernel, _, scalars, meta in launched]
    first = step()
    assert _programs(launched) == ([BWD + ":both"] if smooth_tau is None else [BWD + ":dq", BWD + ":dd"])
    assert step() == first and len(built) == 1
    step(g=torch.randn(64, 2).t())                     # the loss's gradient transposed: other strides
    assert len(built) == 2 and launched[0][2] != first[0][1]
    with tuning.override_backward(DD_WARPS=2):
        step()
    assert len(built) == 3 and launched[-1][3]["num_warps"] == 2


def test_dq_partial_sums_are_freed_before_dd_is_allocated(monkeypatch):
    """The dQ column splits' fp32 partial sums are freed before dD, as large as the documents, is allocated in its own
    launch."""
    import weakref
    partials = []

    def record(kernel, grid, tensors, scalars, meta, *keys):
        if kernel is launch.maxsim_bwd_dq_gather_kernel:         # the hard max's dQ in its own launch
            partials.append(weakref.ref(tensors[4]))
        elif meta.get("PROGRAMS") == "dd":
            assert partials and partials[0]() is None, "dQ partial sums still allocated when dD is computed"
            partials.append("dd launched")

    monkeypatch.setattr(launch.direct_launch, "launch", record)
    queries, documents = torch.randn(2, 8, 32), torch.randn(128, 40, 32)
    aux = torch.zeros(2, 128, 8, dtype=torch.int16)
    grad = torch.randn(2, 128)
    with tuning.override_backward(FUSED=False):
        dq, dd = launch.backward(grad, queries, documents, None, None, None, 40, aux, 0, None, True, True)
        assert launch._backward_plan(grad, queries, documents, None, None, None, 40, aux, 0, None, True, True,
                                     None).n_cs > 1          # the column loop is split
    assert partials[-1] == "dd launched" and dq.shape == queries.shape and dd.shape == documents.shape


@pytest.mark.parametrize("need_dd, columns, split", [(False, 64, False), (False, 65, True), (True, 256, False),
                                                     (True, 257, True)],
                         ids=["dq-alone-64", "dq-alone-65", "both-256", "both-257"])
def test_query_gradient_is_written_in_place_unless_split(monkeypatch, need_dd, columns, split):
    """dQ's programs write dQ itself, or the column splits' fp32 partial sums; with dD, in the same launch."""
    launched = _recorded_launches(monkeypatch)
    queries, documents = torch.randn(2, 8, 32), torch.randn(columns, 40, 32)
    aux = torch.zeros(2, columns, 8, dtype=torch.int16)
    dq, dd = launch.backward(torch.randn(2, columns), queries, documents, None, None, None, 40, aux, 0, None,
                             True, need_dd)
    assert _programs(launched) == ([BWD + ":both"] if need_dd else [GATHER])
    tensors = launched[0][1]
    target = tensors[7] if need_dd else tensors[4]
    # the splits' partial sums [n_cs, Nq, Lq, d], or dQ [Nq, Lq, d] itself
    assert (target.dim() == 4) == split and (target.data_ptr() == dq.data_ptr()) != split
    if need_dd:
        assert tensors[8].data_ptr() == dd.data_ptr() and dd.shape == documents.shape
