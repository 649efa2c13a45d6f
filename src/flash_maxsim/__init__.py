"""flash_maxsim: IO-aware fused MaxSim (late-interaction) kernels for ColBERT / ColPali.

Importing this package changes nothing global: integrations patch toolkits only when their ``enable()`` is
called.
"""

from ._api import maxsim
from ._layout import PackedDocuments, pack
from .quantization import QuantizedDocuments, quantize
from . import reference

__version__ = "0.1.0"

__all__ = ["maxsim", "pack", "PackedDocuments", "quantize", "QuantizedDocuments", "reference", "__version__"]
