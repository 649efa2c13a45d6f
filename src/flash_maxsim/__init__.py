"""flash_maxsim: IO-aware fused MaxSim (late-interaction) kernels for ColBERT / ColPali.

Importing this package changes nothing global: integrations patch toolkits only when their ``enable()`` is
called. The Triton kernels (and Triton) load on the first call that needs them; the CPU path runs without them.
"""

import sys as _sys
from typing import NoReturn as _NoReturn

from . import _name_clash, reference
from ._api import maxsim
from ._types import PackedDocuments, QuantizedDocuments
from ._layout import pack
from ._index import DocumentIndex, IndexSearchResult
from ._search import SearchResult, search
from .quantization import quantize

__version__ = "0.1.0"

__all__ = ["maxsim", "search", "SearchResult", "DocumentIndex", "IndexSearchResult", "pack", "PackedDocuments", "quantize", "QuantizedDocuments",
           "reference", "__version__"]


def __getattr__(name: str) -> _NoReturn:
    if name in _name_clash.OTHER_PROJECT_NAMES:
        # a name of the PyPI project `flash-maxsim`, which has the same import name (README, 'Name clash')
        raise _name_clash.other_project_error(name, _sys._getframe(1).f_globals.get("__name__") or "")
    raise AttributeError(f"module 'flash_maxsim' has no attribute {name!r}")
