"""On CUDA (the Triton kernels, not the CPU path): scores, gradients, devices, losses and an evaluator equal
sentence-transformers' own on the same device. Skipped without CUDA.

The model tests use a small random BERT MultiVectorEncoder built offline (st_cases.build_tiny_encoder), so
that they need no model package.
"""

from __future__ import annotations

import pytest
import torch

import flash_maxsim
from flash_maxsim.integrations import sentence_transformers as fst
from sentence_transformers.multi_vector_encoder import evaluation, losses

from st_cases import DOCUMENTS, LOSSES_SCORE_WITH_THE_MODEL, ORIGINAL, QUERIES, build_tiny_encoder, features

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


@pytest.fixture
def kernel_devices(monkeypatch):
    """The device of every call that reaches flash_maxsim.maxsim."""
    devices = []
    real = flash_maxsim.maxsim

    def recording(queries, documents, *args, **kwargs):
        devices.append(queries.device.type)
        return real(queries, documents, *args, **kwargs)

    monkeypatch.setattr(flash_maxsim, "maxsim", recording)
    return devices


def _data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [0] + torch.randint(1, 300, (199,), generator=g).tolist()        # a 0-token document included
    queries = torch.nn.functional.normalize(torch.randn(16, 32, 128, generator=g), dim=-1)
    documents = [torch.nn.functional.normalize(torch.randn(n, 128, generator=g), dim=-1) for n in lengths]
    q_mask = torch.rand(16, 32, generator=g) < 0.8
    padded = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
    d_mask = (torch.arange(padded.shape[1])[None] < torch.tensor(lengths)[:, None]) & \
        (torch.rand(padded.shape[:2], generator=g) < 0.9)
    d_mask[5] = False                                                             # nothing scoreable
    move = dict(device=CUDA, dtype=dtype)
    return (queries.to(**move), [d.to(**move) for d in documents], padded.to(**move), q_mask.to(CUDA),
            d_mask.to(CUDA))


def _close(got, expected, tol=1e-4):
    assert got.dtype == torch.float32 and got.device == expected.device and got.shape == expected.shape
    assert torch.equal(got < -1e6, expected < -1e6)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_scores_equal_sentence_transformers_on_cuda(length_normalize, kernel_devices):
    queries, documents, padded, q_mask, d_mask = _data()
    kw = dict(length_normalize=length_normalize)
    cases = [
        ("maxsim", (queries, documents), {}),
        ("maxsim", (queries, padded), dict(a_mask=q_mask, b_mask=d_mask)),
        ("maxsim", (queries * q_mask[..., None], padded * d_mask[..., None]), {}),
        ("maxsim_pairwise", (queries, documents[:16]), dict(a_mask=q_mask)),
        ("maxsim_pairwise", (queries, padded[:16]), dict(a_mask=q_mask, b_mask=d_mask[:16])),
        ("colbert_scores", (queries, padded[:96].reshape(16, 6, *padded.shape[1:])),
         dict(queries_mask=q_mask, documents_mask=d_mask[:96].reshape(16, 6, -1))),
        ("colbert_kd_scores", (queries, padded[:64].reshape(16, 4, *padded.shape[1:])),
         dict(queries_mask=q_mask, documents_mask=d_mask[:64].reshape(16, 4, -1))),
    ]
    for name, args, kwargs in cases:
        _close(getattr(fst, name)(*args, **kwargs, **kw), ORIGINAL[name](*args, **kwargs, **kw))
    assert kernel_devices and set(kernel_devices) == {"cuda"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scores_the_fp32_upcast(dtype):
    """fp32 products and sums: sentence-transformers' scores of the same values in fp32 (it rounds each similarity
    to the input dtype before the max)."""
    queries, documents, padded, q_mask, d_mask = _data(dtype)
    _close(fst.maxsim(queries, documents, a_mask=q_mask),
           ORIGINAL["maxsim"](queries.float(), [d.float() for d in documents], a_mask=q_mask))
    _close(fst.maxsim(queries, padded, b_mask=d_mask), ORIGINAL["maxsim"](queries.float(), padded.float(),
                                                                           b_mask=d_mask))


def test_gradients_equal_sentence_transformers_on_cuda():
    queries, _, padded, q_mask, d_mask = _data(seed=1)
    docs = padded[:64, :120].reshape(16, 4, 120, -1)
    mask = d_mask[:64, :120].reshape(16, 4, -1)
    weights = torch.rand(16, 64, generator=torch.Generator().manual_seed(2)).to(CUDA)
    results = []
    for fn in (ORIGINAL["colbert_scores"], fst.colbert_scores):
        q, d = queries.clone().requires_grad_(), docs.clone().requires_grad_()
        scores = fn(q, d, queries_mask=q_mask, documents_mask=mask)
        results.append((scores.detach(),) + torch.autograd.grad((scores * weights).sum(), (q, d)))
    (expected, *expected_grads), (got, *got_grads) = results
    _close(got, expected)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_result_and_scoring_devices(kernel_devices):
    queries, documents, padded, q_mask, d_mask = _data(seed=3)
    cpu_documents = [d.cpu() for d in documents[:20]]
    # scores come back on the documents' device, scoring runs there (or on `device`)
    got = fst.maxsim(queries, cpu_documents)
    assert got.device.type == "cpu" and kernel_devices[-1] == "cpu"
    _close(got, ORIGINAL["maxsim"](queries, cpu_documents))
    got = fst.maxsim(queries.cpu(), cpu_documents, device="cuda")
    assert got.device.type == "cpu" and kernel_devices[-1] == "cuda"
    _close(got, ORIGINAL["maxsim"](queries.cpu(), cpu_documents, device="cuda"))
    got = fst.maxsim(queries.cpu().numpy(), [d.cpu().numpy() for d in documents[:20]], device="cuda")
    assert got.device.type == "cpu"
    # numpy documents carry no device: the scores follow the queries
    numpy_documents = [d.cpu().numpy() for d in documents[:20]]
    got = fst.maxsim(queries, numpy_documents)
    assert got.device.type == "cuda" and kernel_devices[-1] == "cuda"
    _close(got, ORIGINAL["maxsim"](queries, numpy_documents))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_encoder(tmp_path_factory.mktemp("tiny_encoder"), device="cuda")


def _on_device(batch, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _loss_run(model, loss, columns, labels):
    model.zero_grad(set_to_none=True)
    inputs = [_on_device(features(model, texts, "query" if i == 0 else "document"), model.device)
              for i, texts in enumerate(columns)]
    value = loss(inputs, labels)
    value.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads


def _assert_loss_close(got, expected):
    """Loss values and parameter gradients, on CUDA's tolerances (one absolute scale for all gradients)."""
    (value, grads), (expected_value, expected_grads) = got, expected
    torch.testing.assert_close(value, expected_value, rtol=1e-4, atol=1e-5)
    scale = max(g.abs().max().item() for g in expected_grads.values())
    assert grads.keys() == expected_grads.keys() and scale > 0
    for key in grads:
        torch.testing.assert_close(grads[key], expected_grads[key], rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("name", ["mnrl", "cached_mnrl", "distill_kl", "margin_mse"])
def test_losses_on_cuda(tiny_model, name, kernel_devices):
    columns = [QUERIES[:4], DOCUMENTS[:4], DOCUMENTS[6:10], DOCUMENTS[8:12]]
    make, labels = {
        "mnrl": (lambda: losses.MultiVectorMultipleNegativesRankingLoss(tiny_model), None),
        "cached_mnrl": (lambda: losses.CachedMultiVectorMultipleNegativesRankingLoss(tiny_model, mini_batch_size=2),
                        None),
        "distill_kl": (lambda: losses.MultiVectorDistillKLDivLoss(tiny_model),
                       torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).to(CUDA)),
        "margin_mse": (lambda: losses.MultiVectorMarginMSELoss(tiny_model),
                       torch.randn(4, generator=torch.Generator().manual_seed(0)).to(CUDA)),
    }[name]
    if name != "distill_kl":
        columns = columns[:3]
    expected_value, expected_grads = _loss_run(tiny_model, make(), columns, labels)
    with fst.enabled():
        value, grads = _loss_run(tiny_model, make(), columns, labels)
    assert "cuda" in kernel_devices
    _assert_loss_close((value, grads), (expected_value, expected_grads))


def test_model_similarity_and_evaluator_on_cuda(tiny_model, kernel_devices):
    queries, documents = tiny_model.encode_query(QUERIES), tiny_model.encode_document(DOCUMENTS)
    expected = tiny_model.similarity(queries, documents)
    corpus = {f"d{i}": t for i, t in enumerate(DOCUMENTS)}
    relevant = {f"q{i}": {f"d{i}"} for i in range(len(QUERIES))}
    make = lambda: evaluation.MultiVectorInformationRetrievalEvaluator(  # noqa: E731
        {f"q{i}": t for i, t in enumerate(QUERIES)}, corpus, relevant, write_csv=False)
    expected_metrics = make()(tiny_model)
    with fst.enabled():
        got = tiny_model.similarity(queries, documents)
        metrics = make()(tiny_model)
    assert "cuda" in kernel_devices
    _close(got, expected)
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _needs_kernels():
    if not LOSSES_SCORE_WITH_THE_MODEL:
        pytest.skip("sentence-transformers >= 6.3 (kernel_config, use_kernels)")
    pytest.importorskip("kernels")


@pytest.fixture(scope="module")
def tiny_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_encoder_63")


def test_kernel_config_model_on_cuda(tiny_directory, kernel_devices):
    """kernel_config() on CUDA: the local layers load for a CUDA build of torch (variant torch-universal) and
    score with the Triton kernels; similarity, pairwise and the default MNRL loss equal the plain model's."""
    _needs_kernels()
    plain = build_tiny_encoder(tiny_directory, device="cuda")
    model = build_tiny_encoder(tiny_directory, device="cuda", kernel_config=fst.kernel_config())
    queries, documents = plain.encode_query(QUERIES), plain.encode_document(DOCUMENTS)
    expected = plain.similarity(queries, documents), plain.similarity_pairwise(queries, documents[:6])
    assert not kernel_devices
    got = model.similarity(queries, documents), model.similarity_pairwise(queries, documents[:6])
    assert kernel_devices == ["cuda", "cuda"]
    for value, want in zip(got, expected):
        _close(value, want)
    columns = [QUERIES[:4], DOCUMENTS[:4], DOCUMENTS[6:10]]
    expected_value, expected_grads = _loss_run(plain, losses.MultiVectorMultipleNegativesRankingLoss(plain),
                                               columns, None)
    value, grads = _loss_run(model, losses.MultiVectorMultipleNegativesRankingLoss(model), columns, None)
    _assert_loss_close((value, grads), (expected_value, expected_grads))


def test_enable_takes_over_a_use_kernels_model_on_cuda(tiny_directory, kernel_devices):
    """A use_kernels model on CUDA would fetch late-interaction-kernels from the Hub for MaxSim; enabled,
    flash_maxsim scores instead and the Hub kernels are never configured (the tests run offline).
    Built on the CPU and then moved: built on CUDA, transformers kernelizes the backbone at once and, offline,
    fails fetching its activation kernels from the Hub (before any scorer exists). The scorer configures its
    kernels per device at the first score, so the moved model's scores on CUDA take the same route."""
    _needs_kernels()
    plain = build_tiny_encoder(tiny_directory, device="cuda")
    model = build_tiny_encoder(tiny_directory, device="cpu", use_kernels=True).to("cuda")
    assert model._similarity.kernel_config is not None      # unpatched, it would configure the Hub's MaxSim
    queries, documents = plain.encode_query(QUERIES), plain.encode_document(DOCUMENTS)
    expected = plain.similarity(queries, documents)
    with fst.enabled():
        got = model.similarity(queries, documents)
    assert kernel_devices == ["cuda"] and model._similarity._operations == {}
    _close(got, expected)
