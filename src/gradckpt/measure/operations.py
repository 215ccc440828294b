"""A block's forward pass by ATen operation: the share of time each operation takes, the bytes
saved for backward by the operation that made them, the bytes a policy keeping an operation
would keep (its outputs), and the outputs of its matrix multiplies and attention kernels (what
``policy="save-matmuls"`` keeps)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..engine import asks_policy, first_tensor, is_matmul_or_attention, storage_key
from . import clock
from .recording import BlockCall
from .tensors import SavedStorages, tensor_bytes

__all__ = ["MENU_TIMING_MIN_RUNS", "MENU_TIMING_RUNS", "MENU_TIMING_SECONDS", "Operations",
           "operations_of"]

# Runs of a block's forward timed by operation where its op-level choices are chosen from the
# times (``one_block``): each operation's least time of them. A loaded machine only adds time,
# and to a millisecond's operation far more than it takes (the demo's GPT, one run: its GELU
# 1-12% of the forward); the least of 15 came out the same menu run after run.
MENU_TIMING_RUNS = 15
# No further run is started once the runs so far have taken this long (wall clock), and yet at
# least MENU_TIMING_MIN_RUNS are made. Each run costs a block's forward: 15 of the architecture
# sweep's Falcon-H1 layer (Mamba2 at its defaults, on CPU) took 10.6 s of CPU time, the 3 it
# now makes 2.2 s. Many runs matter where operations take a millisecond or less, which load
# stretches several times over; such blocks are fast and keep all 15: the tiny Llama, GPT-2
# under LoRA and small TinyGPT of the plan-stability tests take 8-11 ms a run on a loaded
# 2-core machine (15 in under 0.2 s; the small TinyGPT's menu: 5 different in 10 timings of 3
# runs, 3 of 8, 1 of 15). The demo's TinyGPT (70-120 ms a run, by load) makes 5-7: 1 menu in
# 8 timings of 5 runs, 4 of 15; at load 10, 2 in 6 capped, 3 of 15 (what moves it is the load
# while it runs, near the 5% share offered, not the number of runs); a Llama layer of width
# 1024 (280 ms a run): 2 menus in 5 timings of 3 runs as of 15.
MENU_TIMING_SECONDS = 0.5
MENU_TIMING_MIN_RUNS = 3


class _OpTimer(TorchDispatchMode):
    """Times every ATen operation, by operation, and remembers which made each storage."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.matmul_bytes = 0
        self.matmul_seconds = 0.0
        self.matmul_names: set[str] = set()
        self.producer: dict[int, str] = {}  # storage -> the operation that made it
        # What a policy keeping each operation would keep: the outputs of the calls the engine
        # asks a policy about; and the operations whose outputs a later operation changes in
        # place (keeping those costs the engine a private copy: not offered).
        self.kept_bytes: dict[str, int] = {}
        self.kept_by: dict[int, str] = {}  # storage -> the asked operation that made it
        # Those storages held until the pass ends: a freed storage's key can come back for a
        # new one (the block's output once looked made by an RMSNorm ``mean`` before it).
        self.held: list[torch.UntypedStorage] = []
        self.count = 0  # operations dispatched
        self.changed_in_place: set[str] = set()  # or sharing memory: not offered

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        self.count += 1
        for written in _written_arguments(func, args, kwargs):
            if storage_key(written) in self.kept_by:
                self.changed_in_place.add(self.kept_by[storage_key(written)])
        start = clock.now()
        output = func(*args, **kwargs)
        elapsed = clock.now() - start
        name = str(func.overloadpacket)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if outputs and asks_policy(func):
            if _storages(outputs) & _storages((args, kwargs)):
                # Its outputs share memory with its arguments (``_unsafe_view`` of a matmul's
                # output): keeping them would not add up with the others.
                self.changed_in_place.add(name)
            self.kept_bytes[name] = (self.kept_bytes.get(name, 0)
                                     + sum(tensor_bytes(t) for t in outputs))
            for tensor in outputs:
                key = storage_key(tensor)
                if key is not None and key not in self.kept_by:
                    self.kept_by[key] = name
                    self.held.append(tensor.untyped_storage())
        for tensor in outputs:
            key = storage_key(tensor)
            if self.producer.get(key, "").startswith("aten.empty"):
                self.producer[key] = name  # the first to write it (dropout's bernoulli_)
            else:
                self.producer.setdefault(key, name)
        if is_matmul_or_attention(func):
            self.matmul_bytes += sum(tensor_bytes(t) for t in outputs)
            self.matmul_seconds += elapsed
            self.matmul_names.add(name)
        return output


@dataclass
class Operations:
    """A block's forward pass by ATen operation (what op-level choices weigh)."""

    matmul_bytes: int  # outputs of matrix multiplies and attention kernels
    matmul_share: float  # their share of the forward time
    saved_bytes: dict[str, int]  # bytes saved for backward, by the operation that made them
    time_share: dict[str, float]  # share of the forward time, by operation
    # outputs a policy keeping the operation keeps (``BlockProfile.kept_bytes_by_op``)
    kept_bytes: dict[str, int]
    count: int  # operations dispatched in its forward


def operations_of(
    block: nn.Module, call: BlockCall, side_inputs: dict[int, int], runs: int = 1
) -> Operations:
    """Run the block's forward once more, timing and attributing each operation (saved side
    inputs left out, as from ``saved_bytes``); ``runs`` above 1: the forward run up to that
    many times (``MENU_TIMING_RUNS``), each operation's time the least of its runs'; no run is
    started once those made have taken ``MENU_TIMING_SECONDS``, after the first
    ``MENU_TIMING_MIN_RUNS`` (or ``runs`` where fewer)."""
    started = time.perf_counter()
    args, kwargs, hidden = call.fresh()
    excluded = {storage_key(t) for t in (*block.parameters(), *block.buffers())}
    excluded |= set(side_inputs)
    saving = SavedStorages(excluded)
    # With grad, as in training: kernels can differ without it.
    with torch.autograd.graph.saved_tensors_hooks(saving.pack, lambda t: t), _OpTimer() as timer:
        output = first_tensor(block(*args, **kwargs))
    saved = saving.alive()  # as ``saved_bytes`` counts them
    # The block's output is the next item's input, retained by it whatever this block keeps:
    # not among what keeping its operation adds (counted twice, a choice keeping a Llama
    # layer's residual add came out one hidden state high).
    if output is not None and storage_key(output) in timer.kept_by:
        name = timer.kept_by[storage_key(output)]
        timer.kept_bytes[name] -= tensor_bytes(output)
    seconds = dict(timer.seconds)
    # A modeled clock times each run alike (and more runs would only move its reading's bits).
    more_runs = 0 if clock.modeled() else runs - 1
    for run in range(1, 1 + more_runs):  # ``run`` runs made so far
        if (run >= MENU_TIMING_MIN_RUNS
                and time.perf_counter() - started >= MENU_TIMING_SECONDS):
            break
        again_args, again_kwargs, _ = call.fresh()
        with _OpTimer() as again:
            block(*again_args, **again_kwargs)
        for name in seconds.keys() & again.seconds.keys():  # the first run's operations
            seconds[name] = min(seconds[name], again.seconds[name])
    matmul_seconds = (timer.matmul_seconds if not more_runs
                      else sum(seconds[name] for name in timer.matmul_names))
    total = sum(seconds.values())
    saved_by_op: dict[str, int] = {}
    for key, nbytes in saved.items():
        name = "input" if key == storage_key(hidden) else timer.producer.get(key, "other input")
        saved_by_op[name] = saved_by_op.get(name, 0) + nbytes
    by_time = sorted(seconds.items(), key=lambda item: -item[1])
    return Operations(
        matmul_bytes=timer.matmul_bytes,
        matmul_share=matmul_seconds / total if total else 0.0,
        saved_bytes=dict(sorted(saved_by_op.items(), key=lambda item: -item[1])),
        time_share={name: seconds / total for name, seconds in by_time} if total else {},
        kept_bytes={name: nbytes for name, nbytes in timer.kept_bytes.items()
                    if name not in timer.changed_in_place},
        count=timer.count,
    )


def _storages(tree: object) -> set:
    return {storage_key(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


def _written_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """The tensors ``func`` changes in place (its schema's written arguments, ``out=`` too)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written
