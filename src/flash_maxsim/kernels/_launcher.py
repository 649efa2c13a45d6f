"""Kernel launches without Triton's per-call argument binding.

``kernel[grid](*args, **meta)`` binds and specialises every argument in Python on each call: with the ~50
arguments of these kernels that is ~45 us of host time per launch on the H200 machine (measured, see
docs/perf-notes.md, run 6), more than the GPU time of a small scoring call. The first launch of a given
specialisation goes through Triton as usual and returns the compiled kernel; later launches with the same key
call that compiled kernel directly.

The key holds everything Triton specialises on: every integer and float argument, the constexpr values, and
each tensor's dtype and 16-byte alignment, plus the current device. Anything unexpected (another Triton version
whose compiled kernels cannot be called this way, the CPU interpreter) falls back to Triton's own launch path.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("flash_maxsim")

_RUNNERS: dict = {}
_MAX_RUNNERS = 4096
_enabled = True


def _constexpr_tail(kernel, n_runtime: int, meta: dict):
    """The constexpr values in parameter order, when all constexpr parameters follow the runtime ones (as in
    every kernel of this package); None otherwise (no direct launch)."""
    params = getattr(kernel, "params", None)
    if not params or any(p.is_constexpr for p in params[:n_runtime]) \
            or not all(p.is_constexpr for p in params[n_runtime:]):
        return None
    try:
        return tuple(meta[p.name] for p in params[n_runtime:])
    except KeyError:
        return None


def launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, meta: dict, meta_key=None, plan=None) -> None:
    """``kernel[grid](*tensors, *scalars, **meta)``, with the binding cost paid once per specialisation.
    ``meta_key`` (optional) is a hashable stand-in for ``meta``, precomputed by callers that reuse one. ``plan``
    (optional) is an object whose identity fixes ``grid``, ``scalars``, ``meta`` and the tensors' dtypes (a cached
    launch plan): it stands in for all of them in the key, which then hashes a few objects instead of ~60 values
    (~1.5 us of a small scoring call's host time); the key holds the plan, so its identity is never reused. With a
    plan the scalars are not in the key, so they may include values that are not hashable: a tensor descriptor,
    which Triton's launcher encodes for the kernel at every launch."""
    global _enabled
    if not _enabled or not tensors[0].is_cuda:
        kernel[grid](*tensors, *scalars, **meta)
        return
    if plan is not None:
        ptrs = 0
        for t in tensors:
            ptrs |= t.data_ptr()
        # every pointer 16-byte aligned (the usual case) in one test; else each one's alignment
        key = (kernel, plan, True if (ptrs & 15) == 0 else tuple(t.data_ptr() & 15 for t in tensors),
               torch.cuda.current_device())
    else:
        key = (kernel, grid, scalars, meta_key if meta_key is not None else tuple(meta.items()),
               tuple((t.dtype, t.data_ptr() & 15) for t in tensors), torch.cuda.current_device())
    entry = _RUNNERS.get(key)
    if entry is not None:
        runner, tail = entry
        try:
            runner(*tensors, *scalars, *tail)
            return
        except Exception as exc:   # a compiled kernel whose runner takes other arguments: Triton's path from now on
            log.debug("flash_maxsim: direct kernel launch failed (%s); using Triton's launch path", exc)
            _enabled = False
            _RUNNERS.clear()
    compiled = kernel[grid](*tensors, *scalars, **meta)
    tail = _constexpr_tail(kernel, len(tensors) + len(scalars), meta)
    try:
        # CompiledKernel's launcher reads three grid dimensions
        runner = compiled[tuple(grid) + (1,) * (3 - len(grid))] if tail is not None else None
    except Exception as exc:  # another Triton's CompiledKernel: keep Triton's launch path
        log.debug("flash_maxsim: direct kernel launches unavailable (%s); using Triton's launch path", exc)
        _enabled = False
        return
    if runner is not None:
        if len(_RUNNERS) >= _MAX_RUNNERS:
            _RUNNERS.clear()
        _RUNNERS[key] = (runner, tail)
