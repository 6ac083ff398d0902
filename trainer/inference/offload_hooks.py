"""Running offloaded blocks: forward pre-hooks bring a block's weights to the execution device and
forward hooks release them. No ``forward`` is replaced.

On CUDA each block's tensors are copied into one of two reused pinned staging buffers, sent to the
GPU on a side stream, and the next block (in the order recorded on the first forward) is prefetched
while the current one runs. On CPU execution the offloaded (memory-mapped) tensors are used as they
are: nothing is copied.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def send_to(obj: Any, device: torch.device) -> Any:
    """Tensors inside tuples/lists/dicts moved to ``device`` (other objects as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(send_to(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to(o, device) for o in obj)
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = send_to(obj[k], device)
        return obj
    return obj


def first_device(args: Tuple, kwargs: Dict) -> Optional[torch.device]:
    for o in list(args) + list(kwargs.values()):
        if isinstance(o, torch.Tensor):
            return o.device
    return None


class Block:
    """Tensors ``(module, leaf, offloaded tensor)`` that one module's forward needs on the device."""

    handles: List[RemovableHandle]  # the forward (pre-)hooks, set by ``Runner.add``

    def __init__(self, runner: Runner, module: nn.Module, slots: List[Tuple[nn.Module, str, torch.Tensor]]) -> None:
        self.runner, self.module, self.slots = runner, module, slots
        uniq: Dict[int, torch.Tensor] = {}
        for _, _, t in slots:
            uniq.setdefault(id(t), t)
        self.uniq = list(uniq.values())
        # byte offsets in the staging/device buffer, each aligned to 64 bytes so every dtype view is valid
        self.offsets: List[int] = []
        end = 0
        for t in self.uniq:
            self.offsets.append(end)
            end = -(-(end + t.numel() * t.element_size()) // 64) * 64
        self.nbytes = max(end, 1)
        self.ready: Optional[Tuple[Dict[int, torch.Tensor], Any]] = None  # (on-device tensors, cuda event)

    def fetch(self, stream: Optional[torch.cuda.Stream]) -> Tuple[Dict[int, torch.Tensor], Any]:
        r, dev = self.runner, self.runner.device
        if dev.type != "cuda":
            return {id(t): t.to(dev) for t in self.uniq}, None
        staging, done = r.staging()
        if done is not None:
            done.synchronize()  # that buffer's previous copy has left it
        views = []
        for t, off in zip(self.uniq, self.offsets):
            n = t.numel() * t.element_size()
            staging[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            views.append((t, off, n))
        ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream(dev))
        with ctx:
            flat = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
            flat.copy_(staging[: self.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        r.staged(event)
        out = {id(t): flat[o : o + n].view(t.dtype).view(t.shape) for t, o, n in views}
        return out, event

    def pre(self, module: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
        r = self.runner
        if self.ready is not None:
            on_dev, event = self.ready
            self.ready = None
            if event is not None:
                torch.cuda.current_stream(r.device).wait_event(event)
                for t in on_dev.values():
                    t.record_stream(torch.cuda.current_stream(r.device))
        else:
            on_dev, _ = self.fetch(None)
        for mod, leaf, t in self.slots:
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(on_dev[id(t)], requires_grad=False)
            else:
                mod._buffers[leaf] = on_dev[id(t)]
        r.entered(self)
        return send_to(args, r.device), send_to(kwargs, r.device)

    def post(self, module: nn.Module, args: Tuple, kwargs: Dict, output: Any) -> Any:
        for mod, leaf, t in self.slots:
            if leaf in mod._parameters:
                mod._parameters[leaf] = cast(nn.Parameter, t)  # the offloaded tensor, put back as it was
            else:
                mod._buffers[leaf] = t
        return output


class Runner:
    """Blocks of one model sharing an execution device, two pinned staging buffers and a side stream."""

    def __init__(self, device: torch.device, prefetch: bool = True) -> None:
        self.device = device
        self.blocks: List[Block] = []
        self.order: List[Block] = []
        self.recording = True
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda and prefetch else None
        self._buffers: List[torch.Tensor] = []
        self._events: List[Any] = [None, None]
        self._next = 0

    def add(self, module: nn.Module, slots: List[Tuple[nn.Module, str, torch.Tensor]]) -> Block:
        block = Block(self, module, slots)
        self.blocks.append(block)
        block.handles = [
            module.register_forward_pre_hook(block.pre, with_kwargs=True),
            module.register_forward_hook(block.post, with_kwargs=True),
        ]
        return block

    def staging(self) -> Tuple[torch.Tensor, Any]:
        if not self._buffers:
            size = max(b.nbytes for b in self.blocks)
            self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        i = self._next
        return self._buffers[i], self._events[i]

    def staged(self, event: Any) -> None:
        self._events[self._next] = event
        self._next ^= 1

    def entered(self, block: Block) -> None:
        if self.recording:
            if block in self.order:  # the first full pass is over: the order is known
                self.recording = False
            else:
                self.order.append(block)
                return
        if self.stream is None or not self.order:
            return
        i = self.order.index(block)
        nxt = self.order[(i + 1) % len(self.order)]
        if nxt.ready is None and nxt is not block:
            nxt.ready = nxt.fetch(self.stream)

    def remove(self) -> None:
        for b in self.blocks:
            for h in b.handles:
                h.remove()
        self.blocks.clear()
