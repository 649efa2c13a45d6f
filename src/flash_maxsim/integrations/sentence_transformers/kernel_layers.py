"""``kernel_config()``: flash_maxsim's MaxSim for one sentence-transformers (>= 6.3) model through
sentence-transformers' own kernel mechanism, nothing patched. The layers are a local `kernels` repository in
this package (``integrations/st_kernel_repo``), loaded by the `kernels` package, not imported by flash_maxsim."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .._patches import import_toolkit

if TYPE_CHECKING:
    from transformers import KernelConfig

#: The `kernels` layer repository (``torch-universal/`` holds the layers and their metadata).
KERNEL_REPOSITORY = Path(__file__).parent.parent / "st_kernel_repo"


def kernel_config() -> "KernelConfig":
    """A ``transformers.KernelConfig`` that makes a sentence-transformers (>= 6.3) ``MultiVectorEncoder`` score
    MaxSim with flash_maxsim, that model only, with nothing patched::

        model = MultiVectorEncoder("lightonai/GTE-ModernColBERT-v1", kernel_config=flash_st.kernel_config())

    Its ``similarity`` / ``similarity_pairwise``, the losses' default scoring and the evaluators then score with
    flash_maxsim; sentence-transformers still chunks and pads the inputs and calls it once per chunk (the
    ``enable()`` route packs ragged documents instead). The two targets are ``STMaxSim`` and
    ``STMaxSimPairwise``; the layers live in this package (a local `kernels` repository: no download). Needs
    the ``kernels`` package (``pip install "sentence-transformers[kernels]"``; transformers 5.25 installs it
    too)."""
    sentence_transformers = import_toolkit("sentence_transformers", "sentence-transformers", "sentence-transformers")
    from sentence_transformers.multi_vector_encoder.scoring import colbert as st_colbert

    if not hasattr(st_colbert, "_MaxSimScorer"):
        raise ImportError(f"kernel_config() needs sentence-transformers >= 6.3 (its MaxSim kernel targets); found "
                          f"{sentence_transformers.__version__}: use enable() or the drop-ins instead")
    try:
        import kernels  # noqa: F401
    except ImportError as error:
        raise ImportError('kernel_config() needs the `kernels` package: pip install "sentence-transformers[kernels]"'
                          ) from error
    from transformers import KernelConfig

    if not (KERNEL_REPOSITORY / "torch-universal" / "metadata.json").is_file():
        # `kernels` would fall back to sentence-transformers' own MaxSim without a word
        raise FileNotFoundError(f"flash_maxsim's kernel repository is missing from this install: "
                                f"{KERNEL_REPOSITORY}")
    return KernelConfig(kernel_mapping={"STMaxSim": f"{KERNEL_REPOSITORY}:MaxSim",
                                        "STMaxSimPairwise": f"{KERNEL_REPOSITORY}:MaxSimPairwise"},
                        use_local_kernel=True)
