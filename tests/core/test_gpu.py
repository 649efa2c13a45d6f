"""The contract on a CUDA device at real sizes: scores and gradients against the float64 reference (computed on
the GPU), determinism, peak memory, torch.compile and CUDA graphs, and a document tensor of more than 2^31
elements. Skipped without CUDA."""

import math

import pytest
import torch

import flash_maxsim

from .helpers import (assert_grads_close, assert_scores_close, expected_scores_and_grads, flash_scores_and_grads,
                      make_case, random_tensor, reference_scores_and_grads, upstream_gradient)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("highest_fp32_precision")]
DEVICE = "cuda"
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_against_reference(case):
    """Scores vs the float64 reference; gradients vs float64 autograd. For the hard max the oracle follows the
    kernel's saved arg-max after checking it is a maximum to within fp32 rounding (at these sizes two tokens
    are sometimes closer than that, and either is then correct; the exact-tie rule is tested separately)."""
    grad_out = upstream_gradient(case)
    got, grads = flash_scores_and_grads(case, grad_out)
    expected, expected_grads = expected_scores_and_grads(case, grad_out)
    assert_scores_close(got, expected, case)
    assert_grads_close(grads, expected_grads, case)


def _config(layout, dtype, masked, tau, d, Lq=32, Ld=300, Nq=6, C=12, **extra):
    return pytest.param(dict(layout=layout, dtype=dtype, masked=masked, smooth_tau=tau, d=d, Lq=Lq, Ld=Ld, Nq=Nq,
                             C=C, **extra),
                        id=f"{layout}-{DTYPE_IDS[dtype]}-{masked}-{'hard' if tau is None else f'tau{tau}'}-"
                           f"d{d}-Lq{Lq}-Ld{Ld}")


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MASKS = dict(query_mask_keep=0.9, doc_mask_keep=0.8, fully_masked_doc=True)
CONFIGS = [
    # ColBERT-like, every layout x dtype, masks with holes, both modes, hard and smooth
    *[_config(layout, dtype, masked, tau, d, empty_doc=layout in ("list", "packed"), noncontiguous=nc, **MASKS)
      for layout, nc in [("padded", False), ("candidates", True), ("list", False), ("packed", True)]
      for dtype, d in [(BF16, 128), (FP16, 96), (FP32, 64)]
      for masked, tau in [("exclude", None), ("zero", 0.05), ("zero", None), ("exclude", 1.0)]],
    # wide features (chunked feature axis)
    _config("padded", BF16, "exclude", None, 384, Lq=32, Ld=180, **MASKS),
    _config("packed", BF16, "zero", 0.1, 1024, Lq=32, Ld=128, Nq=4, C=8, **MASKS),
    _config("candidates", FP16, "exclude", None, 1024, Lq=16, Ld=64, Nq=4, C=4),
    # long queries (ColPali image-to-image): the split query axis
    _config("padded", BF16, "exclude", None, 128, Lq=1024, Ld=1030, Nq=2, C=4),
    _config("padded", BF16, "zero", 0.1, 128, Lq=1024, Ld=1030, Nq=2, C=4, **MASKS),
    _config("list", FP32, "exclude", None, 64, Lq=1024, Ld=700, Nq=2, C=4, empty_doc=True, **MASKS),
    _config("candidates", BF16, "exclude", 0.05, 96, Lq=1024, Ld=257, Nq=2, C=3),
    # one query against many documents; ColPali-sized documents
    _config("padded", BF16, "exclude", None, 128, Lq=32, Ld=300, Nq=1, C=512),
    _config("padded", BF16, "exclude", None, 128, Lq=32, Ld=1030, Nq=4, C=16, **MASKS),
    _config("packed", BF16, "exclude", None, 128, Lq=31, Ld=257, Nq=3, C=200, empty_doc=True),
    # the training forward's 256-row tiles with 16-token tail tiles (documents of 512 tokens or more, enough
    # programs of 8 queries)
    _config("padded", BF16, "zero", None, 128, Lq=32, Ld=1030, Nq=64, C=64, **MASKS),
    _config("padded", FP16, "exclude", 0.1, 128, Lq=32, Ld=1030, Nq=64, C=64, **MASKS),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_scores_and_gradients_match_reference(config, seed):
    check_against_reference(make_case(seed=seed, device=DEVICE, **config))


def test_default_fp32_precision_allows_tf32(seed):
    """fp32 inputs at the default precision ("high" allows tf32): scores within tf32 rounding."""
    torch.set_float32_matmul_precision("high")
    case = make_case(layout="padded", Nq=4, C=16, Lq=32, Ld=300, d=128, seed=seed, device=DEVICE)
    got, _ = flash_scores_and_grads(case)
    expected, _ = reference_scores_and_grads(case)
    assert_scores_close(got, expected, case, rtol=2 ** -10)


@pytest.mark.parametrize("smooth_tau", [None, 0.1], ids=["hard", "smooth"])
@pytest.mark.parametrize("layout", ["padded", "packed", "candidates"])
def test_bitwise_deterministic(layout, smooth_tau, seed):
    case = make_case(layout=layout, Nq=8, C=64, Lq=1024 if layout == "padded" else 32, Ld=300, d=128,
                     dtype=BF16, smooth_tau=smooth_tau, doc_mask_keep=0.9, seed=seed, device=DEVICE)
    grad_out = upstream_gradient(case)
    runs = [flash_scores_and_grads(case, grad_out) for _ in range(3)]
    with torch.no_grad():
        inference = [case.run(flash_maxsim.maxsim, case.leaves()) for _ in range(2)]
    for scores, grads in runs[1:]:
        assert torch.equal(scores, runs[0][0])
        for a, b in zip(grads, runs[0][1]):
            assert torch.equal(a, b)
    assert torch.equal(inference[0], inference[1])


@pytest.mark.parametrize("misaligned", ["queries", "documents", "mask"])
def test_cached_launches_follow_data_and_alignment(misaligned, seed, monkeypatch):
    """Launches after the first of a specialisation skip Triton's argument binding (kernels/direct_launch.py): the
    same shapes with new values, and then with tensors whose storage starts 2 bytes past a 16-byte boundary (a
    different Triton specialisation), must give bit for bit what Triton's own launch path gives on the same
    tensors (the kernels are deterministic), and scores matching the reference. (Gradients against float64 are
    tested with the tie-aware oracle elsewhere: here a near-tie could legitimately pick another token.)"""
    from flash_maxsim.kernels import direct_launch
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def shifted(shape, dtype, shift):
        flat = torch.empty(math.prod(shape) + 8, dtype=dtype, device=DEVICE)
        view = flat[shift:shift + math.prod(shape)].view(shape)
        view.copy_(torch.randn(shape, generator=g, device=DEVICE).to(dtype) if dtype.is_floating_point
                   else torch.rand(shape, generator=g, device=DEVICE) < 0.8)
        return view

    def scores_and_grads(q, docs, mask, w):
        q, docs = q.detach().requires_grad_(True), docs.detach().requires_grad_(True)
        got = flash_maxsim.maxsim(q, docs, documents_mask=mask)
        (got * w).sum().backward()
        return got, q.grad, docs.grad

    Nq, B, Lq, Ld, d = 3, 20, 32, 130, 64
    for i, shift in enumerate((0, 0, 1, 1)):
        q = shifted((Nq, Lq, d), BF16, shift if misaligned == "queries" else 0)
        docs = shifted((B, Ld, d), BF16, shift if misaligned == "documents" else 0)
        mask = shifted((B, Ld), torch.bool, shift if misaligned == "mask" else 0)
        w = torch.randn((Nq, B), generator=g, device=DEVICE)
        runs_before = len(direct_launch._RUNNERS)
        cached = scores_and_grads(q, docs, mask, w)
        if i % 2:   # the second call of a specialisation launches what the first one bound
            assert len(direct_launch._RUNNERS) == runs_before, "a repeated specialisation was bound again"
        with monkeypatch.context() as m:
            m.setattr(direct_launch, "_enabled", False)
            tritons_own = scores_and_grads(q, docs, mask, w)
        for a, b in zip(cached, tritons_own):
            assert torch.equal(a, b)
        ref = flash_maxsim.reference.maxsim(q.double(), docs.double(), documents_mask=mask)
        torch.testing.assert_close(cached[0].double(), ref, rtol=1e-5, atol=1e-4)
    assert direct_launch._enabled


def test_repeated_launches_call_tritons_c_launcher_where_its_layout_is_known():
    """On a Triton whose C launcher layout the launcher knows (3.6; 3.7-3.9), every kernel of scoring calls (bf16
    with and without TMA copies, an int8 index) and of a training step launches directly from its second call on
    (a silent fall back to Triton's compiled runner would cost 5-25 us per launch)."""
    from flash_maxsim.kernels import direct_launch
    parts = direct_launch._triton_launch_parts()
    if parts is None or parts[0] is None:
        pytest.skip("this Triton's C launcher layout is not one the launcher knows: its runner is used")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(2, 32, 128, generator=g, device=DEVICE, dtype=BF16)
    q96 = torch.randn(1, 31, 96, generator=g, device=DEVICE, dtype=BF16)
    docs = torch.randn(64, 300, 128, generator=g, device=DEVICE, dtype=BF16)
    docs96 = torch.randn(2000, 257, 96, generator=g, device=DEVICE, dtype=BF16)
    index = flash_maxsim.quantize(docs)

    def step():
        qq, dd = q.detach().requires_grad_(True), docs[:8].detach().requires_grad_(True)
        flash_maxsim.maxsim(qq, dd).logsumexp(-1).sum().backward()
    calls = [lambda: flash_maxsim.maxsim(q, docs), lambda: flash_maxsim.maxsim(q96, docs96),
             lambda: flash_maxsim.maxsim(q, index), step]
    direct_launch._RUNNERS.clear()
    for call in calls:
        call()
        call()
    torch.cuda.synchronize()
    assert direct_launch._enabled and direct_launch._RUNNERS
    not_direct = [(getattr(key[0], "fn", key[0]).__name__, type(entry).__name__)
                  for key, entry in direct_launch._RUNNERS.items()
                  if not isinstance(entry, direct_launch._CLauncherCall)]
    assert not_direct == [], not_direct


_FP_FUSION_SCRIPT = """
import warnings, torch, triton, flash_maxsim
from flash_maxsim.kernels import backward, forward, forward_token_rows
from flash_maxsim.kernels.direct_launch import compiled_kernels
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('always')
    q = torch.randn(2, 32, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    d = torch.randn(16, 300, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)
    flash_maxsim.maxsim(q, d).sum().backward()
    flash_maxsim.maxsim(q.detach(), flash_maxsim.quantize(d.detach()))
    torch.cuda.synchronize()
fusion = [getattr(compiled.metadata, 'enable_fp_fusion', None)
          for module in (forward, backward, forward_token_rows) for kernel in vars(module).values()
          if isinstance(kernel, triton.runtime.jit.JITFunction)
          for compiled in compiled_kernels(kernel)]
print('FUSION', len(fusion), all(fusion))
print('WARNINGS', [str(w.message) for w in seen if 'FP_FUSION' in str(w.message)])
"""


@pytest.mark.parametrize("triton_default", [None, "0"], ids=["default-unset", "default-off"])
def test_kernels_compile_with_fp_fusion_whatever_tritons_default(triton_default):
    """Every kernel compiles with fp fusion (FMA contraction), what they were measured and checked with, also where
    Triton's default is off (``TRITON_DEFAULT_FP_FUSION=0``, 3.10's default), and Triton 3.9's warning about
    leaving it to the default never fires: the launcher asks for it by name. A fresh process, so that the kernels
    are compiled there."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if triton_default is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = triton_default
    src = str(Path(flash_maxsim.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", _FP_FUSION_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled, all_fused = proc.stdout.split("FUSION ")[1].split()[:2]
    assert int(compiled) >= 3 and all_fused == "True", f"Triton {triton.__version__}: {proc.stdout[-2000:]}"
    assert "WARNINGS []" in proc.stdout, f"Triton {triton.__version__}: {proc.stdout[-2000:]}"


@pytest.mark.parametrize("Nq, B, Ld, ties", [(64, 512, 300, False), (64, 512, 300, True), (16, 64, 1030, True)],
                         ids=["B64+7neg-random", "B64+7neg-ties", "ColPali-ties"])
def test_training_forward_arg_max_pairs_match_one_max_per_row(Nq, B, Ld, ties, seed, monkeypatch):
    """The training forward's hard-max default (partial (max, arg-max) pairs per row, whole tiles copied by TMA on
    Hopper) at training shapes: scores and saved arg-max bit for bit those of one max per row with the threads'
    copies, on random inputs and on small integers (ties everywhere), masks included."""
    from flash_maxsim import _layout
    from flash_maxsim.kernels import launch, tuning
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})          # the plans of this test's calls only
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if ties:
        q = torch.randint(-2, 3, (Nq, 32, 128), generator=g, device=DEVICE).to(BF16)
        d = torch.randint(-2, 3, (B, Ld, 128), generator=g, device=DEVICE).to(BF16)
    else:
        q = torch.randn(Nq, 32, 128, generator=g, device=DEVICE).to(BF16)
        d = torch.randn(B, Ld, 128, generator=g, device=DEVICE).to(BF16)
    qm = torch.rand(Nq, 32, generator=g, device=DEVICE) > 0.1
    dm = torch.rand(B, Ld, generator=g, device=DEVICE) > 0.2
    dm[3] = False
    p = _layout.canonicalize(q, d, qm, dm, masked="exclude", smooth_tau=None)
    results = []
    for overrides in ({}, {"ROW_PARTIALS": 1, "TMA_ONE_DOC": False}):
        monkeypatch.setattr(tuning, "FORWARD_OVERRIDES", tuning.Overrides.forward(overrides))
        results.append(launch.forward(p.queries, p.documents, p.queries_mask, p.documents_mask, p.offsets,
                                      p.candidates, False, None, True, p.max_length, p.document_scales))
        meta = next(reversed(launch._FORWARD_PLANS.values())).meta
        want = (8, torch.cuda.get_device_capability() >= (9, 0)) if not overrides else (1, False)
        assert (meta["ROW_PARTIALS"], meta["TMA_DOCS"]) == want
    (scores, arg), (scores1, arg1) = results
    assert torch.equal(scores, scores1)
    assert torch.equal(arg, arg1)
    assert (arg[:, 3] == -1).all() and (arg >= 0).float().mean() > 0.8


@pytest.mark.parametrize("d, Nq, Ld", [(96, 1, 130), (128, 4, 128)], ids=["d96-straddling", "d128-whole-tiles"])
def test_cached_tma_descriptors_follow_the_documents(d, Nq, Ld, seed, monkeypatch):
    """Runs of documents copied by TMA: the direct launch encodes the documents' descriptor once per address
    (kernels/direct_launch.py). Scores must follow the documents' values and address: the same index again, its values
    changed in place, another index of the same shape, and a new one allocated where a freed one was, each
    bit for bit what Triton's own launch path gives (its descriptor made afresh) and close to the reference."""
    from flash_maxsim.kernels import direct_launch, launch, tuning
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0")
    monkeypatch.setattr(tuning, "FORWARD_OVERRIDES",
        tuning.Overrides.forward(dict(DOCS=4, PROGRAMS_PER_SM=0, TMA_DOCS=True)))
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    B = 40
    q = torch.randn(Nq, 31, d, generator=g, device=DEVICE).to(BF16)

    def index():
        return torch.randn(B, Ld, d, generator=g, device=DEVICE).to(BF16)

    def check(docs):
        got = flash_maxsim.maxsim(q, docs)
        with monkeypatch.context() as m:
            m.setattr(direct_launch, "_enabled", False)
            tritons_own = flash_maxsim.maxsim(q, docs)
        assert torch.equal(got, tritons_own)
        ref = flash_maxsim.reference.maxsim(q.double(), docs.double())
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)

    a, b = index(), index()
    check(a)
    check(a)
    a.copy_(index())                      # new values at the same address
    check(a)
    check(b)
    address = b.data_ptr()
    del b
    c = index()                           # the caching allocator hands out the freed block again, usually
    check(c)
    check(a)
    plans = [p for p in launch._FORWARD_PLANS.values() if p.meta["TMA_DOCS"]]
    assert plans, "no run of documents was copied by TMA"
    parts = direct_launch._triton_launch_parts()
    if parts is not None and parts[0] == direct_launch._C_LAUNCH_FORMAT:     # Triton 3.6: the C launcher directly
        entries = [e for k, e in direct_launch._RUNNERS.items() if any(k[1] is p for p in plans)]
        assert entries and all(type(e).__name__ == "_CLauncherCall" for e in entries)
        assert any(len(e.encoded) >= 2 for e in entries)
    assert direct_launch._enabled
    print(f"index reused its freed block: {c.data_ptr() == address}")

def _peak_extra_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


@pytest.mark.parametrize("smooth_tau", [None, 0.1], ids=["hard", "smooth"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_peak_memory_of_training_step_does_not_scale_with_similarities(layout, smooth_tau, seed):
    Nq, B, Lq, Ld, d = 64, 256, 128, 1024, 128
    case = make_case(layout=layout, Nq=Nq, C=B, Lq=Lq, Ld=Ld, d=d, dtype=BF16, smooth_tau=smooth_tau,
                     lengths=[Ld] * B, seed=seed, device=DEVICE)
    grad_out = upstream_gradient(case)
    leaves = case.leaves()

    def step():
        scores = case.run(flash_maxsim.maxsim, leaves)
        return torch.autograd.grad(scores, leaves, grad_out)

    step()                                                    # compile the kernels outside the measurement
    peak, _ = _peak_extra_bytes(step)
    q_numel, d_numel = Nq * Lq * d, B * Ld * d
    # gradients (input dtype) + dQ partial sums (<= 16 x fp32 [Nq, Lq, d]) + per-row state and its sort
    # (aux, keys, permutation: a few words per (query, document, query token)) + row starts per document
    # token + slack: nothing proportional to Lq * Ld
    bound = (2 * 2 * (q_numel + d_numel) + 16 * 4 * q_numel + 32 * Nq * B * Lq + 8 * B * Ld + (32 << 20))
    similarity_bytes = Nq * B * Lq * Ld * 4
    assert similarity_bytes > 10 * bound
    assert peak < bound, f"peak extra {peak / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"


def test_peak_memory_of_scoring_is_scores_plus_workspace(seed):
    Nq, B, Lq, Ld, d = 32, 1000, 32, 1030, 128
    q = random_tensor((Nq, Lq, d), BF16, torch.Generator().manual_seed(seed), DEVICE)
    docs = torch.randn(B, Ld, d, device=DEVICE, dtype=BF16)
    with torch.no_grad():
        flash_maxsim.maxsim(q, docs)
        peak, _ = _peak_extra_bytes(lambda: flash_maxsim.maxsim(q, docs))
    # scores, query-split partial sums and document-split row states: O(Nq * B * Lq) words at most
    bound = 4 * 4 * Nq * B * Lq + (8 << 20)
    assert Nq * B * Lq * Ld * 4 > 10 * bound
    assert peak < bound, f"peak extra {peak / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"


def _training_step(q, d, qmask, dmask, grad_out):
    scores = flash_maxsim.maxsim(q, d, qmask, dmask, masked="zero", smooth_tau=None)
    loss = (scores * grad_out).sum()
    dq, dd = torch.autograd.grad(loss, (q, d))
    return scores, dq, dd


def _static_inputs(seed, Nq=8, B=32, Lq=32, Ld=300, d=128):
    g = torch.Generator().manual_seed(seed)
    q = random_tensor((Nq, Lq, d), BF16, g, DEVICE).requires_grad_()
    d_ = random_tensor((B, Ld, d), BF16, g, DEVICE).requires_grad_()
    qmask = (torch.rand(Nq, Lq, generator=g) < 0.9).to(DEVICE)
    dmask = (torch.rand(B, Ld, generator=g) < 0.8).to(DEVICE)
    grad_out = torch.randn(Nq, B, generator=g).to(DEVICE)
    return q, d_, qmask, dmask, grad_out


def _scores(q, d, qmask, dmask):
    return flash_maxsim.maxsim(q, d, qmask, dmask, masked="zero")


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_forward_and_backward(mode, seed):
    """fullgraph compile (inductor; "reduce-overhead" also runs forward and backward graphs through CUDA
    graphs) equals eager, forward and gradients (the backward graph is compiled by AOTAutograd)."""
    torch._dynamo.reset()
    compiled = torch.compile(_scores, fullgraph=True, mode=mode)
    for step in range(3):                                     # several calls: recording, then replays
        q, d, qmask, dmask, grad_out = _static_inputs(seed + step)
        results = []
        for fn in (_scores, compiled):
            q.grad = d.grad = None
            scores = fn(q, d, qmask, dmask)
            (scores * grad_out).sum().backward()
            results.append((scores.detach().clone(), q.grad.clone(), d.grad.clone()))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cuda_graph_capture_and_replay(layout, seed):
    q, d, qmask, dmask, grad_out = _static_inputs(seed)
    if layout == "packed":
        B, Ld = d.shape[:2]
        offsets = torch.arange(0, B * Ld + 1, Ld, device=DEVICE)
        values = d.detach().reshape(B * Ld, -1).clone().requires_grad_()
        flat_mask = dmask.reshape(-1)

        def step(q, values, qmask, flat_mask, grad_out):
            packed = flash_maxsim.PackedDocuments(values, offsets, Ld)   # max_length: no host read
            scores = flash_maxsim.maxsim(q, packed, qmask, flat_mask, masked="zero")
            return (scores,) + torch.autograd.grad((scores * grad_out).sum(), (q, values))
        args = [q, values, qmask, flat_mask, grad_out]
    else:
        step, args = _training_step, [q, d, qmask, dmask, grad_out]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                             # warm-up outside capture (kernel compilation)
        for _ in range(2):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*args)

    for replay in range(2):                                   # new data in the same buffers, then replay
        fresh = _static_inputs(seed + 100 + replay)
        with torch.no_grad():
            args[0].copy_(fresh[0])
            args[1].copy_(fresh[1].reshape(args[1].shape))
            args[2].copy_(fresh[2])
            args[3].copy_(fresh[3].reshape(args[3].shape))
            args[4].copy_(fresh[4])
        graph.replay()
        torch.cuda.synchronize()
        eager = step(*args)
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)


def test_document_tensor_beyond_2_31_elements(seed):
    """bf16 [2^15 + 1, 512, 128] (2^31 + 65536 elements, 4.3 GB): documents past the 2^31 boundary are scored
    and differentiated correctly, padded and packed."""
    B, Ld, d, Nq, Lq = 2 ** 15 + 1, 512, 128, 2, 32
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2 ** 30:
        pytest.skip("needs ~20 GB of device memory")
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    docs = torch.randn(B, Ld, d, generator=g, device=DEVICE, dtype=BF16)
    assert docs.numel() > 2 ** 31
    q = (torch.randn(Nq, Lq, d, generator=g, device=DEVICE) * d ** -0.5).to(BF16).requires_grad_()
    # the documents on either side of element 2^31 (it starts document 2^15, the last one) and the last few
    boundary = 2 ** 31 // (Ld * d)
    check_docs = sorted({boundary - 2, boundary - 1, boundary, B - 3, B - 2, B - 1})
    assert check_docs[-1] == B - 1 and (boundary + 1) * Ld * d > 2 ** 31
    grad_out = torch.randn(Nq, B, generator=g, device=DEVICE)

    offsets = torch.arange(0, B * Ld + 1, Ld, device=DEVICE)
    for documents in (docs, flash_maxsim.PackedDocuments(docs.view(B * Ld, d), offsets, Ld)):
        d_leaf = (documents if isinstance(documents, torch.Tensor) else documents.values).requires_grad_()
        scores = flash_maxsim.maxsim(q, documents)
        (dd,) = torch.autograd.grad((scores * grad_out).sum(), (d_leaf,))
        d_leaf.requires_grad_(False)
        dd = dd.view(B, Ld, d)
        sub = docs[check_docs].detach().double().requires_grad_()
        q64 = q.detach().double()
        expected = flash_maxsim.reference.maxsim(q64, sub)
        scale = Lq * q64.norm(dim=-1).max().item() * sub.norm(dim=-1).max().item()
        torch.testing.assert_close(scores[:, check_docs].double(), expected, rtol=0, atol=2e-5 * scale)
        (expected_dd,) = torch.autograd.grad((expected * grad_out[:, check_docs].double()).sum(), (sub,))
        # dD rounds twice in bf16: the upstream gradient before the tensor-core product (as PyTorch's bf16 autograd
        # does) and dD itself: up to 2 units of roundoff (2^-7) of its terms (test_backward_variants.py)
        torch.testing.assert_close(dd[check_docs].double(), expected_dd, rtol=2 ** -7, atol=2e-3)
        del dd, scores


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32], ids=["bool", "int64", "float32"])
@pytest.mark.parametrize("layout", ["padded", "candidates", "quantized"])
def test_scoring_never_waits_for_the_device(layout, mask_dtype, seed, twice_second_without_sync):
    """A forward call on the padded, per-query-candidate and quantised layouts, masks of any dtype included,
    enqueues its work without synchronising with the device (torch's sync debug mode raises on any op that
    would), so a retrieval loop's host runs ahead of the GPU. Ragged lists read their lengths once, by design."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    Nq, Lq, B, Ld, d = 3, 32, 40, 77, 128
    q = torch.randn(Nq, Lq, d, generator=g, device=DEVICE, dtype=BF16)
    shape = (Nq, B // Nq, Ld, d) if layout == "candidates" else (B, Ld, d)
    docs = torch.randn(*shape, generator=g, device=DEVICE, dtype=BF16)
    q_mask = (torch.rand(Nq, Lq, generator=g, device=DEVICE) < 0.9).to(mask_dtype)
    d_mask = (torch.rand(shape[:-1], generator=g, device=DEVICE) < 0.8).to(mask_dtype)
    if layout == "quantized":
        docs = flash_maxsim.quantize(docs, dtype="int8")
    want, got = twice_second_without_sync(lambda: flash_maxsim.maxsim(q, docs, q_mask, d_mask, masked="zero"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("smooth_tau", [None, 0.1], ids=["hard", "smooth"])
@pytest.mark.parametrize("layout", ["padded", "candidates", "packed"])
def test_training_step_never_waits_for_the_device(layout, smooth_tau, seed, twice_second_without_sync):
    """Scores and both gradients, masks included, without a device synchronisation: a training step's host
    enqueues the backward while the GPU still runs the forward. The packed layout's lengths are read once, when
    it is built (flash_maxsim.pack), not per call."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    Nq, Lq, B, Ld, d = 4, 32, 8, 60, 128
    q = torch.randn(Nq, Lq, d, generator=g, device=DEVICE, dtype=BF16).requires_grad_()
    shape = (Nq, B // Nq, Ld, d) if layout == "candidates" else (B, Ld, d)
    docs = torch.randn(*shape, generator=g, device=DEVICE, dtype=BF16).requires_grad_()
    q_mask = torch.rand(Nq, Lq, generator=g, device=DEVICE) < 0.9
    d_mask = torch.rand(shape[:-1], generator=g, device=DEVICE) < 0.8
    if layout == "packed":
        packed = flash_maxsim.pack(list(docs.unbind(0)))
        d_mask = None

    def step():
        documents = flash_maxsim.PackedDocuments(docs.view(-1, d), packed.offsets, packed.max_length) \
            if layout == "packed" else docs
        scores = flash_maxsim.maxsim(q, documents, q_mask, d_mask, smooth_tau=smooth_tau)
        return (scores, *torch.autograd.grad(scores.square().sum(), (q, docs)))

    want, got = twice_second_without_sync(step)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
