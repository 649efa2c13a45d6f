"""flash_maxsim's MaxSim as a `kernels` layer repository: the ``STMaxSim`` and ``STMaxSimPairwise`` targets of
sentence-transformers >= 6.3 (``flash_maxsim.integrations.sentence_transformers.kernel_config()``).

The `kernels` package loads this file and binds each layer's ``forward`` to sentence-transformers' own module;
its layers may hold nothing but ``forward``, so the work is in ``chunk_scores``. metadata.json records this
file's digest: regenerate it after an edit (tests/integrations/sentence_transformers/test_st_kernel.py says how).
"""

import types

import torch

from flash_maxsim.integrations.sentence_transformers import chunk_scores


class MaxSim(torch.nn.Module):
    def forward(self, a, b, a_mask, b_mask):
        return chunk_scores(a, b, a_mask, b_mask)


class MaxSimPairwise(torch.nn.Module):
    def forward(self, a, b, a_mask, b_mask):
        return chunk_scores(a, b, a_mask, b_mask, pairs=True)


layers = types.SimpleNamespace(MaxSim=MaxSim, MaxSimPairwise=MaxSimPairwise)
