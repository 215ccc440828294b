"""The memory of one plain training step, phase by phase: before the chain, its forward, the
head, its backward and after it (what ``gradckpt.cost`` models each phase of the step with)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..engine import first_tensor, storage_key
from . import clock
from .meter import MemoryMeter
from .tensors import saved_apart

__all__ = ["Mark", "StepMemory"]


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class Mark:
    """A moment of the step, closing the stretch since the mark before: ``what`` happened
    (a phase began: its name; a marked block's forward began, ``"forward"``, or returned,
    ``"returned"``; the gradient of its input arrived, ``"backward"``; the step ended,
    ``"end"``), to which block (its index among the marked ones), in which phase the
    stretch before it lay; the bytes allocated now, the most allocated in that stretch, the
    clock, and the operations dispatched so far."""

    what: str
    block: int | None
    phase: str
    current: int
    peak: int
    seconds: float
    operations: int


class StepMemory:
    """Memory through one plain step, phase by phase: each phase's peak, and the memory at the
    start and when the chain's backward starts.

    Phases: "before" the chain, the chain's "forward", the "head" (from the chain's output to
    its gradient), the chain's "backward", and "after" it (the embedding's backward).

    ``marked``: blocks of the chain (its first ones) whose own stretches are noted too, in
    ``marks`` (each phase's start is a mark as well), with the total after each operation in
    ``trace``: ``stand_ins`` puts a step of a long chain together from them.
    """

    def __init__(self, first: nn.Module, last: nn.Module, device: torch.device,
                 marked: Sequence[nn.Module] = ()) -> None:
        self.first, self.last, self.device = first, last, device
        self.marked = list(marked)
        self.phase = "before"
        self.highest: dict[str, int] = dict.fromkeys(
            ("before", "forward", "head", "backward", "after"), 0
        )
        self.start = self.peak = self.chain_backward_start = self.chain_backward_end = 0
        self.chain_forward_start = 0  # the bytes allocated when the chain's first block starts
        # Whether the chain's input was still alive when its gradient arrived: the modules
        # before the chain saved it (a CNN stem's ReLU its output), so it outlives the chain.
        self.chain_input_alive_at_end = False
        self._chain_input: StorageWeakRef | None = None
        # What the graph saved before the chain (storage -> its weak reference and bytes), and
        # of that, the bytes freed after the chain's backward started and before it ended:
        # the part before the chain ran backward (MPNet's position bias's bucket indices,
        # 128 KB) before the chain input's gradient arrived, so the end missed them.
        self._saved_before: dict[Any, tuple[StorageWeakRef, int]] = {}
        self.freed_before_end = 0
        self.end = 0
        self.marks: list[Mark] = []
        self.trace: list[int] = []
        self._memory: MemoryMeter | None = None
        self._watching: Any = None  # the saved-tensors hook before the chain

    def measure(self, step: Callable[[], None], tracked: list[Any]) -> None:
        """Run ``step`` under the meter, ``tracked`` (what exists before it: the model, the
        sample, a previous output) counted; the list is emptied once the meter has them, so
        that what the step lets go is freed when it does."""
        hooks = [
            self.first.register_forward_pre_hook(self._chain_starts, with_kwargs=True),
            self.last.register_forward_hook(self._chain_ends),
        ]
        for index, block in enumerate(self.marked):
            if index > 0:  # the first block's start and gradient are the phases'
                hooks.append(block.register_forward_pre_hook(
                    self._block_starts(index), with_kwargs=True))
            hooks.append(block.register_forward_hook(self._block_returns(index)))
        try:
            with MemoryMeter(self.device, *tracked) as memory:
                tracked.clear()
                self._memory = memory
                if self.marked:
                    memory.trace = self.trace
                self.start = memory.current()
                self._watch_saves()
                step()
                self._enter(self.phase, "end")
                self.end = memory.current()  # what the step leaves: gradients, the output
        finally:
            self._stop_watching_saves()
            for hook in hooks:
                hook.remove()
        self.peak = max(self.highest.values())

    def _enter(self, phase: str, what: str | None = None, block: int | None = None) -> None:
        assert self._memory is not None
        peak = self._memory.peak()
        self.highest[self.phase] = max(self.highest[self.phase], peak)
        if self.marked:
            self.marks.append(Mark(what or phase, block, self.phase, self._memory.current(),
                                   peak, clock.now(), self._memory.operations))
        self._memory.reset_peak()
        self.phase = phase

    def _watch_saves(self) -> None:
        """Note what the graph saves before the chain (``_saved``), until the chain starts.

        Only then: a saved-tensors hook changes how autograd keeps what it saves (it checks no
        in-place change any more), so the chain and the head run as they do without one."""
        self._watching = torch.autograd.graph.saved_tensors_hooks(self._saved, _unpacked)
        self._watching.__enter__()

    def _stop_watching_saves(self) -> None:
        # Hooks are a stack: ours comes off only from its top (a model's own, pushed before the
        # chain and still open, keeps ours under it until the step's end).
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self._watching is not None and top is not None and top[0] == self._saved:
            self._watching.__exit__(None, None, None)
            self._watching = None

    def _saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: the storage noted in the phase before the chain; the tensor kept
        apart (``saved_apart``). Kept as it came, Reformer's reversible layers, recomputed in
        their backward, left 4.5 MB of graph alive past the step's end: ``optimizer.step()``'s
        peak predicted 36% over."""
        with clock.BOOKKEEPING:  # fake tensors answer about their storage with operations
            if self.phase == "before":
                key = storage_key(tensor)
                if key is not None and key not in self._saved_before:
                    storage = tensor.untyped_storage()
                    self._saved_before[key] = (StorageWeakRef(storage), storage.nbytes())
        return saved_apart(tensor)

    def _mark(self, what: str, block: int) -> None:
        self._enter(self.phase, what, block)

    def _block_starts(self, index: int) -> Callable[..., None]:
        def starts(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._mark("forward", index)
            hidden = first_tensor((args, kwargs))
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(lambda gradient: self._mark("backward", index))

        return starts

    def _block_returns(self, index: int) -> Callable[..., None]:
        def returns(module: nn.Module, args: tuple, output: Any) -> None:
            self._mark("returned", index)

        return returns

    def _chain_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # a run that saves nothing (a recurrent model's cycles under no_grad): as
            # the recording (``recording.py``), the chain is the run with gradients
        self._stop_watching_saves()
        self._enter("forward")
        assert self._memory is not None
        self.chain_forward_start = self._memory.current()
        hidden = first_tensor((args, kwargs))
        if hidden is not None and hidden.requires_grad:
            # the gradient of the chain's input ends the chain's backward
            self._chain_input = StorageWeakRef(hidden.untyped_storage())
            self._saved_before.pop(storage_key(hidden), None)  # the chain's (``profile``)
            hidden.register_hook(self._chain_backward_ends)

    def _chain_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._enter("head")
        hidden = first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(self._chain_backward_starts)

    def keep_before_chain(self, measured: StepMemory) -> None:
        """Take from ``measured`` what the part before the chain left alive through the chain's
        backward (``chain_input_alive_at_end``, ``freed_before_end``): a step put together from
        ``measured`` (more blocks standing in, another head spliced in) changes neither."""
        self.chain_input_alive_at_end = measured.chain_input_alive_at_end
        self.freed_before_end = measured.freed_before_end

    def _chain_backward_starts(self, gradient: torch.Tensor) -> None:
        self._enter("backward")
        assert self._memory is not None
        self.chain_backward_start = self._memory.current()  # the gradient included
        self._saved_before = {key: saved for key, saved in self._saved_before.items()
                              if not saved[0].expired()}

    def _chain_backward_ends(self, gradient: torch.Tensor) -> None:
        self._enter("after")
        assert self._memory is not None
        self.chain_backward_end = self._memory.current()  # the input's gradient included
        self.chain_input_alive_at_end = (self._chain_input is not None
                                         and not self._chain_input.expired())
        self.freed_before_end = sum(nbytes for reference, nbytes in self._saved_before.values()
                                    if reference.expired())
