"""What a CUDA graph would get wrong about a body, found by running it eagerly (on CPU too).

A graph records a body's kernels once, with their host-side arguments and buffer addresses,
and replays them unchanged. So a body is capturable only if, run twice with its state moved
on in between (another position, other tokens), it issues the same ops with the same shapes,
strides, scalars and external buffers; and if it never reads a device value on the host
(`.item()`, `bool(t)`, a tensor slice bound, `nonzero`, a boolean mask) nor makes a tensor
without a device (on CUDA: a host tensor mixed into device ops). `hazards` checks both.

It sees only the code that runs where it runs: on CPU the CUDA-only branches (Triton
attention, fused kernels) are not covered; tests/test_capture_check.py also runs it on CUDA.
"""
from __future__ import annotations

import traceback
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
# ops that read device memory on the host, or size their output from it (sync inside capture)
_SYNC_OPS = frozenset((_aten._local_scalar_dense.default, _aten.nonzero.default,
                       _aten.masked_select.default, _aten._unique2.default,
                       _aten.unique_consecutive.default, _aten.unique_dim.default))
_FACTORIES = frozenset((torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand,
                        torch.randn, torch.randint, torch.linspace, torch.eye))
_HOST = frozenset((torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor, torch.as_tensor,
                   torch.Tensor.cpu, torch.Tensor.cuda))


def _where() -> str:
    """The innermost frame outside torch and this file: the line that issued the op."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in fr.filename and fr.filename != __file__:
            return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}: {(fr.line or '').strip()}"
    return "?"


class _HostMode(TorchFunctionMode):
    """Python-level hazards: host copies and tensors made without a device."""

    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST:
            self.found.append(f"host copy {func.__name__}() at {_where()}")
        elif func in _FACTORIES and kwargs.get("device") is None:
            self.found.append(f"{func.__name__}() without device= at {_where()}")
        elif func is torch.Tensor.to and any(isinstance(x, (str, torch.device))
                                             for x in (*args[1:], *kwargs.values())):
            self.found.append(f"to(device) at {_where()}")
        return func(*args, **kwargs)


class _TraceMode(TorchDispatchMode):
    """Every aten op as what a graph freezes: name, scalars, tensor metadata, and for tensors
    made before the body (weights, arena, io buffers) which storage they are."""

    def __init__(self, found: list):
        super().__init__()
        self.found, self.trace, self.made = found, [], {}

    def _desc(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        ptr = x.untyped_storage().data_ptr()
        origin = (f"made by op {self.made[ptr]}" if ptr in self.made else
                  f"external buffer at {ptr:#x}")
        return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), origin)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS or (func is _aten.repeat_interleave.Tensor
                                 and kwargs.get("output_size") is None):
            self.found.append(f"host sync {func} at {_where()}")
        if func.overloadpacket is _aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in (args[1] or []) if i is not None):
            self.found.append(f"boolean-mask index (host sync) at {_where()}")
        leaves = tree_leaves((args, kwargs))
        self.trace.append((str(func), [self._desc(x) for x in leaves], _where()))
        out = func(*args, **kwargs)
        in_ptrs = {x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor)}
        for y in tree_leaves(out):
            if isinstance(y, torch.Tensor) and y.untyped_storage().data_ptr() not in in_ptrs:
                self.made[y.untyped_storage().data_ptr()] = len(self.trace) - 1
        return out


def _run(body: Callable) -> tuple[list, list]:
    found: list = []
    trace = _TraceMode(found)
    with torch.no_grad(), _HostMode(found), trace:
        body()
    return found, trace.trace


def hazards(body: Callable, between: Callable[[], None]) -> list[str]:
    """Run body, then between() (move the state on: a step, other inputs), then body again;
    return what its CUDA graph would get wrong (empty: capturable, as far as runs here)."""
    found, first = _run(body)
    between()
    found2, second = _run(body)
    out = list(dict.fromkeys(found + found2))
    if len(first) != len(second):
        out.append(f"the two runs issued {len(first)} and {len(second)} ops: the body's work "
                   f"depends on host state")
    for i, ((f1, a1, at), (f2, a2, _)) in enumerate(zip(first, second)):
        if f1 != f2 or a1 != a2:
            out.append(f"op {i} {f1} at {at} differs between the runs, so a graph would replay "
                       f"the first run's: {_first_difference(a1, a2)} (second run: {f2})")
            break
    return out


def _first_difference(a1: list, a2: list) -> str:
    if len(a1) != len(a2):
        return f"{len(a1)} vs {len(a2)} arguments"
    for j, (x, y) in enumerate(zip(a1, a2)):
        if x != y:
            return f"argument {j}: {x!r} vs {y!r}"
    return "same arguments, other op"
