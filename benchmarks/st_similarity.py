"""sentence-transformers MultiVectorEncoder with and without ``flash_maxsim.integrations.sentence_transformers``.

Measures on a CUDA device, each case first with sentence-transformers' own scoring, then after ``enable()``:

1. ``model.similarity(query, documents)``: 1 query (32 tokens) x 20,000 documents (32..300 tokens, mean ~166,
   dim 128), as the ragged list ``encode_document`` returns (fp32 and bf16) and as a padded tensor with its mask;
2. one training step (``MultiVectorMultipleNegativesRankingLoss``: forward, backward, AdamW step), with in-batch
   negatives over a positive and a hard-negative column, at two batch sizes.

The model is a small randomly initialised BERT (4 layers, 256 wide, 4 heads, a 2,048-word vocabulary) with
MultiVectorEncoder's 128-d projection, built offline so that nothing is downloaded. A small encoder makes the
MaxSim part of a training step larger than it would be with a big one.
The document embeddings of case 1 are random unit vectors (scoring cost does not depend on the values).

Every case checks, in the same run, that both paths give the same scores / loss. Times are medians of
``triton.testing.do_bench`` (similarity) or of CUDA-synchronised steps (training); peak memory is what the call
allocated beyond what was allocated before it.

    python benchmarks/st_similarity.py st_similarity.json [--documents 20000] [--steps 10]

Prints a markdown table; writes the numbers as JSON to the path given. ``--device cpu`` (with small sizes) only
checks that the script runs: CPU times are wall-clock medians and memory is not measured there.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # the working tree's flash_maxsim

import torch  # noqa: E402

DEVICE = torch.device("cuda")


def build_encoder(directory: str, vocabulary_size: int = 2048, hidden: int = 256, layers: int = 4):
    from sentence_transformers import MultiVectorEncoder
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = [f"w{i}" for i in range(vocabulary_size)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(string.punctuation) + words
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=4, intermediate_size=4 * hidden, max_position_embeddings=512)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    return MultiVectorEncoder(directory, device=str(DEVICE)), words


def synchronize():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn) -> float:
    if DEVICE.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=50, rep=400, return_mode="median")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[2]


def peak_bytes(fn) -> int:
    if DEVICE.type != "cuda":
        fn()
        return -1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return int(peak)


def similarity_cases(model, num_documents: int):
    from flash_maxsim.integrations import sentence_transformers as fst

    g = torch.Generator(device=DEVICE).manual_seed(0)
    lengths = torch.randint(32, 301, (num_documents,), generator=g, device=DEVICE).tolist()
    unit = lambda *shape: torch.nn.functional.normalize(  # noqa: E731
        torch.randn(*shape, generator=g, device=DEVICE), dim=-1)
    query = [unit(32, 128)]
    documents = [unit(n, 128) for n in lengths]
    padded = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
    mask = torch.arange(padded.shape[1], device=DEVICE)[None] < torch.tensor(lengths, device=DEVICE)[:, None]
    inputs = {
        "list fp32": (query, documents, {}),
        "list bf16": ([q.bfloat16() for q in query], [d.bfloat16() for d in documents], {}),
        "padded+mask fp32": (torch.stack(query), padded, {"b_mask": mask}),
    }
    rows = []
    for name, (q, d, kwargs) in inputs.items():
        run = lambda: model.similarity(q, d, **kwargs)  # noqa: E731
        fst.disable()
        reference = run()
        base_ms, base_mem = bench_ms(run), peak_bytes(run)
        with fst.enabled():
            flash = run()
            flash_ms, flash_mem = bench_ms(run), peak_bytes(run)
        if "bf16" in name:
            # flash_maxsim multiplies in fp32: compare with sentence-transformers on the fp32 upcast
            fst.disable()
            reference = model.similarity([x.float() for x in q], [x.float() for x in d], **kwargs)
        max_abs = (flash - reference).abs().max().item()
        if not torch.allclose(flash, reference, rtol=1e-4, atol=1e-3):
            raise AssertionError(f"similarity {name}: scores differ (max |diff| {max_abs})")
        rows.append({"case": f"model.similarity 1 x {num_documents} ({name})", "st_ms": base_ms, "flash_ms": flash_ms,
                     "st_peak_bytes": base_mem, "flash_peak_bytes": flash_mem, "max_abs_diff": max_abs})
        del reference, flash
        torch.cuda.empty_cache()
    return rows


def training_cases(model, words, batch_sizes, steps: int):
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    from flash_maxsim.integrations import sentence_transformers as fst

    rng = torch.Generator().manual_seed(1)

    def texts(count, length):
        ids = torch.randint(0, len(words), (count, length), generator=rng).tolist()
        return [" ".join(words[i] for i in row) for row in ids]

    def features(batch, task):
        out = model.preprocess(batch, task=task)
        out = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        out["task"] = task
        return out

    rows = []
    model.train()
    for batch_size in batch_sizes:
        columns = [texts(batch_size, 30), texts(batch_size, 178), texts(batch_size, 178)]   # 32 / 180 tokens
        results = {}
        for label in ("st", "flash"):
            if label == "flash":
                fst.enable()
            loss_fn = MultiVectorMultipleNegativesRankingLoss(model)
            # the same starting weights for both runs
            state = {k: v.clone() for k, v in model.state_dict().items()}
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step():
                optimizer.zero_grad(set_to_none=True)
                inputs = [features(c, "query" if i == 0 else "document") for i, c in enumerate(columns)]
                loss = loss_fn(inputs, None)
                loss.backward()
                optimizer.step()
                return loss.detach()

            torch.manual_seed(2)
            first_loss = step().item()
            for _ in range(2):
                step()
            times = []
            for _ in range(steps):
                synchronize()
                start = time.perf_counter()
                step()
                synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            memory = peak_bytes(step)
            model.load_state_dict(state)
            fst.disable()
            results[label] = (sorted(times)[len(times) // 2], memory, first_loss)
        (st_ms, st_mem, st_loss), (fl_ms, fl_mem, fl_loss) = results["st"], results["flash"]
        if abs(st_loss - fl_loss) > 1e-4 * max(1.0, abs(st_loss)):
            raise AssertionError(f"training step batch {batch_size}: losses differ ({st_loss} vs {fl_loss})")
        rows.append({"case": f"MNRL training step, batch {batch_size} (q 32 tok, 2 x {batch_size} docs of 180 tok)",
                     "st_ms": st_ms, "flash_ms": fl_ms, "st_peak_bytes": st_mem, "flash_peak_bytes": fl_mem,
                     "max_abs_diff": abs(st_loss - fl_loss)})
    model.eval()
    return rows


def markdown(rows) -> str:
    lines = ["| case | sentence-transformers | + flash_maxsim | speed-up | peak memory ST | peak memory flash |",
             "|---|---:|---:|---:|---:|---:|"]
    mib = lambda b: f"{b / 2**20:.0f} MiB" if b >= 0 else "n/a"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['case']} | {r['st_ms']:.2f} ms | {r['flash_ms']:.2f} ms "
                     f"| {r['st_ms'] / r['flash_ms']:.1f}x | {mib(r['st_peak_bytes'])} "
                     f"| {mib(r['flash_peak_bytes'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", help="where to write the results as JSON")
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    import sentence_transformers
    import triton

    with tempfile.TemporaryDirectory() as directory:
        model, words = build_encoder(directory)
        model.eval()
        rows = similarity_cases(model, args.documents)
        rows += training_cases(model, words, args.batch_sizes, args.steps)
    environment = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__,
                   "sentence_transformers": sentence_transformers.__version__,
                   "float32_matmul_precision": torch.get_float32_matmul_precision()}
    print(markdown(rows))
    print()
    print(", ".join(f"{k} {v}" for k, v in environment.items()))
    with open(args.json_path, "w") as f:
        json.dump({"environment": environment, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
