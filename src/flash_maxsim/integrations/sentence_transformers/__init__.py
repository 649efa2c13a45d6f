"""sentence-transformers (>= 6.0) integration: ``MultiVectorEncoder`` MaxSim through flash_maxsim.

Three ways to use it (every name below is importable from this package):

- ``enable()`` (and ``disable()``, ``is_enabled()``, ``enabled()``): unchanged sentence-transformers code then
  scores with flash_maxsim: ``util.similarity.maxsim`` / ``maxsim_pairwise`` / ``mean_maxsim`` /
  ``mean_maxsim_pairwise`` and every module that imported them by name, the ColBERT scoring functions of
  ``multi_vector_encoder.scoring`` (the default ``similarity_fct`` of the four multi-vector losses up to 6.2),
  ``MultiVectorEncoder.similarity`` / ``similarity_pairwise`` (from 6.3 also when the model was built with
  ``use_kernels``: its MaxSim scorer is replaced, its other kernels are not), the private helpers through which
  6.3's losses score with the model's similarity by default (fused into one call), and through all of these
  the evaluators.
- ``kernel_config()`` (sentence-transformers >= 6.3): ``MultiVectorEncoder(..., kernel_config=kernel_config())``
  scores that model's MaxSim with flash_maxsim through sentence-transformers' own kernel mechanism, nothing
  patched (the layers are a local ``kernels`` repository in this package, ``st_kernel_repo``);
- the drop-in callables of this module, with sentence-transformers' signatures, e.g.
  ``MultiVectorMultipleNegativesRankingLoss(model, similarity_fct=colbert_scores)``: they always score with
  flash_maxsim, enabled or not.

For retrieval, ``semantic_search(query_embeddings, corpus_embeddings, top_k=10, ...)`` ranks what
``MultiVectorEncoder.encode`` returns (ragged token lists, which sentence-transformers' own
``util.semantic_search`` cannot take: it stacks the corpus into one tensor) by this MaxSim, in
``util.semantic_search``'s format, holding only a chunk of scores and the running top k.

Semantics are sentence-transformers' own (``util/similarity.py`` of 6.0.x, 6.2.0 and 6.3.0), not PyLate's:

- masked document tokens take no part in the max (``masked="exclude"``); a document with no scoreable token
  (all masked, zero tokens, or every row zero in a padded tensor without a mask) scores
  :data:`EMPTY_DOCUMENT_SCORE` (-1e9) before any length normalisation;
- a masked query token contributes 0; without a mask, padded tensors treat all-zero token rows as padding on
  both sides, and ragged lists use their lengths;
- ``length_normalize`` (MeanMaxSim) divides by the real query-token count (at least 1);
- scores are float32 and come back on the documents' device (the queries' for numpy documents); ``device``
  only chooses where the scoring runs;
- numpy arrays, a single ``[tokens, dim]`` embedding (a batch of one) and ragged lists are accepted.

What differs, by design: ragged document lists are packed (no padding) for all-pairs scoring, and nothing of
size queries x documents x tokens is ever built; ``chunk_elements`` only bounds the copy made of listed
documents (packed, or padded per chunk for pairs), padded tensors are scored in place; fp16/bf16 similarities
are computed in fp32 (sentence-transformers rounds each similarity to the input dtype before the max); float64
inputs are scored in float32 and return float32 (sentence-transformers documents float32 but returns float64
for them). Two rare inputs the fused kernels cannot express
are handed to sentence-transformers' own function, so the result stays exact: a query mask with values other
than 0/1 (sentence-transformers weights the query tokens by it), and a document mask that marks positions
beyond a listed document's own length (sentence-transformers then scores its zero padding there).

``FLASH_MAXSIM_DISABLE=1`` (or ``true``/``yes``/``on``) in the environment makes ``enable()`` a no-op with one
warning (``flash_maxsim.integrations._patches`` lists the values it takes). ``enable()`` without
sentence-transformers installed raises an ImportError naming
``pip install "flash-maxsim-kernels[sentence-transformers]"``.

The modules: ``scoring`` (the drop-ins and ``chunk_scores``), ``retrieval`` (``semantic_search``), ``patching`` (``enable()`` and the routes it
installs), ``kernel_layers`` (``kernel_config()``), ``_sides`` (sentence-transformers' input rules).
"""

from .kernel_layers import KERNEL_REPOSITORY, kernel_config
from .patching import disable, enable, enabled, is_enabled
from .retrieval import semantic_search
from .scoring import DEFAULT_CHUNK_ELEMENTS, EMPTY_DOCUMENT_SCORE, chunk_scores, colbert_kd_scores, colbert_scores, \
    colbert_scores_pairwise, maxsim, maxsim_pairwise, mean_colbert_kd_scores, mean_colbert_scores, \
    mean_colbert_scores_pairwise, mean_maxsim, mean_maxsim_pairwise

__all__ = [
    "enable", "disable", "is_enabled", "enabled", "kernel_config",
    "maxsim", "maxsim_pairwise", "mean_maxsim", "mean_maxsim_pairwise",
    "colbert_scores", "colbert_scores_pairwise", "colbert_kd_scores",
    "mean_colbert_scores", "mean_colbert_scores_pairwise", "mean_colbert_kd_scores",
    "EMPTY_DOCUMENT_SCORE", "DEFAULT_CHUNK_ELEMENTS", "KERNEL_REPOSITORY", "chunk_scores", "semantic_search",
]
