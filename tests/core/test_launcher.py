"""The cached launch path (kernels/_launcher.py) against a stand-in for Triton's JIT function and compiled kernel:
which launches bind through Triton, which reuse the compiled kernel, with which arguments, and the fallback.
The real kernels go through it on CUDA (tests/core/test_gpu.py::test_cached_launches_follow_data_and_alignment)."""

from types import SimpleNamespace

import pytest
import torch
import triton

from flash_maxsim.kernels import _launcher


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
    monkeypatch.setattr(_launcher, "_RUNNERS", {})
    monkeypatch.setattr(_launcher, "_enabled", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_second_launch_reuses_the_compiled_kernel_with_constexprs_appended(fresh_launcher):
    kernel = FakeJIT()
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True, num_warps=4)
    _launcher.launch(kernel, (7,), (x, y), (5,), meta)
    _launcher.launch(kernel, (7,), (x, y), (5,), meta)
    assert len(kernel.bound) == 1 and kernel.bound[0][1] == (x, y, 5)
    assert kernel.direct == [((7, 1, 1), (x, y, 5, 64, True))]


@pytest.mark.parametrize("on_cuda", [True, False])
def test_triton_compiles_with_fp_fusion_requested_explicitly(fresh_launcher, on_cuda):
    """Every binding through Triton asks for fp fusion by name (its default up to 3.9, which 3.9 warns about and
    3.10 turns off), next to the launch's own meta, on the cached path and on Triton's own."""
    kernel = FakeJIT()
    x = FakeTensor(1024)
    x.is_cuda = on_cuda
    _launcher.launch(kernel, (3,), (x,), (5,), dict(BLOCK=64, FLAG=False, num_warps=4))
    assert kernel.bound[0][2] == dict(BLOCK=64, FLAG=False, num_warps=4, enable_fp_fusion=True)


def test_constexprs_the_launch_leaves_out_take_their_defaults(fresh_launcher):
    """A constexpr parameter with a default that the launch's meta omits is bound to that default, as Triton's own
    binding does, so the launch still goes direct (a missing one without default keeps Triton's path)."""
    kernel = FakeJIT()
    kernel.params.append(SimpleNamespace(name="OPTION", is_constexpr=True, has_default=True, default=7))
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True, num_warps=4)
    _launcher.launch(kernel, (7,), (x, y), (5,), meta)
    _launcher.launch(kernel, (7,), (x, y), (5,), meta)
    assert kernel.direct == [((7, 1, 1), (x, y, 5, 64, True, 7))]
    kernel.params.append(SimpleNamespace(name="REQUIRED", is_constexpr=True, has_default=False))
    assert _launcher._constexpr_tail(kernel, 3, meta) is None


def test_new_scalars_dtype_or_alignment_bind_again(fresh_launcher):
    kernel = FakeJIT()
    meta = dict(BLOCK=64, FLAG=False)
    x, y = FakeTensor(1024), FakeTensor(2048)
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    _launcher.launch(kernel, (3,), (x, y), (6,), meta)                       # another integer argument
    _launcher.launch(kernel, (3,), (FakeTensor(1026), y), (5,), meta)        # 2-byte aligned pointer
    _launcher.launch(kernel, (3,), (FakeTensor(1024, torch.bfloat16), y), (5,), meta)
    _launcher.launch(kernel, (3,), (x, y), (5,), dict(BLOCK=32, FLAG=False))  # another constexpr
    assert len(kernel.bound) == 5 and kernel.direct == []
    _launcher.launch(kernel, (3,), (FakeTensor(4096), y), (5,), meta)        # same key, other (aligned) data
    assert kernel.direct == [((3, 1, 1), (kernel.direct[0][1][0], y, 5, 64, False))]
    assert kernel.direct[0][1][0].ptr == 4096


def test_runner_failure_falls_back_to_tritons_path(fresh_launcher):
    kernel = FakeJIT()
    meta = dict(BLOCK=64, FLAG=False)
    x, y = FakeTensor(1024), FakeTensor(2048)
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    kernel.fail_direct = True
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    assert len(kernel.bound) == 2 and kernel.direct == []
    assert not _launcher._enabled
    kernel.fail_direct = False
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    assert len(kernel.bound) == 3 and kernel.direct == []


def test_a_plan_keys_its_launches_by_identity_and_alignment(fresh_launcher):
    """With a plan (an object fixing grid, scalars, meta and dtypes) the key is the plan itself plus the pointers'
    alignment: the same plan with aligned data reuses the runner; a misaligned pointer, or another plan object with
    equal contents, binds again."""
    kernel = FakeJIT()
    meta = dict(BLOCK=64, FLAG=False)
    plan, twin = object(), object()
    x, y = FakeTensor(1024), FakeTensor(2048)
    _launcher.launch(kernel, (3,), (x, y), (5,), meta, None, plan)
    _launcher.launch(kernel, (3,), (FakeTensor(4096), y), (5,), meta, None, plan)   # other aligned data
    assert len(kernel.bound) == 1 and kernel.direct[0][1][0].ptr == 4096
    _launcher.launch(kernel, (3,), (FakeTensor(1026), y), (5,), meta, None, plan)   # 2-byte aligned pointer
    _launcher.launch(kernel, (3,), (FakeTensor(1026), y), (5,), meta, None, plan)
    _launcher.launch(kernel, (3,), (x, y), (5,), meta, None, twin)
    assert len(kernel.bound) == 3 and len(kernel.direct) == 2
    assert kernel.direct[1][1][0].ptr == 1026


def test_cpu_tensors_always_take_tritons_path(fresh_launcher):
    kernel = FakeJIT()
    x = FakeTensor(1024)
    x.is_cuda = False
    for _ in range(2):
        _launcher.launch(kernel, (3,), (x,), (5,), dict(BLOCK=64, FLAG=False))
    assert len(kernel.bound) == 2 and kernel.direct == []



# --- Triton's C launcher called directly (the layouts of Triton 3.6 and of 3.7-3.9) ------------------------------

@pytest.mark.parametrize("version, base_args_format, layout", [
    ("3.6.0", "iiiKKppOOOOOO", _launcher.LAYOUT_ARGUMENTS),
    ("3.6.1", "iiiKKppOOOOOOO", None),                      # a 3.6 laid out otherwise
    ("3.7.0", None, _launcher.LAYOUT_SEQUENCE),
    ("3.8.0", None, _launcher.LAYOUT_SEQUENCE),
    ("3.9.1", None, _launcher.LAYOUT_SEQUENCE),
    ("3.10.0", None, None),                                 # not read: Triton's own runner
    ("3.5.0", None, None),
])
def test_c_launcher_layout_by_triton_version(version, base_args_format, layout):
    assert _launcher._launcher_layout(version, base_args_format) == layout


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
    monkeypatch.setattr(_launcher, "_triton_launch_parts",
                        lambda: (layout, encode, runtime, lambda device: 77 + device))
    return SimpleNamespace(encoded=encoded, runtime=runtime)


@pytest.fixture
def c_launches(fresh_launcher, monkeypatch):
    """Triton 3.6's launch parts."""
    return _launch_parts(monkeypatch, _launcher.LAYOUT_ARGUMENTS)


@pytest.fixture
def sequence_launches(fresh_launcher, monkeypatch):
    """Triton 3.7-3.9's launch parts."""
    return _launch_parts(monkeypatch, _launcher.LAYOUT_SEQUENCE)


def test_repeated_launches_call_tritons_c_launcher_with_integer_pointers(c_launches):
    kernel = JITWithLauncher()
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=True)
    _launcher.launch(kernel, (7,), (x, y), (5,), meta)
    _launcher.launch(kernel, (7,), (FakeTensor(4096), y), (5,), meta)
    assert len(kernel.bound) == 1 and kernel.direct == []
    # grid, the current stream, function, cooperative, PDL, no scratch, the kernel's metadata, no launch metadata
    # or hooks, then the arguments in order: addresses, scalars, constexprs
    assert kernel.c_launch.calls == [(7, 1, 1, 77, 0xF00, False, True, None, None, (4, 1, 0), None, None, None,
                                      4096, 2048, 5, 64, True)]


def test_launch_hooks_send_the_call_through_the_runner(c_launches):
    kernel = JITWithLauncher()
    x, y = FakeTensor(1024), FakeTensor(2048)
    meta = dict(BLOCK=64, FLAG=False)
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    c_launches.runtime.launch_enter_hook.calls.append(print)      # a profiler's hook
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    assert kernel.c_launch.calls == [] and kernel.direct == [((3, 1, 1), (x, y, 5, 64, False))]
    c_launches.runtime.launch_enter_hook.calls.clear()
    _launcher.launch(kernel, (3,), (x, y), (5,), meta)
    assert len(kernel.c_launch.calls) == 1 and len(kernel.direct) == 1


@pytest.mark.parametrize("layout", [dict(scratch=256), dict(desc_meta=None), dict(desc_meta=[None])])
def test_kernels_laid_out_otherwise_keep_the_runner(c_launches, layout):
    """Scratch memory to allocate, or a descriptor Triton did not lower to TMA: the compiled runner, as before."""
    kernel = JITWithLauncher(wrapped=True, **layout)
    kernel.params.insert(2, SimpleNamespace(name="DESC", is_constexpr=False))
    x = FakeTensor(1024, torch.bfloat16)
    desc = _launcher.TensorDesc(0, (64, 32), (32, 1), (16, 32))
    _launcher.launch(kernel, (3,), (x, FakeTensor(2048)), (desc, 5), dict(BLOCK=64, FLAG=False))
    _launcher.launch(kernel, (3,), (x, FakeTensor(2048)), (desc, 5), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1
    runner_desc = kernel.direct[0][1][2]
    assert (runner_desc.base, runner_desc.shape, runner_desc.block_shape) == (x, [64, 32], [16, 32])


def test_another_c_launcher_format_keeps_the_runner(c_launches, monkeypatch):
    monkeypatch.setattr(_launcher, "_triton_launch_parts", lambda: (None, None, None, None))
    kernel = JITWithLauncher()
    for _ in range(2):
        _launcher.launch(kernel, (3,), (FakeTensor(1024), FakeTensor(2048)), (5,), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1


def test_tensor_descriptors_are_encoded_once_per_address(c_launches):
    """A descriptor argument reaches Triton's first launch as its TensorDescriptor, and the C launcher as its
    encoded arguments, encoded again only for documents at another address; the cache holds no tensor."""
    import weakref
    kernel = JITWithLauncher(wrapped=True, desc_meta=[{"swizzle": 128}])
    kernel.params.insert(2, SimpleNamespace(name="DESC", is_constexpr=False))
    q = FakeTensor(1024)
    desc = _launcher.TensorDesc(1, (64, 32), (32, 1), (16, 32))
    meta = dict(BLOCK=64, FLAG=False)
    plan = object()
    docs = [FakeTensor(4096, torch.bfloat16), FakeTensor(8192, torch.bfloat16)]
    for d in (docs[0], docs[0], docs[1], docs[0]):
        _launcher.launch(kernel, (3,), (q, d), (desc, 5), meta, None, plan)
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
    _launcher.launch(kernel, (7,), (FakeTensor(1024), y), (5,), meta)
    _launcher.launch(kernel, (7,), (FakeTensor(4096), y), (5,), meta)
    assert len(kernel.bound) == 1 and kernel.direct == []
    assert kernel.c_launch.calls == [(7, 1, 1, 77, 0xF00, False, True, (4, 1, 0), None, None, None, None, None,
                                      annotations, b"signature", (4096, 2048, 5, 64, True))]


def test_sequence_layout_encodes_descriptors_inside_the_tuple(sequence_launches):
    kernel = JITWithLauncher(wrapped=True, desc_meta=[{"swizzle": 128}], annotations=[None] * 10)
    kernel.params.insert(2, SimpleNamespace(name="DESC", is_constexpr=False))
    q, docs = FakeTensor(1024), FakeTensor(4096, torch.bfloat16)
    desc = _launcher.TensorDesc(1, (64, 32), (32, 1), (16, 32))
    for _ in range(2):
        _launcher.launch(kernel, (3,), (q, docs), (desc, 5), dict(BLOCK=64, FLAG=False))
    assert sequence_launches.encoded == [(4096, (64, 32), (32, 1), (16, 32), {"swizzle": 128})]
    assert [call[-1] for call in kernel.c_launch.calls] == [(1024, 4096, "tma@4096", 64, 32, 32, 1, 5, 64, False)]


@pytest.mark.parametrize("annotations", [4, 6], ids=["fewer", "more"])
def test_sequence_layout_with_another_argument_count_keeps_the_runner(sequence_launches, annotations):
    """Triton's C code reads one argument per annotation without counting them: a kernel whose annotations do not
    match what the launch passes is never launched directly."""
    kernel = JITWithLauncher(annotations=[None] * annotations)
    for _ in range(2):
        _launcher.launch(kernel, (3,), (FakeTensor(1024), FakeTensor(2048)), (5,), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1


def test_sequence_layout_without_annotations_keeps_the_runner(sequence_launches):
    kernel = JITWithLauncher()
    for _ in range(2):
        _launcher.launch(kernel, (3,), (FakeTensor(1024), FakeTensor(2048)), (5,), dict(BLOCK=64, FLAG=False))
    assert kernel.c_launch.calls == [] and len(kernel.direct) == 1


# --- tile choices (kernels/launch.py): pure host logic, pinned where a device run showed a regression ---------

from flash_maxsim.kernels import launch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_take_full_width_feature_tiles(dtype, highest_fp32_precision):
    # device run 7: the bf16 backward picked the fp32 CUDA-core chunks and training steps ran 2x slower
    assert launch.feature_tiling_for(128, dtype) == (128, 1)
    assert launch.feature_tiling_for(96, dtype) == (128, 1)
    assert launch.feature_tiling_for(1024, dtype) == (128, 8)


def test_fp32_feature_tiles_follow_matmul_precision():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")     # CUDA-core products: narrow chunks stay in registers
        assert launch.feature_tiling_for(128, torch.float32) == (32, 4)
        assert launch.feature_tiling_for(96, torch.float32) == (32, 3)
        torch.set_float32_matmul_precision("high")        # tf32 tensor cores: as half precision
        assert launch.feature_tiling_for(128, torch.float32) == (128, 1)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_compute_bound_scoring_takes_256_row_tiles_and_training_keeps_128(monkeypatch):
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    scoring = launch.forward_config(1, 10000, 1024, 1024, 128, False, False)
    assert (scoring["TOKB"] * scoring["QPB"], scoring["num_warps"]) == (256, 8)
    many_queries = launch.forward_config(64, 1000, 32, 300, 128, False, False)
    assert (many_queries["TOKB"], many_queries["QPB"]) == (32, 8)
    training = launch.forward_config(64, 1000, 32, 300, 128, False, True)
    assert training["TOKB"] * training["QPB"] == 128 and training["DSPLIT"] == 1
    few_long = launch.forward_config(16, 32, 32, 8192, 128, False, False)
    assert few_long["DSPLIT"] > 1


def test_partial_row_maxima_where_measured_faster(monkeypatch):
    """Partial row maxima across a document's tiles (``ROW_PARTIALS``, kernels/forward.py ``_fold_row_partials``)
    where session 18 measured them faster: 256-row tiles (compute-bound scoring), 128-row programs of a token
    split, fp8 products on the compute-bound grid. Not int8's bit-cast compute-bound grid (a spill at its register
    cap: slower), not 32-row or 128-row bandwidth-bound tiles (mma.sync over several warps needs a layout change
    through shared memory: 1x1k 32x300 23% slower), nor the smooth max or runs whose tiles straddle two documents
    (the plan turns them off there). The training forward's hard max keeps partial (max, arg-max) pairs instead
    (session 22, ``_fold_arg_partials``) on tiles of 128 rows or more, 16-bit inputs, d <= 128; not its smooth max."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)

    def partials(Nq, B, Lq, Ld, save_aux=False, products=None, smooth=False, dtype=torch.bfloat16, d=128):
        return launch.forward_config(Nq, B, Lq, Ld, d, False, save_aux, dtype, products, smooth)["ROW_PARTIALS"]
    for shape in [(1, 1000, 512, 1024), (1, 1000, 1024, 1024), (1, 10000, 1024, 1024), (64, 1000, 32, 300),
                  (16, 32, 32, 8192)]:
        assert partials(*shape) == 8, shape
    assert partials(1, 10000, 1024, 1024, products="fp8") == 8
    assert partials(1, 10000, 1024, 1024, products="int8") == 1
    for shape in [(1, 1000, 32, 300), (1, 10000, 32, 300), (1, 1000, 32, 1024), (1, 10000, 32, 1030),
                  (1, 1000, 128, 1024), (1, 32, 32, 8192)]:
        assert partials(*shape) == 1, shape
        assert partials(*shape, products="fp8") == 1, shape
    for shape in [(64, 1000, 32, 300), (64, 512, 32, 300), (64, 64, 32, 1030), (256, 256, 32, 1030)]:
        assert partials(*shape, save_aux=True) == 8, shape
        assert partials(*shape, save_aux=True, dtype=torch.float16) == 8, shape
        assert partials(*shape, save_aux=True, smooth=True) == 1, shape
        assert partials(*shape, save_aux=True, dtype=torch.float32) == 1, shape
        assert partials(*shape, save_aux=True, d=384) == 1, shape
    assert partials(1, 8, 32, 300, save_aux=True) == 1          # 32-row tiles

    def plan(Lq, Ld, smooth_tau=None, save_aux=False):
        return launch._forward_plan(torch.empty(1, Lq, 128, dtype=torch.bfloat16),
                                    torch.empty(10000, Ld, 128, dtype=torch.bfloat16), None, None, None, 0, False,
                                    smooth_tau, save_aux, Ld, None).meta
    assert plan(1024, 1024)["ROW_PARTIALS"] == 8 and plan(1024, 1024)["FLAT_RUN"]
    assert plan(1024, 1024, smooth_tau=0.1)["ROW_PARTIALS"] == 1
    assert plan(1024, 1024, save_aux=True)["ROW_PARTIALS"] == 8
    assert plan(1024, 1024, smooth_tau=0.1, save_aux=True)["ROW_PARTIALS"] == 1
    monkeypatch.setattr(launch, "FORWARD_OVERRIDES", {"ROW_PARTIALS": 8, "PROGRAMS_PER_SM": 8})
    straddling = plan(32, 300)          # 32-row runs of documents, as the int8 streaming grid's
    assert straddling["FLAT_RUN"] and straddling["STRADDLE"] and straddling["ROW_PARTIALS"] == 1


# the options' tests start from the choices before session 20's peeled-runs default
ONE_DOCUMENT = launch.ONE_DOCUMENT_PER_PROGRAM


def test_narrow_tail_tiles_only_where_a_peeled_tail_exists(monkeypatch):
    """``TAIL_N`` (an option; the default only with PEEL_EACH_DOC's peeled runs, tested below): the kernel gets it
    only for a loop over one document's tiles with a peeled tail (one document per program, or several each peeled),
    a width of at least 16 tokens that divides the whole tiles, and documents that can end inside a tile (padded to
    a length off the tile grid, or ragged). Elsewhere the plan, so the compiled kernel, is as without it."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)

    def tail(Nq, B, Lq, Ld, ragged=False, save_aux=False, **overrides):
        monkeypatch.setattr(launch, "FORWARD_OVERRIDES", dict(ONE_DOCUMENT, **overrides))
        q = torch.empty(Nq, Lq, 128, dtype=torch.bfloat16)
        if ragged:
            docs, offsets = torch.empty(B * Ld, 128, dtype=torch.bfloat16), torch.arange(B + 1) * Ld
        else:
            docs, offsets = torch.empty(B, Ld, 128, dtype=torch.bfloat16), None
        meta = launch._forward_plan(q, docs, None, None, offsets, 0, False, None, save_aux, Ld, None).meta
        return meta.get("TAIL_N", 0)
    assert tail(64, 1000, 32, 300) == 0                                # off without the peeled runs
    assert tail(64, 1000, 32, 300, TAIL_N=16) == 16
    assert tail(64, 1000, 32, 300, TAIL_N=32) == 32
    assert tail(64, 1000, 32, 300, save_aux=True, TAIL_N=16) == 16     # the training forward peels too
    assert tail(64, 1000, 32, 256, ragged=True, TAIL_N=16) == 16       # ragged documents may end anywhere
    assert tail(64, 1000, 32, 256, TAIL_N=16) == 0                     # whole tiles only: no tail loop runs
    assert tail(64, 1000, 32, 300, TAIL_N=8) == 0                      # narrower than tl.dot takes
    assert tail(64, 1000, 32, 300, TAIL_N=64) == 0                     # not narrower than the whole tiles
    assert tail(64, 1000, 32, 300, TAIL_N=16, PEEL_TAIL=False) == 0    # one masked loop, no peeled tail
    assert tail(64, 1000, 32, 300, TAIL_N=16, DOCS=2) == 0             # one loop over several documents' tiles
    assert tail(64, 1000, 32, 300, TAIL_N=16, DOCS=2, PEEL_EACH_DOC=True) == 16    # a loop per document


def test_several_documents_each_peeled_only_in_the_loop_over_their_tiles(monkeypatch):
    """``PEEL_EACH_DOC`` (an option, off by default): the kernel gets it only where a program scores several
    documents in the loop over their tiles (not one document per program, not one run of tokens) with the last
    tile peeled."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)

    def meta(Ld, **overrides):
        monkeypatch.setattr(launch, "FORWARD_OVERRIDES", dict(ONE_DOCUMENT, **overrides))
        return launch._forward_plan(torch.empty(64, 32, 128, dtype=torch.bfloat16),
                                    torch.empty(1000, Ld, 128, dtype=torch.bfloat16), None, None, None, 0, False,
                                    None, False, Ld, None).meta
    assert "PEEL_EACH_DOC" not in meta(300, DOCS=4)                              # off unless asked for
    each = meta(300, DOCS=4, PEEL_EACH_DOC=True)
    assert each["MULTI_DOC"] and not each["FLAT_RUN"] and each["PEEL_EACH_DOC"]
    persistent = meta(300, PROGRAMS_PER_SM=2, PEEL_EACH_DOC=True)                # 31 documents per program
    assert persistent["MULTI_DOC"] and persistent["PEEL_EACH_DOC"]
    assert "PEEL_EACH_DOC" not in meta(300, PEEL_EACH_DOC=True)                  # one document per program
    assert "PEEL_EACH_DOC" not in meta(300, DOCS=4, PEEL_EACH_DOC=True, PEEL_TAIL=False)
    run = meta(256, DOCS=4, PEEL_EACH_DOC=True)                                  # whole tiles: one run of tokens
    assert run["FLAT_RUN"] and "PEEL_EACH_DOC" not in run


def test_training_forward_on_long_documents_takes_256_rows_and_narrow_tails(monkeypatch):
    """Session 21's training-forward default: 256-row tiles on 8 warps, 3 stages, 16-token tail tiles for documents
    of 512 tokens or more (ColPali's 1030), where enough programs remain; 300-token documents, fp32, small batches
    and per-query candidates keep 128-row tiles on 4 warps, 2 stages."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    monkeypatch.setattr(launch, "FORWARD_OVERRIDES", {})

    def config(Nq, B, Ld, dtype=torch.bfloat16, paired=False):
        cfg = launch.forward_config(Nq, B, 32, Ld, 128, paired, True, dtype)
        return cfg["TOKB"] * cfg["QPB"], cfg["num_warps"], cfg["num_stages"], cfg["TAIL_N"]
    for dtype in (torch.bfloat16, torch.float16):
        assert config(64, 64, 1030, dtype) == (256, 8, 3, 16)         # ColPali in-batch B64: 512 programs
    assert config(256, 256, 1030) == (256, 8, 3, 16)
    assert config(64, 512, 300) == (128, 4, 2, 0)                     # B64 + 7 negatives: measured slower
    assert config(128, 128, 300) == (128, 4, 2, 0)
    assert config(16, 16, 1030) == (128, 4, 2, 0)                     # 32 programs of 256 rows: too few
    assert config(64, 64, 1030, torch.float32)[0] == 128
    assert config(64, 64, 1030, paired=True)[0] == 32                 # one query per program
    # and the plan peels the tail in 16-token tiles
    q = torch.empty(64, 32, 128, dtype=torch.bfloat16)
    docs = torch.empty(64, 1030, 128, dtype=torch.bfloat16)
    meta = launch._forward_plan(q, docs, None, None, None, 0, False, None, True, 1030, None).meta
    assert (meta["QPB"] * meta["TOKB"], meta["num_warps"], meta["num_stages"], meta["TAIL_N"]) == (256, 8, 3, 16)
    assert meta["SAVE_AUX"] and not meta["MULTI_DOC"]


def test_training_forward_hard_max_takes_arg_max_pairs_and_tma_copies(monkeypatch):
    """Session 22's training-forward default (hard max, arg-max saved): 8 partial (max, arg-max) pairs per row and
    the whole document tiles copied by TMA, one padded document per program. Not for the smooth max, ragged
    documents (no [tokens, d] rows of one stride), documents whose rows are not contiguous, or without TMA."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    monkeypatch.setattr(launch, "FORWARD_OVERRIDES", {})

    def meta(smooth_tau=None, ragged=False, Ld=300, transposed=False):
        q = torch.empty(64, 32, 128, dtype=torch.bfloat16)
        if ragged:
            docs, offsets = torch.empty(512 * Ld, 128, dtype=torch.bfloat16), torch.arange(513) * Ld
        else:
            docs, offsets = torch.empty(512, Ld, 128, dtype=torch.bfloat16), None
            if transposed:                # documents [B, Ld, d] whose token rows are strided by B * d
                docs = torch.empty(Ld, 512, 128, dtype=torch.bfloat16).transpose(0, 1)
        return launch._forward_plan(q, docs, None, None, offsets, 0, False, smooth_tau, True, Ld, None).meta
    monkeypatch.setattr(launch, "_tensor_descriptors", lambda queries: True)      # as on Hopper
    for Ld in (300, 1030):
        hard = meta(Ld=Ld)
        assert hard["SAVE_AUX"] and not hard["MULTI_DOC"] and hard["ROW_PARTIALS"] == 8 and hard["TMA_DOCS"], Ld
        smooth = meta(smooth_tau=0.1, Ld=Ld)
        assert smooth["ROW_PARTIALS"] == 1 and not smooth["TMA_DOCS"], Ld
    ragged = meta(ragged=True)
    assert ragged["ROW_PARTIALS"] == 8 and not ragged["TMA_DOCS"]
    transposed = meta(transposed=True)
    assert transposed["ROW_PARTIALS"] == 8 and not transposed["TMA_DOCS"]
    monkeypatch.setattr(launch, "_tensor_descriptors", lambda queries: False)     # e.g. sm_80
    no_tma = meta()
    assert no_tma["ROW_PARTIALS"] == 8 and not no_tma["TMA_DOCS"]


def test_peeled_runs_are_the_default_only_where_their_loop_runs(monkeypatch):
    """Session 20's default for 256-row tiles of documents that end inside a tile (64x1k 32x300): ~2 programs per SM,
    each a share of the padded documents, each document peeled with 16-token tail tiles, at 128 registers. Layouts of
    one document per program (ragged, the training forward, per-query candidates) and documents of whole tiles, or
    padded to whole tiles past their longest (one run of tokens), keep the plan they had: no cap, no narrow tail."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)

    def meta(B=1000, Ld=300, max_len=None, ragged=False, save_aux=False, Nq=64, candidates=0):
        monkeypatch.setattr(launch, "FORWARD_OVERRIDES", {})
        q = torch.empty(Nq, 32, 128, dtype=torch.bfloat16)
        if ragged:
            docs, offsets = torch.empty(B * Ld, 128, dtype=torch.bfloat16), torch.arange(B + 1) * Ld
        else:
            docs = torch.empty(*((Nq, candidates) if candidates else (B,)), Ld, 128, dtype=torch.bfloat16)
            offsets = None
        plan = launch._forward_plan(q, docs, None, None, offsets, candidates, False, None, save_aux,
                                    max_len or Ld, None)
        return plan.meta, plan.grid[0]
    monkeypatch.setattr(launch, "_tensor_descriptors", lambda queries: True)      # as on Hopper
    default, grid = meta()
    assert default["PEEL_EACH_DOC"] and default["MULTI_DOC"] and not default["FLAT_RUN"]
    assert (default["TAIL_N"], default["maxnreg"], grid) == (16, 128, 2 * 132)
    assert default["TMA_DOCS"]                   # session 21: the whole tiles copied by TMA
    for label, (m, _) in {"ragged": meta(ragged=True), "training forward": meta(save_aux=True),
                          "per-query candidates": meta(Nq=64, candidates=16),
                          "padded to whole tiles": meta(Ld=320, max_len=300)}.items():
        assert not m["MULTI_DOC"] and "PEEL_EACH_DOC" not in m and "TAIL_N" not in m, label
        # the training forward copies its whole tiles by TMA by its own rule (session 22)
        assert "maxnreg" not in m and m["TMA_DOCS"] == (label == "training forward"), label
    whole, _ = meta(Ld=256)                                  # whole tiles: their own rule (runs of documents)
    assert whole["FLAT_RUN"] and "PEEL_EACH_DOC" not in whole and "TAIL_N" not in whole


def test_only_bandwidth_bound_scoring_streams_without_a_peeled_tail(monkeypatch):
    # run 9: one masked loop is faster when each document token meets at most 32 query tokens (d <= 256);
    # the peeled last tile stays for d = 384, longer queries, several queries, and the training forward
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    assert launch.forward_config(1, 10000, 32, 300, 128, False, False)["PEEL_TAIL"] is False
    assert launch.forward_config(1, 5000, 31, 257, 96, False, False)["PEEL_TAIL"] is False
    assert launch.forward_config(4, 8, 32, 300, 128, True, False)["PEEL_TAIL"] is False     # per-query candidates
    assert launch.forward_config(1, 10000, 32, 180, 384, False, False)["PEEL_TAIL"] is True
    assert launch.forward_config(1, 1000, 128, 1024, 128, False, False)["PEEL_TAIL"] is True
    assert launch.forward_config(64, 1000, 32, 300, 128, False, False)["PEEL_TAIL"] is True
    assert launch.forward_config(4, 8, 32, 300, 128, True, True)["PEEL_TAIL"] is True


def test_fp8_streaming_grid_runs_one_warp_per_program(monkeypatch):
    """fp8 x fp8 products streaming one query over many documents: one warp per program with its registers
    uncapped, 8 programs per SM (session 18: 5% faster on 1x10k 32x300); int8 keeps 2 warps at 128 registers, and
    fp8 scoring too small to stream on 2 warps keeps its 4."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)

    def cfg(B, Ld, products):
        return launch.forward_config(1, B, 32, Ld, 128, False, False, torch.bfloat16, products)
    for Ld in (300, 1030):
        fp8, int8 = cfg(10000, Ld, "fp8"), cfg(10000, Ld, "int8")
        assert (fp8["num_warps"], fp8["MAXNREG"], fp8["PROGRAMS_PER_SM"]) == (1, 0, 8)
        assert (int8["num_warps"], int8["MAXNREG"], int8["PROGRAMS_PER_SM"]) == (2, 128, 8)
    assert cfg(1000, 300, "fp8")["num_warps"] == 4


def test_several_documents_per_program_for_int8_products(monkeypatch):
    """int8 products: grids of 8 programs per SM (one query's bandwidth-bound scoring) or 24 (compute-bound: long
    queries over many documents, 3 resident per SM), each program scoring an equal share of the documents; 16-bit
    documents 2 per SM where they are whole tiles (or their features are chunked), else one per program, and so do
    int8 ones too few to share; 16-bit documents with padded features 8 per SM in tiles that straddle them, copied
    by TMA; 128-row programs over runs of 16-bit whole tiles on 8 warps, copied by TMA."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    monkeypatch.setattr(launch, "CAPABILITY_OVERRIDE", (9, 0))

    def programs_per_sm(*args):
        return launch.forward_config(*args)["PROGRAMS_PER_SM"]
    assert programs_per_sm(1, 10000, 32, 300, 128, False, False, torch.bfloat16, "int8") == 8
    assert programs_per_sm(1, 10000, 32, 300, 128, False, False, torch.bfloat16) == 0
    assert programs_per_sm(1, 10000, 1024, 1024, 128, False, False, torch.bfloat16, "int8") == 24
    assert programs_per_sm(1, 10000, 1024, 1024, 128, False, False, torch.bfloat16) == 2
    assert programs_per_sm(1, 1000, 32, 1024, 128, False, False, torch.float16) == 2
    assert programs_per_sm(1, 10000, 32, 180, 384, False, False, torch.bfloat16) == 2   # 3 feature chunks
    assert programs_per_sm(1, 10000, 1024, 1024, 128, False, True, torch.bfloat16) == 0  # training
    assert programs_per_sm(1, 10000, 1024, 1024, 128, False, False, torch.float32) == 0
    # features padded to the tile (d=96 in 128) in tiles that straddle documents: 8 runs per SM in 128 registers,
    # whole tiles copied by TMA
    cfg = launch.forward_config(1, 5000, 31, 257, 96, False, False, torch.bfloat16)
    assert cfg["PROGRAMS_PER_SM"] == 8 and cfg["MAXNREG"] == 128 and cfg["TMA_DOCS"] and cfg["BLOCK_D"] == 128
    assert programs_per_sm(1, 5000, 31, 256, 96, False, False, torch.bfloat16) == 2      # whole tiles
    # 128-row programs over runs of whole tiles: 8 warps, TMA copies; 32-row (streaming) ones keep 2 warps, copied
    # by the threads
    cfg = launch.forward_config(1, 1000, 128, 1024, 128, False, False, torch.bfloat16)
    assert cfg["PROGRAMS_PER_SM"] == 2 and cfg["num_warps"] == 8 and cfg["TMA_DOCS"]
    cfg = launch.forward_config(1, 1000, 32, 1024, 128, False, False, torch.bfloat16)
    assert cfg["PROGRAMS_PER_SM"] == 2 and cfg["num_warps"] == 2 and not cfg["TMA_DOCS"]
    assert programs_per_sm(1, 5000, 31, 257, 128, False, False, torch.bfloat16) == 0     # d = BLOCK_D
    assert programs_per_sm(1, 50, 31, 257, 96, False, False, torch.bfloat16) == 0        # few tokens
    assert programs_per_sm(1, 8, 1024, 1024, 128, False, False, torch.bfloat16, "int8") == 0

    def plan(B, Lq, Ld):
        return launch._forward_plan(torch.empty(1, Lq, 128, dtype=torch.bfloat16),
                                    torch.empty(B, Ld, 128, dtype=torch.int8), None, None, None, 0, False, None,
                                    False, Ld, torch.empty(B, Ld))
    # runs of documents with document tokens as the tile's rows (kernels/forward_token_rows.py): 4 warps, 64-token
    # tiles copied by TMA; 8 programs per SM at 64 registers (1,056 program slots: 10 documents each, 1,000
    # programs), or from Triton 3.9, whose loop needs 75, 6 per SM uncapped (792 slots: 13 each, 770 programs)
    for needs_75, docs, grid, maxnreg in ((False, 10, 1000, 64), (True, 13, 770, None)):
        with monkeypatch.context() as m:
            m.setattr(launch, "TOKEN_ROWS_INT8_NEEDS_75_REGISTERS", needs_75)
            p = plan(10000, 32, 300)
        assert p.docs == docs and p.grid == (grid,) and p.kernel is launch.maxsim_fwd_token_rows_kernel
        assert p.meta["TMA_DOCS"] and p.meta["STRADDLE"] and p.meta["BLOCK_N"] == 64 and p.meta["num_warps"] == 4
        assert p.meta.get("maxnreg") == maxnreg and "MULTI_DOC" not in p.meta
    assert launch.TOKEN_ROWS_INT8_NEEDS_75_REGISTERS == launch._triton_at_least(triton.__version__, 3, 9)
    # without TMA (before Hopper) the tile kernel: one run of tokens on 2 warps, no scales loaded ahead
    with monkeypatch.context() as m:
        m.setattr(launch, "_tensor_descriptors", lambda queries: False)
        p = plan(10000, 32, 300)
    assert p.docs == 10 and p.kernel is launch.maxsim_fwd_kernel and p.meta["MULTI_DOC"] and p.meta["FLAT_RUN"]
    assert not p.meta["PREFETCH_TOKENS"] and p.meta["num_warps"] == 2
    p = plan(10000, 1024, 1024)         # 8 row tiles per document, 3,168 slots: 26 documents per program
    assert p.docs == 26 and p.grid == (385 * 8,) and p.meta["MULTI_DOC"]
    # scales loaded a tile ahead; queries quantised before the launch; 168 registers for 3 programs per SM; whole
    # tiles copied by TMA on Hopper
    assert p.meta["FLAT_RUN"] and p.meta["PREFETCH_TOKENS"] and p.meta["Q_QUANTIZED"] and p.meta["maxnreg"] == 168
    assert p.meta["TMA_DOCS"]
    # whole tiles: the sums read as fp32 bits, on 3 stages (session 44; 2 before); straddling runs convert them
    assert p.meta["BITCAST_SUMS"] and p.meta["num_stages"] == 3
    p = plan(10000, 1024, 1030)
    assert p.meta["FLAT_RUN"] and p.meta["STRADDLE"] and not p.meta["BITCAST_SUMS"] and p.meta["num_stages"] == 3
    p = plan(10000, 32, 1024)           # the query quantised in the token-rows kernel, whole tiles
    assert p.kernel is launch.maxsim_fwd_token_rows_kernel and not p.meta["STRADDLE"]
    p = plan(500, 32, 300)
    assert p.docs == 1 and p.grid == (500,) and not p.meta["MULTI_DOC"]


def test_triton_versions_compare_by_major_and_minor():
    at_least = launch._triton_at_least
    assert at_least("3.9.0", 3, 9) and at_least("3.10.0+git1234abcd", 3, 9) and at_least("4.0.0", 3, 9)
    assert not at_least("3.8.0", 3, 9) and not at_least("3.6.0", 3, 9)
    assert at_least("main", 3, 9)          # not numbered: taken as a recent build


def test_runs_of_documents_that_straddle_tiles_only_where_triton_compiles_them(monkeypatch):
    """Several documents per program stream as one run of tokens (FLAT_RUN); where tiles would straddle two
    documents, only with 32 rows or 128-token tiles (Triton 3.6 fails to compile 64-token tiles of 64, 128 or 256
    rows: run 22, benchmarks/probe_runs.py): the per-document loop otherwise."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    monkeypatch.setattr(launch, "FORWARD_OVERRIDES", {"DOCS": 4, "PROGRAMS_PER_SM": 0})

    def meta(Nq, Lq, Ld, d=128):
        p = launch._forward_plan(torch.empty(Nq, Lq, d, dtype=torch.bfloat16),
                                 torch.empty(1000, Ld, d, dtype=torch.bfloat16), None, None, None, 0, False, None,
                                 False, Ld, None)
        return p.meta
    m = meta(64, 32, 300)                    # 8 queries x 32 tokens: 256 rows
    assert m["TOKB"] * m["QPB"] == 256 and m["MULTI_DOC"] and not m["FLAT_RUN"]
    m = meta(64, 32, 1024)                   # whole tiles
    assert m["TOKB"] * m["QPB"] == 256 and m["FLAT_RUN"] and not m["STRADDLE"]
    m = meta(1, 32, 300)
    assert m["FLAT_RUN"] and m["STRADDLE"]
    m = meta(1, 64, 300)                     # 64 rows
    assert m["TOKB"] * m["QPB"] == 64 and m["MULTI_DOC"] and not m["FLAT_RUN"]
    m = meta(1, 128, 300)
    assert m["TOKB"] * m["QPB"] == 128 and m["MULTI_DOC"] and not m["FLAT_RUN"]
    m = meta(1, 128, 180, 384)               # d = 384: 128-token tiles
    assert m["BLOCK_N"] == 128 and m["FLAT_RUN"] and m["STRADDLE"]


def test_bandwidth_bound_scoring_streams_on_two_warps(monkeypatch):
    """Run 12: 2 warps where each document token meets at most 32 query tokens, d <= 256, one program per
    document and at least 2^19 streamed tokens; 4 below that, for d = 384 and for the training forward; the
    document-token split keeps its 8."""
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    fc = launch.forward_config
    assert fc(1, 10000, 32, 1030, 128, False, False)["num_warps"] == 2
    assert fc(1, 5000, 31, 257, 96, False, False)["num_warps"] == 2
    assert fc(1, 1000, 32, 1024, 128, False, False)["num_warps"] == 2
    assert fc(64, 30, 32, 300, 128, True, False)["num_warps"] == 2                 # per-query candidates
    assert fc(1, 10000, 32, 300, 128, False, False, torch.bfloat16, "int8")["num_warps"] == 2   # int8 products
    assert fc(1, 1000, 32, 300, 128, False, False)["num_warps"] == 4
    assert fc(1, 10000, 32, 180, 384, False, False)["num_warps"] == 4
    assert fc(1, 10000, 32, 300, 128, False, True)["num_warps"] == 4
    assert fc(1, 100, 32, 8192, 128, False, False)["num_warps"] == 8


@pytest.mark.parametrize("d", [1, 16, 24, 32, 96, 256])
def test_int8_products_reduce_over_at_least_32_features(d):
    """Triton's int8 tl.dot needs K >= 32 on the GPU (run 11: d = 16 failed to compile; the interpreter does
    not check): narrower feature axes are zero-padded to 32, in one chunk."""
    cfg = launch.forward_config(1, 100, 32, 300, d, False, False, torch.bfloat16, "int8")
    assert cfg["BLOCK_D"] >= max(32, d) and cfg["D_CHUNKS"] == 1


def test_fp32_cuda_core_scoring_runs_on_four_warps(highest_fp32_precision):
    # run 7 / run 9: 4 warps 2.50 ms vs 8 warps 4.1 on a PyLate-shaped fp32 call
    cfg = launch.forward_config(64, 512, 32, 180, 128, False, False, dtype=torch.float32)
    assert (cfg["num_warps"], cfg["BLOCK_D"]) == (4, 32)


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_scoring_launch_allocates_no_auxiliary_tensor(monkeypatch, smooth_tau):
    """Scoring returns no aux (an allocation is ~3 us of host time, a tenth of a small call's) and hands the
    kernel a stand-in pointer; training gets aux [Nq, C, Lq]; a smooth max split over document tokens keeps its
    per-slice sums in one, which one combine launch reads."""
    from flash_maxsim.kernels import launch
    launched, kernels = [], []
    monkeypatch.setattr(launch._launcher, "launch",
                        lambda kernel, grid, tensors, *rest: launched.append(tensors) or kernels.append(kernel))
    queries, documents = torch.randn(2, 8, 32), torch.randn(5, 40, 32)
    scores, aux = launch.forward(queries, documents, None, None, None, 0, False, smooth_tau, False)
    assert scores.shape == (2, 5) and aux is None
    assert launched[-1][6] is queries                       # AUX: the stand-in, never read
    scores, aux = launch.forward(queries, documents, None, None, None, 0, False, smooth_tau, True)
    assert aux.shape == (2, 5, 8) and aux.dtype == (torch.int16 if smooth_tau is None else torch.float32)
    assert launched[-1][6] is aux
    monkeypatch.setitem(launch.FORWARD_OVERRIDES, "DSPLIT", 2)
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    long_documents = torch.randn(5, 200, 32)
    launch.forward(queries, long_documents, None, None, None, 0, False, smooth_tau, False, 200)
    assert kernels[-2:] == [launch.maxsim_fwd_kernel, launch.maxsim_combine_slices_kernel]
    row_states, row_sums = launched[-2][5], launched[-2][6]
    assert launched[-1][0] is row_states and (launched[-1][1] is (row_states if smooth_tau is None else row_sums))
    assert row_states.shape == (2, 2, 5, 8)                 # two token slices: per-row states
    assert (row_sums is queries) == (smooth_tau is None)
    if smooth_tau is not None:
        assert row_sums.shape == (2, 2, 5, 8)


@pytest.mark.parametrize("smooth_tau", [None, 0.5])
def test_backward_plan_is_built_once_per_problem_and_launches_the_same(monkeypatch, smooth_tau):
    """The backward's launch arguments are cached per shape / stride / flag key like the forward's: a repeated
    step builds no plan and launches exactly what the first one did (the output strides taken from the tensors
    allocated per call); other strides, or a tuning override, get their own plan."""
    from flash_maxsim.kernels import launch
    launched = []
    monkeypatch.setattr(launch._launcher, "launch", lambda kernel, grid, tensors, scalars, meta, *keys:
                        launched.append((kernel, grid, scalars, meta)))
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    built = []
    real_plan = launch._backward_plan
    monkeypatch.setattr(launch, "_backward_plan", lambda *a: built.append(1) or real_plan(*a))
    queries, documents = torch.randn(2, 8, 32), torch.randn(64, 40, 32)
    mask = torch.rand(64, 40) > 0.2
    aux = (torch.zeros(2, 64, 8, dtype=torch.int16) if smooth_tau is None else torch.zeros(2, 64, 8))
    grad = torch.randn(2, 64)

    def step(g=grad, m=mask):
        launched.clear()
        dq, dd = launch.backward(g, queries, documents, None, m, None, 40, aux, 0, smooth_tau, True, True)
        return list(launched)
    first = step()
    # the hard max: both gradients in one launch
    assert [k for k, *_ in first] == ([launch.maxsim_bwd_fused_kernel] if smooth_tau is None
                                      else [launch.maxsim_bwd_dq_kernel, launch.maxsim_bwd_dd_dense_kernel])
    assert step() == first and len(built) == 1
    step(g=torch.randn(64, 2).t())                     # the loss's gradient transposed: other strides
    assert len(built) == 2 and launched[0][2] != first[0][2]
    monkeypatch.setitem(launch.BACKWARD_OVERRIDES, "DD_WARPS", 2)
    step()
    assert len(built) == 3 and launched[1][3]["num_warps"] == 2


def test_dq_partial_sums_are_freed_before_dd_is_allocated(monkeypatch):
    """The dQ column splits' fp32 partial sums must not live on while dD (as large as the documents) is
    allocated and computed in its own launch: they would add to the training step's peak memory. (In the hard
    max's single launch they do, above 256 columns only: test_both_gradients_in_one_launch_for_the_hard_max.)"""
    import weakref
    from flash_maxsim.kernels import launch
    monkeypatch.setitem(launch.BACKWARD_OVERRIDES, "FUSED", False)
    partials = []

    def record(kernel, grid, tensors, scalars, meta, meta_key=None, plan=None, cache=True):
        if kernel is launch.maxsim_bwd_dq_gather_kernel:         # the hard max's dQ in its own launch
            partials.append(weakref.ref(tensors[4]))
        elif kernel is launch.maxsim_bwd_dd_dense_kernel:
            assert partials and partials[0]() is None, "dQ partial sums still allocated when dD is computed"
            partials.append("dd launched")

    monkeypatch.setattr(launch._launcher, "launch", record)
    queries, documents = torch.randn(2, 8, 32), torch.randn(128, 40, 32)
    aux = torch.zeros(2, 128, 8, dtype=torch.int16)
    grad = torch.randn(2, 128)
    dq, dd = launch.backward(grad, queries, documents, None, None, None, 40, aux, 0, None, True, True)
    assert partials[-1] == "dd launched" and dq.shape == queries.shape and dd.shape == documents.shape
    assert launch._backward_plan(grad, queries, documents, None, None, None, 40, aux, 0, None, True, True,
                                 None).n_cs > 1          # the case above does split the column loop


def _recorded_launches(monkeypatch):
    from flash_maxsim.kernels import launch
    launched = []
    monkeypatch.setattr(launch._launcher, "launch", lambda kernel, grid, tensors, scalars, meta, *keys:
                        launched.append((kernel, tensors)))
    return launched


@pytest.mark.parametrize("need_dd, unsplit_up_to", [(False, 64), (True, 256)], ids=["dq-alone", "hard-max-both"])
def test_query_gradient_column_split_thresholds(monkeypatch, need_dd, unsplit_up_to):
    """dQ unsplit, written in place, up to 64 columns in its own launch (host-bound step sizes) and up to 256 in the
    hard max's single launch for both gradients (dQ's programs, then dD's, which run beside them); one column more
    splits the column loop (fp32 partial sums)."""
    from flash_maxsim.kernels import backward as kernels
    from flash_maxsim.kernels import launch
    launched = _recorded_launches(monkeypatch)
    for columns in (unsplit_up_to, unsplit_up_to + 1):
        split = columns > unsplit_up_to
        launched.clear()
        queries, documents = torch.randn(2, 8, 32), torch.randn(columns, 40, 32)
        aux = torch.zeros(2, columns, 8, dtype=torch.int16)
        dq, dd = launch.backward(torch.randn(2, columns), queries, documents, None, None, None, 40, aux, 0, None,
                                 True, need_dd)
        # dQ alone: the hard max's gather (its output is its fifth tensor)
        kernel, out = (kernels.maxsim_bwd_fused_kernel, 7) if need_dd else (kernels.maxsim_bwd_dq_gather_kernel, 4)
        assert [k for k, _ in launched] == [kernel]
        target = launched[0][1][out]
        assert (target.shape[0] > 1) == split and (target.data_ptr() == dq.data_ptr()) != split
        if need_dd:
            assert launched[0][1][8].data_ptr() == dd.data_ptr() and dd.shape == documents.shape


def test_smooth_max_and_single_gradients_keep_their_own_launches(monkeypatch):
    """The smooth max's dD takes other tiles than dQ: two launches; one gradient asked for: one launch (the hard
    max's dQ alone: the gather)."""
    from flash_maxsim.kernels import backward as kernels
    from flash_maxsim.kernels import launch
    launched = _recorded_launches(monkeypatch)
    queries, documents = torch.randn(2, 8, 32), torch.randn(5, 40, 32)
    for tau, need_dd, expected in ((0.1, True, [kernels.maxsim_bwd_dq_kernel, kernels.maxsim_bwd_dd_dense_kernel]),
                                   (None, False, [kernels.maxsim_bwd_dq_gather_kernel])):
        launched.clear()
        aux = torch.zeros(2, 5, 8, dtype=torch.float32 if tau else torch.int16)
        launch.backward(torch.randn(2, 5), queries, documents, None, None, None, 40, aux, 0, tau, True, need_dd)
        assert [k for k, _ in launched] == expected


@pytest.mark.parametrize("entries, Ld, expected", [
    (128 * 32, 300, "binned"),      # ColBERT in-batch B128
    (64 * 32, 300, "binned"),       # ColBERT B64 + 7 negatives
    (32, 300, "dense"),             # KD, 64 candidates per query: 32 entries per document
    (64 * 32, 1030, "binned"),      # ColPali in-batch B64
    (256 * 32, 1030, "binned"),     # ColPali in-batch B256
], ids=["colbert-b128", "colbert-b64-7neg", "kd", "colpali-b64", "colpali-b256"])
def test_default_dd_method_for_the_benchmarked_steps(entries, Ld, expected):
    """The dD kernel each benchmarked training step takes, as session 23's A/B chose."""
    from flash_maxsim.kernels import launch
    assert launch.default_dd_method(Ld, entries) == expected


@pytest.mark.parametrize("Nq, T, Ld, expected", [(2, 3, 1024, "binned"), (2, 3, 300, "fused"),
                                                  (32, 2, 300, "binned"), (31, 8, 300, "fused")])
def test_hard_max_dd_is_binned_for_long_documents_or_many_entries_and_fused_with_dq_otherwise(monkeypatch, Nq, T,
                                                                                             Ld, expected):
    """Hard max: documents of BINNED_DD_MIN_TOKENS tokens or more, or of BINNED_DD_MIN_ENTRIES arg-max entries
    (here 32 queries x 32 tokens), take the binned dD after dQ's own launch (the gather); the others one launch for
    both gradients (the dense dD and the row-at-a-time dQ); the overrides still pick each."""
    from flash_maxsim.kernels import backward as kernels
    from flash_maxsim.kernels import launch
    launched = _recorded_launches(monkeypatch)
    monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
    Lq = 32 if Nq > 2 else 8
    queries, documents = torch.randn(Nq, Lq, 32), torch.randn(T, Ld, 32)
    aux = torch.zeros(Nq, T, Lq, dtype=torch.int16)

    def kernels_launched(**overrides):
        launched.clear()
        monkeypatch.setattr(launch, "BACKWARD_OVERRIDES", overrides)
        launch.backward(torch.randn(Nq, T), queries, documents, None, None, None, Ld, aux, 0, None, True, True)
        return [k for k, _ in launched]
    binned = [kernels.maxsim_bwd_dq_gather_kernel, kernels.maxsim_bwd_dd_binned_kernel]
    fused = [kernels.maxsim_bwd_fused_kernel]
    assert kernels_launched() == (binned if expected == "binned" else fused)
    assert kernels_launched(DD_METHOD="dense") == fused
    assert kernels_launched(DD_METHOD="binned") == binned
    assert kernels_launched(DD_METHOD="binned", DQ_METHOD="rows") == [kernels.maxsim_bwd_dq_kernel,
                                                                       kernels.maxsim_bwd_dd_binned_kernel]
    assert kernels_launched(DD_METHOD="dense", FUSED=False) == [kernels.maxsim_bwd_dq_gather_kernel,
                                                                kernels.maxsim_bwd_dd_dense_kernel]


def test_binned_dd_register_cap_reaches_its_launch(monkeypatch):
    """The binned dD's registers are capped through Triton's ``maxnreg`` at BINNED_DD_MAXNREG (4 programs per SM,
    session 24); BACKWARD_OVERRIDES["DD_MAXNREG"] changes the cap, 0 removes it; the dQ launch never has one."""
    from flash_maxsim.kernels import launch
    metas = []
    monkeypatch.setattr(launch._launcher, "launch", lambda kernel, grid, tensors, scalars, meta, *keys, **kw:
                        metas.append((kernel, dict(meta))))
    queries, documents = torch.randn(2, 8, 32), torch.randn(3, 1024, 32)
    aux = torch.zeros(2, 3, 8, dtype=torch.int16)

    def binned_meta(**overrides):
        metas.clear()
        monkeypatch.setattr(launch, "_BACKWARD_PLANS", {})
        monkeypatch.setattr(launch, "BACKWARD_OVERRIDES", dict(overrides))
        launch.backward(torch.randn(2, 3), queries, documents, None, None, None, 1024, aux, 0, None, True, True)
        assert [k for k, _ in metas] == [launch.maxsim_bwd_dq_gather_kernel, launch.maxsim_bwd_dd_binned_kernel]
        assert "maxnreg" not in metas[0][1]
        return metas[1][1]
    assert binned_meta()["maxnreg"] == launch.BINNED_DD_MAXNREG == 128
    assert binned_meta(DD_MAXNREG=96)["maxnreg"] == 96
    assert "maxnreg" not in binned_meta(DD_MAXNREG=0)
