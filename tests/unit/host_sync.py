"""Catch, on the CPU, what would make a GPU forward wait for the device (a host synchronisation).

torch.cuda.set_sync_debug_mode needs a GPU. Here a dispatch mode watches every aten op of a CPU run and
records the ones that on a GPU copy a value to the host: .item()/int()/bool() (_local_scalar_dense),
ops whose output size depends on the data (nonzero, bincount, unique, masked_select, a boolean-mask
index, repeat_interleave without output_size), and .tolist()/.numpy(), which read memory without an
aten op and are caught by wrapping them for the duration. Triton launches under TRITON_INTERPRET=1 run
unwatched: the interpreter copies to the host by design; on a GPU a launch is asynchronous.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
}


class HostSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and _syncs(func, args, kwargs):
            self.found.append(str(func))
        return func(*args, **kwargs)


def _syncs(func, args, kwargs) -> bool:
    if func in DATA_DEPENDENT:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten.index.Tensor:  # a boolean mask: the output size is the mask's count
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    return False


@contextlib.contextmanager
def watch_host_syncs() -> Iterator[list[str]]:
    """with watch_host_syncs() as found: ... -> found lists each syncing op, in order."""
    mode = HostSyncs()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def reading(name):
        def read(self, *args, **kwargs):
            if not mode.paused:
                mode.found.append(f"Tensor.{name}")
            return originals[name](self, *args, **kwargs)

        return read

    with contextlib.ExitStack() as stack:
        stack.enter_context(_kernels_unwatched(mode))
        for name in originals:
            setattr(torch.Tensor, name, reading(name))
        stack.callback(lambda: [setattr(torch.Tensor, n, f) for n, f in originals.items()])
        with mode:
            yield mode.found


@contextlib.contextmanager
def _kernels_unwatched(mode: HostSyncs) -> Iterator[None]:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        yield
        return
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        mode.paused = True
        try:
            with _disable_current_modes():
                return original(self, *args, **kwargs)
        finally:
            mode.paused = False

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original
