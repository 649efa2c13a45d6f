"""One PyLate training step with and without flash_maxsim: time and peak GPU memory (docs/recipes/pylate.md's table).

    python benchmarks/pylate_step.py OUT.json [--queries 64] [--docs-per-query 8] [--document-length 180]
                                             [--model PATH] [--amp bf16 fp32] [--repeats 10]

For each loss (Contrastive, CachedContrastive, Distillation) and autocast setting it measures
- "step": model forward + loss + backward of a ColBERT (by default a randomly initialised BERT shaped like
  all-MiniLM-L6-v2 — 6 layers, 384 wide — with a word-level vocabulary, so that no download is needed;
  ``--model`` takes a real model folder), on synthetic text with punctuation (skiplist holes) padded to
  ``--document-length`` tokens;
- "scoring": the loss's scoring part alone (score_metric + loss + backward to the embeddings), which is what
  flash_maxsim replaces;
with PyLate's own torch path (``PYLATE_SCORES_BACKEND=torch``) and with ``flash_maxsim.integrations.pylate``
enabled. Median wall time over ``--repeats`` (CUDA-synchronised), peak memory above what was allocated
before. The loss values of both paths are printed side by side as a check. Needs CUDA and PyLate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PYLATE_SCORES_BACKEND"] = "torch"  # PyLate's own torch path is the baseline

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import flash_maxsim  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

WORDS = [f"w{i}" for i in range(3000)]


def build_random_model_folder(folder: Path, layers: int, hidden: int) -> str:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] \
        + sorted(set(string.punctuation)) + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # from_pretrained on the folder reads vocab.txt the same way in transformers 4 and 5
    BertTokenizerFast.from_pretrained(str(folder), do_lower_case=True).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=max(1, hidden // 32), intermediate_size=4 * hidden,
                        max_position_embeddings=512)
    BertModel(config).save_pretrained(str(folder))
    return str(folder)


def texts(count: int, words: int, rng: random.Random, vocabulary) -> list:
    out = []
    for _ in range(count):
        n = rng.randint(int(0.7 * words), words)
        tokens = []
        for _ in range(n):
            tokens.append(rng.choice(vocabulary))
            if rng.random() < 0.12:
                tokens.append(rng.choice(".,;:!?()"))
        out.append(" ".join(tokens))
    return out


def to_device(features, device):
    return [{k: v.to(device) for k, v in f.items()} for f in features]


def measure(fn, repeats: int, device: str):
    """Median seconds and peak bytes above the memory allocated before the first call (CUDA only)."""
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        value = fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
    return statistics.median(times), peak, value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON output path")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--docs-per-query", type=int, default=8, help="1 positive + negatives")
    parser.add_argument("--document-length", type=int, default=180)
    parser.add_argument("--query-length", type=int, default=32)
    parser.add_argument("--model", help="a model folder (default: random MiniLM-shaped BERT)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--mini-batch-size", type=int, default=32, help="CachedContrastive's mini_batch_size")
    parser.add_argument("--amp", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--losses", nargs="+", default=["Contrastive", "CachedContrastive", "Distillation"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda (the table); cpu only to try the script")
    args = parser.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu to try the script)", file=sys.stderr)
        return 2

    import pylate
    from pylate import losses, models

    tmp = tempfile.mkdtemp(prefix="pylate-step-")
    model_path = args.model or build_random_model_folder(Path(tmp), args.layers, args.hidden)
    torch.manual_seed(0)
    model = models.ColBERT(model_name_or_path=model_path, device=device, query_length=args.query_length,
                           document_length=args.document_length)
    model.train()
    vocabulary = WORDS if args.model is None else "the of and a to in is was for on with as by at from".split()
    rng = random.Random(0)
    n, k = args.queries, args.docs_per_query
    query_features = model.tokenize(texts(n, 12, rng, vocabulary), is_query=True)
    group_features = [model.tokenize(texts(n, args.document_length, rng, vocabulary), is_query=False, pad=True)
                      for _ in range(k)]
    contrastive_features = to_device([query_features] + group_features, device)
    kd_features = to_device([query_features, model.tokenize(texts(n * k, args.document_length, rng, vocabulary),
                                                            is_query=False, pad=True)], device)
    labels = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(device)
    doc_tokens = float(contrastive_features[1]["attention_mask"].float().sum(1).mean())

    def make_loss(name):
        if name == "Contrastive":
            return losses.Contrastive(model=model), contrastive_features, None
        if name == "CachedContrastive":
            return losses.CachedContrastive(model=model, mini_batch_size=args.mini_batch_size), contrastive_features, None
        if name == "Distillation":
            return losses.Distillation(model=model), kd_features, labels
        raise ValueError(f"unknown loss {name!r}")

    def embed(features):
        with torch.no_grad():
            return [torch.nn.functional.normalize(model(f)["token_embeddings"], p=2, dim=-1) for f in features]

    rows = []
    for amp in args.amp:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[amp]
        device_type = torch.device(device).type
        autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype \
            else (lambda: torch.autocast(device_type, enabled=False))
        for name in args.losses:
            for mode in ("pylate", "flash_maxsim"):
                if mode == "flash_maxsim":
                    flash_pylate.enable()
                loss, features, loss_labels = make_loss(name)

                def step():
                    model.zero_grad(set_to_none=True)
                    torch.manual_seed(0)  # same dropout draws in both modes: the loss values are comparable
                    with autocast():
                        value = loss(features, loss_labels)
                    value.backward()
                    return value.item()

                try:
                    step_s, step_bytes, step_value = measure(step, args.repeats, device)

                    # the scoring part alone, on embeddings computed once
                    with autocast():
                        embeddings = embed(features)
                    masks = losses.contrastive.extract_skiplist_mask(features, model.skiplist)

                    def scoring():
                        leaves = [e.detach().requires_grad_(True) for e in embeddings]
                        with autocast():
                            if name == "Distillation":
                                docs = leaves[1].view(n, -1, *leaves[1].shape[1:])
                                scores = loss.score_metric(leaves[0], docs, None, masks[1].view(n, -1, masks[1].shape[-1]))
                                value = torch.nn.functional.kl_div(torch.log_softmax(scores, -1),
                                                                   torch.log_softmax(loss_labels, -1), log_target=True,
                                                                   reduction="batchmean")
                            else:
                                docs = torch.stack(leaves[1:], dim=1)
                                dmask = torch.stack(masks[1:], dim=1)
                                metric = loss.score_metric
                                if docs.dim() == 4 and not hasattr(pylate.scores, "ColBERTScores"):
                                    scores = torch.cat([metric(leaves[0], docs[:, j], None, dmask[:, j]) for j in range(k)], 1)
                                else:
                                    scores = metric(leaves[0], docs, None, dmask)
                                value = torch.nn.functional.cross_entropy(scores.float(),
                                                                          torch.arange(n, device=device) * k)
                        value.backward()
                        return value.item()

                    score_s, score_bytes, score_value = measure(scoring, args.repeats, device)
                    flash_pylate.disable()
                    embeddings = None  # frees them before the next configuration
                    rows.append({"loss": name, "amp": amp, "mode": mode, "step_ms": 1e3 * step_s,
                                 "step_peak_mib": step_bytes / 2**20, "step_loss": step_value,
                                 "scoring_ms": 1e3 * score_s, "scoring_peak_mib": score_bytes / 2**20,
                                 "scoring_loss": score_value})
                    print(json.dumps(rows[-1]), file=sys.stderr)
                except Exception as exc:  # e.g. PyLate's own CachedContrastive under autocast: recorded, not fatal
                    flash_pylate.disable()
                    rows.append({"loss": name, "amp": amp, "mode": mode, "error": f"{type(exc).__name__}: {exc}"})
                    print(json.dumps(rows[-1]), file=sys.stderr)
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()

    report = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "torch": torch.__version__, "pylate": pylate.__version__,
              "flash_maxsim": flash_maxsim.__version__, "queries": n, "docs_per_query": k,
              "document_length": args.document_length, "mean_document_tokens": doc_tokens,
              "query_length": args.query_length, "model": args.model or f"random BERT {args.layers}x{args.hidden}",
              "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))

    print(f"{report['device']}, {n} queries x {k} documents (Ld={args.document_length}, mean {doc_tokens:.0f} real "
          f"tokens), Lq={args.query_length}, model {report['model']}")
    print("| loss | amp | step ms (PyLate -> flash) | step peak MiB | scoring ms | scoring peak MiB | loss PyLate / flash |")
    print("|---|---|---|---|---|---|---|")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        if "error" in a or "error" in b:
            print(f"| {a['loss']} | {a['amp']} | error: {a.get('error') or b.get('error')} | | | | |")
            continue
        print(f"| {a['loss']} | {a['amp']} | {a['step_ms']:.1f} -> {b['step_ms']:.1f} | "
              f"{a['step_peak_mib']:.0f} -> {b['step_peak_mib']:.0f} | {a['scoring_ms']:.2f} -> {b['scoring_ms']:.2f} | "
              f"{a['scoring_peak_mib']:.0f} -> {b['scoring_peak_mib']:.0f} | {a['step_loss']:.5f} / {b['step_loss']:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
