"""flash_maxsim: IO-aware fused MaxSim (late-interaction) kernels for ColBERT / ColPali.

Importing this package changes nothing global: integrations patch toolkits only when their ``enable()`` is
called.
"""

import sys as _sys

from ._api import maxsim
from ._layout import PackedDocuments, pack
from .quantization import QuantizedDocuments, quantize
from . import reference

__version__ = "0.1.0"

__all__ = ["maxsim", "pack", "PackedDocuments", "quantize", "QuantizedDocuments", "reference", "__version__"]


# Public functions of the PyPI project `flash-maxsim` (0.3.0), which uses this same import name. PyLate >= 1.5.1
# imports some of them for its "flash" scoring backend whenever `import flash_maxsim` works; see __getattr__.
_OTHER_PROJECT_NAMES = frozenset({
    "flash_maxsim", "flash_maxsim_batched", "flash_maxsim_train", "flash_maxsim_pairs",
    "flash_maxsim_batched_train", "flash_maxsim_varlen", "pack_pairs", "flash_maxsim_packed", "pack_docs",
    "flash_maxsim_pairs_dense", "flash_maxsim_rerank", "flash_maxsim_rerank_direct", "flash_maxsim_rerank_padded",
    "flash_maxsim_int8", "flash_maxsim_int8x8", "flash_maxsim_int8_symmetric", "quantize_int8",
    "dequantize_int8", "quantize_int8_symmetric", "quantize_query_int8", "flash_maxsim_persistent",
    "flash_maxsim_topk", "flash_maxsim_qreuse", "flash_maxsim_splitk",
})


def __getattr__(name: str):
    if name in _OTHER_PROJECT_NAMES:
        caller = _sys._getframe(1).f_globals.get("__name__") or ""
        if caller == "pylate" or caller.startswith("pylate."):
            # PyLate's backend="auto" would crash on the missing name; hand it the exception it falls back on
            from .integrations.pylate import _other_project_fallback
            raise _other_project_fallback(name)
        raise AttributeError(
            f"module 'flash_maxsim' has no attribute {name!r}: {name} belongs to the PyPI project `flash-maxsim`, "
            "which uses the same import name. This `flash_maxsim` is flash-maxsim-kernels: score with "
            "flash_maxsim.maxsim (README, 'Name clash')")
    raise AttributeError(f"module 'flash_maxsim' has no attribute {name!r}")
