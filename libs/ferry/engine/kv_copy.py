"""KvCopier: KV blocks out of and into the paged pool, without the engine thread waiting on a copy.

Every block that leaves the pool (a prefill hand-off, a decode worker's write-back, a sequence moved at
shutdown, a host-tier eviction) and every block that enters it (a hand-off's or a prefix's blocks
fetched from the store, a host-tier promotion) goes through here. On CUDA:

- copy out (engine thread, right after the step that wrote the blocks): the blocks are gathered on the
  compute stream into a device buffer, so a later step that reuses the freed slots is queued after the
  gather; an event marks it, and a side stream waits for that event (on the GPU, not the host) and
  copies the buffer into pinned host memory. The engine thread returns at once with an OutCopy; the
  I/O side (asyncio, the store client) waits for it (`result`/`wait`), never the engine thread, and the
  next step computes while the copy crosses PCIe.
- copy in: the I/O side stages fetched blocks (`stage`: into pinned memory, then a non-blocking copy
  to the device on the side stream, an event), while the engine steps; the engine thread's `write`
  makes the compute stream wait for that event and scatters the blocks into the pool, so the step that
  reads them is queued after the copy landed, and again no host thread waited.
- host-tier blocks are pinned views of an OutCopy's buffer: reading them back (`stage`/`write`) is
  queued on the same side stream, after the copy that fills them.

On the CPU the interface is the same and the copies are synchronous (nothing to overlap with: a copy
would take the cores the step runs on): an OutCopy is complete when it is returned.

Pinned staging is bounded (`max_pinned_bytes` in flight or held by hand-off copies): past it a copy
out keeps its device buffer and the I/O side's `wait` copies it to pageable memory instead.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Sequence

import torch

from ferry.dtypes import raw_view
from ferry.model.kv_cache import PagedKVCache

MAX_PINNED_BYTES = 1 << 30
"""Pinned host memory the hand-off copies may hold at once (host-tier copies are bounded by the tier)."""


class OutCopy:
    """Blocks on their way out of the pool: [n, *block_shape] on the host once done."""

    def __init__(
        self,
        host: torch.Tensor | None,
        done_event: torch.cuda.Event | None = None,
        device_buffer: torch.Tensor | None = None,
        side_stream: torch.cuda.Stream | None = None,
    ) -> None:
        assert (host is None) != (device_buffer is None), "lands in pinned memory, or stays on the device"
        self.buffer = host
        """The host tensor the copy lands in; its contents are valid once done() (None: over budget)."""
        self._event = done_event
        self._device_buffer = device_buffer
        self._side_stream = side_stream
        self._lock = threading.Lock()

    @property
    def shape(self) -> torch.Size:
        return (self.buffer if self.buffer is not None else self._device_buffer).shape  # type: ignore[union-attr]

    def done(self) -> bool:
        """The host tensor is complete (asks the GPU; never waits)."""
        return self._device_buffer is None and (self._event is None or self._event.query())

    def wait(self) -> torch.Tensor:
        """-> [n, *block_shape] on the host; blocks the calling thread until the copy landed. Call it
        from an I/O thread (or `result` from asyncio), never from the engine thread."""
        with self._lock:
            if self._device_buffer is not None:  # over the pinned budget: copy it now, here
                with torch.cuda.stream(self._side_stream):
                    self.buffer = self._device_buffer.to("cpu")  # waits for the side stream
                self._device_buffer = None
            elif self._event is not None:
                self._event.synchronize()
            assert self.buffer is not None
            return self.buffer

    async def result(self) -> torch.Tensor:
        """`wait` for an asyncio caller: on a thread unless the copy landed already."""
        return self.wait() if self.done() else await asyncio.to_thread(self.wait)

    def __reduce__(self) -> tuple[type[OutCopy], tuple[torch.Tensor]]:
        """Across a process boundary (an expert-parallel rank's reply) a copy travels landed."""
        return (OutCopy, (self.wait(),))


class InCopy:
    """Blocks on their way into the pool, staged by `KvCopier.stage`: [n, *block_shape] on the pool's
    device once `ready` (an event on the side stream; None: already there)."""

    def __init__(self, data: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        self.data = data
        self.ready = ready

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


class KvCopier:
    def __init__(self, kv: PagedKVCache, max_pinned_bytes: int = MAX_PINNED_BYTES) -> None:
        self.kv = kv
        self.device = kv.data.device
        self.is_cuda = self.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        """Where copies between host and device run, beside the compute stream."""
        self.max_pinned_bytes = max_pinned_bytes
        self._pinned_bytes = 0
        self._budget_lock = threading.Lock()
        self.num_unpinned_copies = 0
        """Copies out that found the pinned budget spent (their D2H ran at `wait`)."""

    # ---- out ---------------------------------------------------------------------------------
    def copy_out(self, block_ids: Sequence[int], keep_pinned: bool = False) -> OutCopy:
        """Start copying blocks to the host; -> at once (engine thread). The blocks' slots may be
        reused by the next step: the gather is queued before it. keep_pinned: the copy is kept
        (host tier) and is not counted against the hand-off budget."""
        gathered = self._gather(block_ids)  # [n, *block_shape] on the pool's device
        if not self.is_cuda:
            return OutCopy(gathered)
        gathered_event = torch.cuda.Event()
        gathered_event.record(torch.cuda.current_stream(self.device))
        side = self.side_stream
        assert side is not None
        host = self._pinned_like(gathered, counted=not keep_pinned)
        with torch.cuda.stream(side):
            side.wait_event(gathered_event)  # on the GPU: the engine thread does not wait
            gathered.record_stream(side)  # the allocator must not reuse it before the side stream read it
            if host is None:
                self.num_unpinned_copies += 1
                return OutCopy(None, None, gathered, side)
            host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return OutCopy(host, done)

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """-> [n, *block_shape], contiguous, in one copy (index_select then contiguous() copied twice: a
        turn's write-back moves ~16 KB a token on the bench model, on the engine thread)."""
        index = self._index(block_ids)
        by_block = self.kv.data.permute(3, 0, 1, 2, 4, 5)  # a view: [N, L, planes, H, bs, D]
        if self.is_cuda or not len(index):
            return by_block[index]  # one gather kernel
        return torch.stack([by_block[i] for i in block_ids])  # on the CPU ~2x faster than the indexing op

    def _pinned_like(self, tensor: torch.Tensor, counted: bool) -> torch.Tensor | None:
        nbytes = tensor.numel() * tensor.element_size()
        if counted:
            with self._budget_lock:
                if self._pinned_bytes + nbytes > self.max_pinned_bytes:
                    return None
                self._pinned_bytes += nbytes
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if counted:  # back in the budget when the last reference to the buffer (or a view of it) goes
            weakref.finalize(host, self._release, nbytes)
        return host

    def _release(self, nbytes: int) -> None:
        with self._budget_lock:
            self._pinned_bytes -= nbytes

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes hand-off copies hold now."""
        return self._pinned_bytes

    # ---- in ----------------------------------------------------------------------------------
    def stage(self, blocks: torch.Tensor | Sequence[torch.Tensor]) -> InCopy:
        """Start moving host blocks ([n, *block_shape], or n tensors [*block_shape]) to the pool's
        device; safe on any thread (the I/O side calls it as blocks arrive from the store)."""
        if not self.is_cuda:
            data = blocks if isinstance(blocks, torch.Tensor) else torch.stack(list(blocks))
            return InCopy(data.to(self.kv.dtype))
        parts = [blocks] if isinstance(blocks, torch.Tensor) else list(blocks)
        side = self.side_stream
        assert side is not None
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            if len(parts) == 1 and parts[0].dim() == len(self.kv.block_shape) + 1:
                data = self._to_device(parts[0])
            else:
                data = torch.empty((len(parts), *self.kv.block_shape), dtype=self.kv.dtype, device=self.device)
                for i, part in enumerate(parts):
                    data[i].copy_(part if part.is_pinned() else part.pin_memory(), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        return InCopy(data, ready)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if host.device.type != "cpu":
            return host.to(self.device, self.kv.dtype)
        if not host.is_pinned():  # a pageable source would make the copy synchronous
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True).to(self.kv.dtype)

    def write(self, block_ids: Sequence[int], blocks: torch.Tensor | Sequence[torch.Tensor] | InCopy) -> None:
        """Scatter blocks into the pool's slots block_ids (engine thread); the next step reads them
        after the copy landed (the compute stream waits for it, the host does not)."""
        staged = blocks if isinstance(blocks, InCopy) else self.stage(blocks)
        expected = (len(block_ids), *self.kv.block_shape)
        if tuple(staged.shape) != expected:
            raise ValueError(f"blocks: shape {tuple(staged.shape)} != expected {expected}")
        data = staged.data
        if staged.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(staged.ready)
            data.record_stream(compute)  # staged on the side stream, read on this one
        index = self._index(block_ids)
        src = data.to(self.kv.dtype).permute(1, 2, 3, 0, 4, 5)
        raw_view(self.kv.data).index_copy_(3, index, raw_view(src))  # raw: fp8 has no index_copy_

    def copy_within(self, src: int, dst: int) -> None:
        """Copy pool block `src` into block `dst` (engine thread; on the compute stream, so it lands
        after every step queued before and before every step queued after)."""
        if not (0 <= src < self.kv.num_blocks and 0 <= dst < self.kv.num_blocks):
            raise ValueError(f"blocks {src} -> {dst}: out of range 0..{self.kv.num_blocks - 1}")
        data = self.kv.data
        data[:, :, :, dst].copy_(data[:, :, :, src])

    # ---- shared ------------------------------------------------------------------------------
    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """block_ids as an int64 index on the pool's device, checked on the host (reading a device
        index back to check it would wait for the running step)."""
        ids = list(block_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.kv.num_blocks):
            raise ValueError(f"block_ids: out of range 0..{self.kv.num_blocks - 1}")
        index = torch.tensor(ids, dtype=torch.int64)
        if not self.is_cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)
