"""On CUDA: the Triton kernels behind the PyLate scorers give PyLate's torch-path numbers, and one training step
of each loss is the same three ways, on a small random BERT built here (no model package needed). Skipped
without CUDA.

    pytest tests/integrations/pylate/test_pylate_gpu.py
"""

import string

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pylate = pytest.importorskip("pylate")

from pylate import losses, models  # noqa: E402

from flash_maxsim import reference  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

import pylate_testlib as lib  # noqa: E402

ATOL = 1e-4


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _grads(scores, inputs, weights):
    return torch.autograd.grad((scores * weights).sum(), inputs)


@pytest.mark.parametrize("shape", [(8, 32, 128, 24, 180), (3, 7, 64, 5, 37)])
def test_scores_and_gradients_equal_pylate_on_cuda(shape, flash_calls):
    Nq, Lq, d, B, Ld = shape
    g = torch.Generator().manual_seed(sum(shape))
    Q = lib.embeddings((Nq, Lq, d), g, side=+1, device="cuda")
    D = lib.embeddings((B, Ld, d), g, side=-1, device="cuda")
    dmask = lib.skiplist_mask((B, Ld), g, device="cuda")
    qmask = lib.skiplist_mask((Nq, Lq), g, hole_rate=0.1, device="cuda")
    weights = torch.randn(Nq, B, generator=g).cuda()

    qa, da, qb, db = _leaf(Q), _leaf(D), _leaf(Q), _leaf(D)
    expected = lib.pylate_colbert_scores(qa, da, qmask, dmask)
    got = flash_pylate.colbert_scores(qb, db, qmask, dmask)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for x, y in zip(_grads(got, (qb, db), weights), _grads(expected, (qa, da), weights)):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)

    groups = B // 4 if B >= 8 else 1
    D4, m4 = D[: groups * 4].reshape(groups, 4, Ld, d), dmask[: groups * 4].reshape(groups, 4, Ld)
    torch.testing.assert_close(flash_pylate.FlashColBERTScores()(Q, D4, qmask, m4),
                               lib.pylate_grouped_scores(Q, D4, qmask, m4), atol=ATOL, rtol=0)

    kd_docs = D[:Nq].unsqueeze(1).expand(Nq, 2, Ld, d).contiguous() if B >= Nq else None
    if kd_docs is not None:
        kd_mask = dmask[:Nq].unsqueeze(1).expand(Nq, 2, Ld).contiguous()
        torch.testing.assert_close(flash_pylate.colbert_kd_scores(Q, kd_docs, qmask, kd_mask),
                                   lib.pylate_colbert_kd_scores(Q, kd_docs, qmask, kd_mask), atol=ATOL, rtol=0)
    pairs = min(Nq, B)
    torch.testing.assert_close(flash_pylate.colbert_scores_pairwise(Q[:pairs], D[:pairs]),
                               lib.pylate_colbert_scores_pairwise(Q[:pairs], D[:pairs]), atol=ATOL, rtol=0)
    assert flash_calls.calls >= 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_against_the_reference(dtype):
    g = torch.Generator().manual_seed(3)
    Q = lib.embeddings((16, 32, 128), g, side=+1, device="cuda", dtype=dtype)
    D = lib.embeddings((8, 4, 180, 128), g, side=-1, device="cuda", dtype=dtype)
    dmask = lib.skiplist_mask((32, 180), g, device="cuda").reshape(8, 4, 180)
    got = flash_pylate.FlashColBERTScores()(Q, D, None, dmask)
    exact = reference.maxsim(Q, D.reshape(32, 180, 128), None, dmask.reshape(32, 180), masked="zero")
    torch.testing.assert_close(got.double(), exact, atol=1e-3, rtol=0)


def _tiny_bert(folder):
    """A 2-layer, 64-wide random BERT with a word-level vocabulary, saved where PyLate can load it offline."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] \
        + sorted(set(string.punctuation)) + sorted(set(lib.WORDS))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # from_pretrained on the folder reads vocab.txt the same way in transformers 4 and 5
    BertTokenizerFast.from_pretrained(str(folder), do_lower_case=True).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=256)
    BertModel(config).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def cuda_model(tmp_path_factory):
    folder = _tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    torch.manual_seed(0)
    return models.ColBERT(model_name_or_path=folder, device="cuda", document_length=96)


def _features(model, n, groups, seed):
    features = [model.tokenize(lib.sentences(n, seed, 2, 8), is_query=True)]
    features += [model.tokenize(lib.sentences(n, seed + 1 + k, 10, 60), is_query=False, pad=True)
                 for k in range(groups)]
    return [{k: v.to("cuda") for k, v in f.items()} for f in features]


def test_contrastive_losses_on_cuda(cuda_model, flash_calls):
    features = _features(cuda_model, n=8, groups=3, seed=60)
    lib.three_ways(cuda_model, lambda **kw: losses.Contrastive(model=cuda_model, **kw),
                   flash_pylate.FlashColBERTScores(), features, None, flash_calls, tolerance=1e-3)
    flash_calls.calls = 0
    lib.three_ways(cuda_model, lambda **kw: losses.CachedContrastive(model=cuda_model, mini_batch_size=4, **kw),
                   flash_pylate.FlashColBERTScores(), features, None, flash_calls, tolerance=1e-3)


def test_distillation_on_cuda(cuda_model, flash_calls):
    n, k = 4, 5
    features = [cuda_model.tokenize(lib.sentences(n, 70, 2, 8), is_query=True),
                cuda_model.tokenize(lib.sentences(n * k, 71, 10, 60), is_query=False)]
    features = [{key: v.to("cuda") for key, v in f.items()} for f in features]
    labels = torch.randn(n, k, generator=torch.Generator().manual_seed(7)).cuda()
    lib.three_ways(cuda_model, lambda **kw: losses.Distillation(model=cuda_model, **kw),
                   flash_pylate.colbert_kd_scores, features, labels, flash_calls, tolerance=1e-3)


def test_enable_with_pylate_default_backend_on_cuda(cuda_model, monkeypatch, flash_calls):
    """PyLate >= 1.5 picks its own "flash" backend on CUDA by default; after enable() flash_maxsim scores."""
    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    features = _features(cuda_model, n=4, groups=2, seed=80)
    with flash_pylate.enabled():
        value, grads = lib.run_step(cuda_model, losses.Contrastive(model=cuda_model), features)
    assert flash_calls.calls > 0 and torch.isfinite(value) and len(grads) > 10


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32], ids=["bool", "int64", "float32"])
def test_scorers_never_wait_for_the_device(mask_dtype, twice_second_without_sync):
    """colbert_scores / FlashColBERTScores with masks of any dtype enqueue their work without synchronising with
    the device (a 0/1 check of a GPU mask would), and give PyLate's numbers."""
    g = torch.Generator().manual_seed(91)
    Q = lib.embeddings((4, 32, 128), g, side=+1, device="cuda", dtype=torch.bfloat16)
    D = lib.embeddings((12, 90, 128), g, side=-1, device="cuda", dtype=torch.bfloat16)
    qmask = lib.skiplist_mask((4, 32), g, hole_rate=0.1, device="cuda").to(mask_dtype)
    dmask = lib.skiplist_mask((12, 90), g, device="cuda").to(mask_dtype)
    calls = (lambda: flash_pylate.colbert_scores(Q, D, qmask, dmask),
             lambda: flash_pylate.FlashColBERTScores()(Q, D.reshape(3, 4, 90, 128), qmask, dmask.reshape(3, 4, 90)))
    for call in calls:
        want, got = twice_second_without_sync(call)
        assert torch.equal(got, want)
    expected = lib.pylate_colbert_scores(Q.float(), D.float(), qmask, dmask)
    torch.testing.assert_close(flash_pylate.colbert_scores(Q, D, qmask, dmask), expected, atol=ATOL, rtol=0)
