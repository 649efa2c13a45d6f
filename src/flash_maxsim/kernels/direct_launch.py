"""Kernel launches that call Triton's C launcher directly, reusing the compiled kernel of each specialisation.

``kernel[grid](*args, **meta)`` binds and specialises every argument in Python on each call: with the ~50
arguments of these kernels that is ~45 us of host time per launch (H200, Triton 3.6), more than the GPU time of a
small scoring call. The first launch of a given specialisation goes through Triton as usual and returns the
compiled kernel; later launches with the same key call that compiled kernel directly.

The key holds everything Triton specialises on: every integer and float argument, the constexpr values, and
each tensor's dtype and 16-byte alignment, plus the current device. Anything unexpected (another Triton version
whose compiled kernels cannot be called this way, the CPU interpreter) falls back to Triton's own launch path.

Two direct paths, the first one that fits the compiled kernel:
- ``_CLauncherCall``: Triton's C launcher itself, with the tensors' addresses as integers and each tensor
  descriptor encoded once per address (the launcher layouts of Triton 3.6 and of 3.7-3.9, checked when the kernel
  is first compiled). The compiled kernel's runner around it would re-read the device, stream and launch hooks,
  build launch metadata and call the hooks (~7 us of a small scoring call's host time, H200), and with a tensor
  descriptor make it and encode it again at every launch.
- ``_RunnerCall``: the compiled kernel's runner, ``compiled[grid](*args)`` (any Triton whose runner takes every
  argument in order).

Every launch also gives Triton :data:`COMPILE_OPTIONS`.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Iterator, NamedTuple, Optional

import torch

log = logging.getLogger("flash_maxsim")

#: Compile options given to Triton with every launch, instead of its defaults. FMA contraction (fp fusion) is what
#: every kernel here was written, measured and checked with; Triton 3.9 warns (once per process) where a launch
#: leaves it to the default, and 3.10 turns that default off.
COMPILE_OPTIONS = {"enable_fp_fusion": True}

_RUNNERS: dict = {}
_MAX_RUNNERS = 4096
_MAX_ENCODED = 16       # encoded descriptors kept per compiled kernel (one per documents' address)
_enabled = True


class TensorDesc(NamedTuple):
    """A tensor-descriptor argument (TMA) over ``tensors[index]``, in place of Triton's ``TensorDescriptor``: made
    into one for Triton's own launch path, and encoded once per address for the C launcher (a ``TensorDescriptor``
    made per call costs ~3.5 us of host time, and Triton's launcher encodes it again at every launch)."""
    index: int
    shape: tuple
    strides: tuple
    block_shape: tuple

    def made(self, tensors: tuple) -> Any:
        """Triton's ``TensorDescriptor`` over this launch's ``tensors``."""
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(tensors[self.index], list(self.shape), list(self.strides), list(self.block_shape))


def _tritons_scalars(tensors, scalars) -> tuple:
    """``scalars`` with each ``TensorDesc`` made into Triton's ``TensorDescriptor``."""
    if not any(isinstance(s, TensorDesc) for s in scalars):
        return scalars
    return tuple(s.made(tensors) if isinstance(s, TensorDesc) else s for s in scalars)


def _constexpr_tail(kernel, n_runtime: int, meta: dict):
    """The constexpr values in parameter order (a parameter the launch leaves out takes its default, as in
    Triton's own binding), when all constexpr parameters follow the runtime ones (as in every kernel of this
    package); None otherwise (no direct launch)."""
    params = getattr(kernel, "params", None)
    if not params or any(p.is_constexpr for p in params[:n_runtime]) \
            or not all(p.is_constexpr for p in params[n_runtime:]):
        return None
    tail = []
    for p in params[n_runtime:]:
        if p.name in meta:
            tail.append(meta[p.name])
        elif getattr(p, "has_default", False):
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


class _RunnerCall:
    """The compiled kernel's runner: every argument in order, tensors as tensors, descriptors as Triton's."""

    def __init__(self, runner, tail):
        self.runner, self.tail = runner, tail

    def __call__(self, tensors, ptrs, scalars, device):
        self.runner(*tensors, *_tritons_scalars(tensors, scalars), *self.tail)


# The two layouts of Triton's C launcher that the direct launch knows.
# Triton 3.6 (its `_BASE_ARGS_FORMAT`): grid x, y, z, stream, function, cooperative grid, PDL, global and profile
# scratch, kernel metadata, launch metadata, enter and exit hooks; the kernel's arguments follow one by one.
_C_LAUNCH_FORMAT = "iiiKKppOOOOOO"
LAYOUT_ARGUMENTS = "arguments"
# Triton 3.7, 3.8 and 3.9 (their driver.c: "iiiKKpp(iii)OOOOOOy*O"): grid x, y, z, stream, function, cooperative
# grid, PDL, kernel metadata, launch metadata, enter and exit hooks, global and profile scratch, the arguments'
# annotations and C signature, then the kernel's arguments as one tuple, constexprs included (the annotations skip
# them). That format is C code, not readable at run time, hence the list of versions whose source was read.
LAYOUT_SEQUENCE = "sequence"
_SEQUENCE_LAYOUT_VERSIONS = ("3.7.", "3.8.", "3.9.")


def _launcher_layout(triton_version: str, base_args_format) -> "str | None":
    """The C launcher layout of this Triton, or None where it is neither known layout (no direct launch)."""
    if base_args_format is not None:
        return LAYOUT_ARGUMENTS if base_args_format == _C_LAUNCH_FORMAT else None
    return LAYOUT_SEQUENCE if triton_version.startswith(_SEQUENCE_LAYOUT_VERSIONS) else None


def _triton_launch_parts():
    """What the direct C launch needs from this Triton: (its C launcher's layout, ``encode(descriptor, metadata)``
    giving a tensor descriptor's encoded arguments, the runtime knobs holding the launch hooks, the current-stream
    getter); None without Triton's CUDA backend."""
    try:
        import inspect

        import triton
        from triton import knobs
        from triton.backends.nvidia import driver as cuda_driver
        from triton.runtime import driver
        layout = _launcher_layout(triton.__version__, getattr(cuda_driver, "_BASE_ARGS_FORMAT", None))
        encode = cuda_driver.make_tensordesc_arg
        if len(inspect.signature(encode).parameters) == 3:     # 3.8+: a third argument, unused for CUDA
            encode = (lambda make: lambda desc, meta: make(desc, meta, None))(encode)
        return layout, encode, knobs.runtime, driver.active.get_current_stream
    except Exception as exc:
        log.debug("flash_maxsim: no direct C launches (%s)", exc)
        return None


class _CLauncherCall:
    """Triton's C launcher called directly (``compiled.run.launch``, or the C function inside its tensor-descriptor
    wrapper), when the compiled kernel is laid out as one of the known layouts has it; see ``from_compiled``.
    Launch hooks (a profiler's) send the call through the runner instead."""

    def __init__(self, c_launch, compiled, runner, grid, tail, encode, desc_at, desc_meta, runtime, get_stream,
                 layout):
        self.c_launch, self.tail = c_launch, tail
        self.sequence = layout == LAYOUT_SEQUENCE
        # the sequence layout's annotations and C signature of the arguments (fixed per compiled kernel)
        self.annotations = getattr(compiled.run, "arg_annotations", None)
        self.signature = getattr(compiled.run, "kernel_signature", None)
        self.through_runner = _RunnerCall(runner, tail)     # while a launch hook is set
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata
        launcher = compiled.run
        self.cooperative, self.pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        self.encode, self.desc_meta = encode, desc_meta
        self.desc_at = desc_at       # positions of the descriptors among the scalars (fixed by the key)
        self.runtime, self.get_stream = runtime, get_stream
        self.encoded: dict = {}      # descriptors' tensors' addresses -> the scalars with them encoded

    @classmethod
    def from_compiled(cls, compiled, runner, grid, tail, tensors, scalars):
        """The direct call, or None where the compiled kernel is not laid out as this call expects: a known C
        launcher layout, no scratch memory, tensor descriptors (if any) that Triton lowered to TMA descriptors
        (``tensordesc_meta``), and in the sequence layout one annotation per argument this call passes."""
        parts = _triton_launch_parts()
        if parts is None or parts[0] is None:
            return None
        layout, encode, runtime, get_stream = parts
        launcher = compiled.run
        if launcher.global_scratch_size or launcher.profile_scratch_size or getattr(launcher, "gsan_enabled", False):
            return None
        c_launch = launcher.launch
        code = getattr(c_launch, "__code__", None)
        if code is not None:
            # Triton's tensor-descriptor wrapper (a Python closure that encodes descriptors): the C function inside
            if "launcher" not in code.co_freevars:
                return None
            c_launch = c_launch.__closure__[code.co_freevars.index("launcher")].cell_contents
            if getattr(c_launch, "__code__", None) is not None:
                return None
        desc_at = tuple(i for i, s in enumerate(scalars) if isinstance(s, TensorDesc))
        desc_meta = getattr(compiled.metadata, "tensordesc_meta", None)
        if desc_at and (not desc_meta or len(desc_meta) != len(desc_at) or any(m is None for m in desc_meta)):
            return None
        if layout == LAYOUT_SEQUENCE:
            # Triton's C code reads one argument per annotation without counting them: check the count once.
            # A descriptor is encoded as the TMA descriptor, its shape and its strides.
            annotations = getattr(launcher, "arg_annotations", None)
            passed = len(tensors) + len(tail) + sum(1 + 2 * len(s.shape) if isinstance(s, TensorDesc) else 1
                                                    for s in scalars)
            if annotations is None or getattr(launcher, "kernel_signature", None) is None \
                    or len(annotations) != passed:
                return None
        return cls(c_launch, compiled, runner, grid, tail, encode, desc_at, desc_meta, runtime, get_stream, layout)

    def _hooks_idle(self) -> bool:
        for chain in (self.runtime.launch_enter_hook, self.runtime.launch_exit_hook):
            # Triton 3.6-3.9's hook chains (never None); a hook set some other way counts as active
            if chain is not None and getattr(chain, "calls", True):
                return False
        return True

    def _with_encoded(self, tensors, ptrs, scalars) -> tuple:
        """``scalars`` with each descriptor replaced by its encoded arguments (the 128-byte TMA descriptor, its
        shape and strides), encoded once per address of the tensors it reads: the key fixes everything else in
        ``scalars``, so the whole tuple is kept per address."""
        if not self.desc_at:
            return scalars
        key = tuple(ptrs[scalars[i].index] for i in self.desc_at)
        out = self.encoded.get(key)
        if out is None:
            out = list(scalars)
            for k, i in reversed(list(enumerate(self.desc_at))):
                s = scalars[i]
                # the encoded arguments hold the address, not the tensor (a cached tensor would be kept alive)
                out[i:i + 1] = [ptrs[s.index] if a is tensors[s.index] else a
                                for a in self.encode(s.made(tensors), self.desc_meta[k])]
            if len(self.encoded) >= _MAX_ENCODED:
                self.encoded.clear()
            out = self.encoded[key] = tuple(out)
        return out

    def __call__(self, tensors, ptrs, scalars, device):
        if not self._hooks_idle():
            self.through_runner(tensors, ptrs, scalars, device)
            return
        if self.sequence:
            self.c_launch(*self.grid, self.get_stream(device), self.function, self.cooperative, self.pdl,
                          self.packed_metadata, None, None, None, None, None, self.annotations, self.signature,
                          (*ptrs, *self._with_encoded(tensors, ptrs, scalars), *self.tail))
            return
        self.c_launch(*self.grid, self.get_stream(device), self.function, self.cooperative, self.pdl, None, None,
                      self.packed_metadata, None, None, None, *ptrs, *self._with_encoded(tensors, ptrs, scalars),
                      *self.tail)


def launch(kernel: Any, grid: tuple, tensors: tuple, scalars: tuple, meta: dict, meta_key: Optional[Hashable] = None,
           plan: Optional[object] = None) -> None:
    """``kernel[grid](*tensors, *scalars, **meta)``, with the binding cost paid once per specialisation.
    ``scalars`` may hold ``TensorDesc`` arguments. ``meta_key`` (optional) is a hashable stand-in for ``meta``,
    precomputed by callers that reuse one. ``plan`` (optional) is an object whose identity fixes ``grid``,
    ``scalars``, ``meta`` and the tensors' dtypes (a cached launch plan): it stands in for all of them in the key,
    which then hashes a few objects instead of ~60 values (~1.5 us of a small scoring call's host time); the key
    holds the plan, so its identity is never reused."""
    global _enabled
    if not _enabled or not tensors[0].is_cuda:
        kernel[grid](*tensors, *_tritons_scalars(tensors, scalars), **meta, **COMPILE_OPTIONS)
        return
    ptrs = [t.data_ptr() for t in tensors]
    device = torch.cuda.current_device()
    if plan is not None:
        aligned = 0
        for p in ptrs:
            aligned |= p
        # every pointer 16-byte aligned (the usual case) in one test; else each one's alignment
        key = (kernel, plan, True if (aligned & 15) == 0 else tuple(p & 15 for p in ptrs), device)
    else:
        key = (kernel, grid, scalars, meta_key if meta_key is not None else tuple(meta.items()),
               tuple((t.dtype, p & 15) for t, p in zip(tensors, ptrs)), device)
    entry = _RUNNERS.get(key)
    if entry is not None:
        try:
            entry(tensors, ptrs, scalars, device)
            return
        except Exception as exc:   # a compiled kernel whose runner takes other arguments: Triton's path from now on
            log.debug("flash_maxsim: direct kernel launch failed (%s); using Triton's launch path", exc)
            _enabled = False
            _RUNNERS.clear()
    compiled = kernel[grid](*tensors, *_tritons_scalars(tensors, scalars), **meta, **COMPILE_OPTIONS)
    tail = _constexpr_tail(kernel, len(tensors) + len(scalars), meta)
    if tail is None:
        return
    try:
        # CompiledKernel's launcher reads three grid dimensions
        runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]
    except Exception as exc:  # another Triton's CompiledKernel: keep Triton's launch path
        log.debug("flash_maxsim: direct kernel launches unavailable (%s); using Triton's launch path", exc)
        _enabled = False
        return
    entry = None
    try:
        entry = _CLauncherCall.from_compiled(compiled, runner, grid, tail, tensors, scalars)
    except Exception as exc:   # a compiled kernel laid out otherwise: its runner
        log.debug("flash_maxsim: Triton's C launcher not callable directly (%s); using the compiled runner", exc)
    if len(_RUNNERS) >= _MAX_RUNNERS:
        _RUNNERS.clear()
    _RUNNERS[key] = entry if entry is not None else _RunnerCall(runner, tail)


def compiled_kernels(kernel: Any) -> Iterator[Any]:
    """Every ``CompiledKernel`` Triton holds for ``kernel`` (a ``JITFunction``), on every device, compiled so far:
    for tools that read their code, registers or metadata. Triton keeps them in
    ``kernel.device_caches[device][0]`` (3.2-3.9); anything else holds none."""
    for cache in getattr(kernel, "device_caches", {}).values():
        yield from cache[0].values()
