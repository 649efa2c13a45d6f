"""PyLate >= 1.5.1 has its own "flash" scoring backend, which imports the PyPI project `flash-maxsim` by the
import name this package also has; with backend="auto" (PyLate's default) it takes that backend on CUDA whenever
`import flash_maxsim` works. Without enable(), PyLate must still run on its own: "auto" falls back to its next
backend with one warning instead of failing on a missing name, and backend="flash" raises an ImportError that
says what to do. On the CPU PyLate is made to take its flash backend as it would on CUDA; on CUDA it runs as is.
"""

import warnings

import pytest
import torch

pylate = pytest.importorskip("pylate")
flash_backend = pytest.importorskip("pylate.scores._flash_backend", reason="PyLate < 1.5.1 has no flash backend")

from pylate.scores import colbert as pylate_colbert  # noqa: E402

from flash_maxsim import _name_clash  # noqa: E402
from flash_maxsim.integrations import pylate as flash_pylate  # noqa: E402

import pylate_testlib as lib  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    monkeypatch.setattr(_name_clash, "_fallback_warned", False)
    # the backend after "flash" is PyLate's choice (late-interaction-kernels where installed): pin its torch path,
    # whose numbers the tests compare with
    monkeypatch.setattr(pylate_colbert, "_try_lik", lambda backend, *tensors: False)
    monkeypatch.setattr(flash_backend, "_IMPORT_OK", flash_backend._IMPORT_OK)  # restored after the test
    if request.param == "cpu":
        # PyLate's decision for CUDA tensors (its _try_flash without the device test): "import flash_maxsim"
        # works and CUDA is there, unless that record was corrected since
        monkeypatch.setattr(flash_backend, "_IMPORT_OK", True)
        monkeypatch.setattr(flash_backend, "_inputs_supported", lambda queries, documents: True)

        def try_flash_as_on_cuda(backend, *tensors):
            if backend not in ("auto", "flash"):
                return False
            if not flash_backend.is_available():
                if backend == "flash":
                    raise RuntimeError("backend='flash' requested but `flash-maxsim` is not installed")
                return False
            return True

        monkeypatch.setattr(pylate_colbert, "_try_flash", try_flash_as_on_cuda)
    else:
        assert pylate_colbert._try_flash("auto", torch.ones(1, device="cuda")), "PyLate skipped its flash backend"
    return request.param


def _inputs(device, seed=11):
    g = torch.Generator().manual_seed(seed)
    Q = lib.embeddings((3, 6, 16), g, side=+1, device=device)
    D = lib.embeddings((4, 9, 16), g, side=-1, device=device)
    return Q, D, lib.skiplist_mask((3, 6), g, device=device), lib.skiplist_mask((4, 9), g, device=device)


def _three_calls(Q, D, Q_mask, D_mask, backend):
    kd_documents = D[None].expand(Q.shape[0], *D.shape)
    kd_mask = D_mask[None].expand(Q.shape[0], *D_mask.shape)
    return (pylate_colbert.colbert_scores(Q, D, Q_mask, D_mask, backend=backend),
            pylate_colbert.colbert_scores_pairwise(Q, D[:3], backend=backend),
            pylate_colbert.colbert_kd_scores(Q, kd_documents, Q_mask, kd_mask, backend=backend))


def test_auto_falls_back_to_pylates_own_scores_with_one_warning(device):
    Q, D, Q_mask, D_mask = _inputs(device)
    want = _three_calls(Q, D, Q_mask, D_mask, backend="torch")
    with pytest.warns(UserWarning, match="enable()") as record:
        got = _three_calls(Q, D, Q_mask, D_mask, backend="auto")
        again = _three_calls(Q, D, Q_mask, D_mask, backend=None)  # PyLate's default
    assert len([w for w in record if "flash-maxsim-kernels" in str(w.message)]) == 1
    for g, a, w in zip(got, again, want):
        assert torch.equal(g, w) and torch.equal(a, w)
    # PyLate's record of its flash backend is corrected: later calls no longer try it
    assert flash_backend._IMPORT_OK is False


def test_auto_falls_back_for_training_too(device):
    Q, D, Q_mask, D_mask = _inputs(device, seed=12)
    Q, D = Q.requires_grad_(), D.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = pylate_colbert.colbert_scores(Q, D, Q_mask, D_mask)
    want = pylate_colbert.colbert_scores(Q, D, Q_mask, D_mask, backend="torch")
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(torch.autograd.grad(got.sum(), (Q, D)),
                                                 torch.autograd.grad(want.sum(), (Q, D))))


def test_backend_flash_raises_an_import_error_that_names_both_packages(device):
    Q, D, Q_mask, D_mask = _inputs(device, seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ImportError, match="flash-maxsim-kernels.*enable()") as error:
            pylate_colbert.colbert_scores(Q, D, Q_mask, D_mask, backend="flash")
    assert error.value.name == "flash_maxsim_batched"
    with pytest.raises(RuntimeError, match="not installed"):  # PyLate's own message, once its record is right
        pylate_colbert.colbert_scores(Q, D, Q_mask, D_mask, backend="flash")


def test_enabled_scores_with_flash_maxsim_and_does_not_warn(device, flash_calls):
    Q, D, Q_mask, D_mask = _inputs(device, seed=14)
    want = lib.pylate_colbert_scores(Q, D, Q_mask, D_mask)
    with flash_pylate.enabled(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pylate.scores.colbert_scores(Q, D, Q_mask, D_mask)
    assert flash_calls.calls == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
