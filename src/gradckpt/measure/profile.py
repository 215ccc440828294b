"""Measuring a model: one real training step, and each block of its chain on its own.

``profile(model, sample, optimizer=...)`` runs a warm-up step and a few measured steps of the
model as it is (no checkpointing) and records what ``Profile`` holds, for the steady state of
the user's loop (step 2 on):

- the step's peak memory (MemTracker's "Total" on CPU, ``max_memory_allocated`` on CUDA) and
  its median time, measured with the previous step's output alive where the loop keeps it
  (``out = model(**batch)`` lets it go only once the next forward has returned);
- the optimizer's state, and the peak of ``optimizer.step()`` with every gradient alive
  (``optimizer_step.py``: the optimizer replicated on fake tensors), with gradient
  accumulation the gradients held between micro-batches, and under DDP (``ddp=True``) its
  buckets' copy of the trainable gradients (``training_state.py``);
- per block, from the block's real inputs in that step, re-run on its own: input and output
  bytes; the bytes its autograd graph keeps (the distinct storages of the tensors it saves for
  backward, parameters excluded, its input included when saved; side inputs such as an
  encoder's output counted once for the chain); the transient memory of its forward and
  backward pass (MemTracker / the CUDA allocator, above what existed before); its forward and
  backward time and what checkpointing it adds (its forward timed inside the measured steps;
  the others as multiples of its forward timed in the same rounds on its own, pooled over
  identical blocks); and the outputs and share of forward time of its matrix multiplies and
  attention kernels (what ``policy="save-matmuls"`` keeps).

``fixed_bytes`` is then whatever of the measured peak the chain model (``gradckpt.cost``) does not
explain: parameters, gradients, embeddings, logits. The model's parameters, gradients, buffers
and the RNG state are as they were before profiling.

This module runs the steps in order and assembles the ``Profile``; the measuring itself is in
its siblings: ``recording.py`` (each block's call in the step), ``timing.py`` (the step's and
the blocks' times), ``step_memory.py`` (the step's memory, phase by phase), ``one_block.py``
(one block on its own; ``operations.py`` for its operations) and ``side_inputs.py`` (side
inputs counted once for the chain); ``step_phases.py`` reads the step's memory as the phases
of the cost model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..ecosystem_hooks import ecosystem_hooks_on
from ..engine import first_tensor, heads_called, plans_suspended, storage_key
from ..errors import UsageError
from ..profile_types import MODELED_TIMES, BlockProfile, Profile
from . import clock
from .chain import chain_that_runs
from .chain_checks import NoneOfTheBlocksRan
from .device import infer_device
from .fingerprint import BLOCK_FINGERPRINTS, CHAIN_LENGTHS, chain_fingerprint
from .given_blocks import resolve_blocks
from .head_splice import head_replaced
from .model_state import buffers_and_rng_preserved, gradients_preserved
from .one_block import measure_block
from .optimizer_step import check_optimizer, measure_optimizer_step
from .output_head import PlainHead, head_to_chunk, measure_chunked_head
from .recording import Recording, record_block_calls
from .replay_check import replay_warnings
from .side_inputs import with_side_inputs
from .stand_ins import NotSpliceable, StandIns, splice
from .step import OutputHolder, training_step
from .step_memory import StepMemory
from .step_phases import assemble, chunked_head, steady_state
from .tensors import tensor_bytes, tensors_in
from .timing import BlockForwardTimer, block_kind, median_seconds, pooled_times
from .torch_checkpoints import torch_checkpoints_watched
from .training_state import accumulated_gradient_bytes, check_ddp, ddp_bucket_bytes

__all__ = ["profile"]


def profile(
    model: nn.Module,
    sample: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    optimizer: torch.optim.Optimizer | str | None = None,
    accumulation_steps: int = 1,
    ddp: bool = False,
    keep_output: bool = True,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Measure one training step of ``model`` on ``sample`` and each block of its chain.

    Args:
        model: the model, as it will be trained (its device, dtype, train/eval mode).
        sample: one batch: a tensor, a tuple of positional arguments or a dict of keywords.
        loss_fn: turns the output into the loss; default ``output.loss`` or ``output.sum()``.
        blocks: the chain (default: ``gradckpt.find_blocks(model)``, put in the order the
            blocks run on ``sample``, or, where none of them runs on it, such as a vision
            tower given text, ``find_blocks(model, sample)``); see ``resolve_blocks``. Given
            explicitly, it must be in that order.
        optimizer: the optimizer the loop steps (``torch.optim.AdamW(...)``), or its name
            (``"adamw"``, ``"sgd"``, ``"adamw-8bit"``: ``optimizer_step.OPTIMIZER_NAMES``), or
            ``None`` (no ``optimizer.step()`` in the step planned). Its state is counted in
            ``fixed_bytes`` and its step's peak in ``optimizer_step_bytes``; the optimizer
            itself is not stepped.
        accumulation_steps: micro-batches per optimizer step; above 1, the gradients the
            earlier ones leave are held all step (``accumulated_gradient_bytes``).
        ddp: the model trains wrapped in ``torch.nn.parallel.DistributedDataParallel``
            (profile the bare model, then wrap it): its buckets, as large as the trainable
            parameters, hold a copy of every gradient all run, and are counted in
            ``fixed_bytes`` and the peak (``notes["ddp_bucket_bytes"]``). The step is one
            rank's, ``sample`` one rank's batch.
        keep_output: the step holds the model's output until backward ends, as
            ``out = model(**batch); out.loss.backward()`` does (for a language model the
            logits stay alive). ``False`` for loops that drop it before backward, such as the
            Hugging Face Trainer's; see ``gradckpt.measure.step``.
        repeats: measured repetitions for every time (the median is kept).
        progress: called as ``progress(done, total)`` after each of the ``total`` steps of
            profiling (the CLI draws a bar with it; ``gradckpt.cli.progress.progress_bar``
            makes one). ``None``: nothing is reported.

    The registered ecosystem hooks (``gradckpt.ecosystem_hooks``: Hugging Face caches off) run
    while it measures, as they do while a plan is applied.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 512, (2, 16))
        >>> measured = gradckpt.profile(model, {"idx": idx, "targets": idx}, repeats=1)
        >>> [block.name for block in measured.blocks]
        ['transformer.h.0', 'transformer.h.1']
        >>> measured.blocks[0].input_bytes == 2 * 16 * 32 * 4
        True
        >>> under_ddp = gradckpt.profile(model, {"idx": idx, "targets": idx}, repeats=1,
        ...                              ddp=True)  # then DistributedDataParallel(model)
        >>> buckets = sum(p.numel() * 4 for p in model.parameters())
        >>> under_ddp.notes["ddp_bucket_bytes"] == buckets
        True
    """
    named_blocks = resolve_blocks(model, blocks)
    if not isinstance(keep_output, bool):
        raise UsageError(
            f"keep_output must be True (the loop holds the model's output until backward ends, "
            f"the default) or False (it drops it first, as the Hugging Face Trainer does); got "
            f"{keep_output!r}"
        )
    if repeats < 1:
        raise UsageError(f"repeats must be at least 1, got {repeats}")
    if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
            or accumulation_steps < 1):
        raise UsageError(f"accumulation_steps must be a positive int (micro-batches per "
                         f"optimizer step), got {accumulation_steps!r}")
    check_ddp(ddp)
    optimizer = check_optimizer(optimizer)  # a misspelt name is told before any step runs
    report = _progress_callback(progress)

    def measured_with(named_blocks: list[tuple[str, nn.Module]]) -> Profile:
        return _measured_chain(model, sample, loss_fn, named_blocks, blocks is not None,
                               optimizer, accumulation_steps, ddp, keep_output, repeats, report)

    try:
        measured = measured_with(named_blocks)
    except NoneOfTheBlocksRan as not_run:
        # Found by structure, the chain can be a tower the sample does not run (a vision
        # tower that outweighs the language model, given text): the chain that runs, found
        # by one more forward pass, which only such models pay, with the step that showed
        # it (chain.py, rule 4).
        measured = measured_with(chain_that_runs(model, sample, not_run, blocks is not None))
    if not clock.modeled():  # fake tensors have no values to compare
        with plans_suspended(model):
            replay_warnings(model, sample)
    return measured


def _measured_chain(
    model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
    named_blocks: list[tuple[str, nn.Module]], *arguments: Any,
) -> Profile:
    """``_measured``; on fake tensors (a modeled clock), a long chain of identical blocks runs
    its steps with its first blocks only, the rest standing in (``stand_ins``), and where the
    step does not show that this adds up, it runs again with every block."""
    stand_ins = StandIns.of([module for _, module in named_blocks]) if clock.modeled() else None
    if stand_ins is not None:
        try:
            return _measured(model, sample, loss_fn, named_blocks, *arguments, stand_ins)
        except NotSpliceable:
            pass
    return _measured(model, sample, loss_fn, named_blocks, *arguments, None)


def _measured(
    model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
    named_blocks: list[tuple[str, nn.Module]], blocks_given: bool,
    optimizer: torch.optim.Optimizer | str | None, accumulation_steps: int, ddp: bool,
    keep_output: bool, repeats: int, report: Callable[[int, int], None],
    stand_ins: StandIns | None,
) -> Profile:
    """``profile``'s steps, in order: record the blocks' calls, time and meter the step
    (and the chunked head's), the optimizer's step, each block on its own, and assemble."""
    device = infer_device(model)
    modules = [m for _, m in named_blocks]
    # A modeled clock times every step alike and has no caches to warm: the memory step is
    # timed, and the step before it is the recording one. A real one warms up and times apart.
    modeled = clock.modeled()
    steps = (0 if modeled else 1 + repeats) + 1 + len(modules)  # timed, memory step, blocks
    with (
        gradients_preserved(model),
        buffers_and_rng_preserved(model),
        ecosystem_hooks_on(model),
        plans_suspended(model),  # a planned model is measured as without its plan, kept on
        contextlib.ExitStack() as whole_steps,
    ):
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            report(done, steps)

        if stand_ins is not None:
            whole_steps.enter_context(stand_ins.in_place())
        out = OutputHolder()  # the loop's ``out``, from one step to the next
        # Where the model checkpoints itself with torch.utils.checkpoint, warn about the silent
        # failures that can hide there (double checkpointing, frozen inputs, RNG not replayed).
        with torch_checkpoints_watched(named_blocks), heads_called() as heads:
            recording = record_block_calls(model, sample, loss_fn, modules,
                                           out if modeled and keep_output else None)
        # What the step trains: an optimizer keeps state only for parameters that get a
        # gradient (a decoder-only BART's cross-attention, unused, gets none), and a block's
        # backward makes only those. Blocks standing in (stand_ins) ran no backward of their
        # own: they train what the block they stand in for trains.
        received = {id(p) for p in model.parameters() if p.grad is not None} or None
        trained = _with_stand_ins(received, stand_ins)
        head = head_to_chunk(model, heads)
        if not isinstance(head, str):  # the steps before the counts are known
            steps += 1 if modeled else 2
        if recording.order != list(range(len(modules))):
            if stand_ins is not None:
                raise NotSpliceable("the blocks run in another order")
            ran = [named_blocks[index][0] for index in recording.order]
            if blocks_given:
                raise UsageError(
                    f"blocks= must list the blocks in the order they run; on this sample they "
                    f"ran as {ran}"
                )
            # Found by structure (stacks in the order they were created: CLIP makes its text
            # tower first and runs its vision tower first); the cost model needs run order.
            named_blocks = [named_blocks[index] for index in recording.order]
            modules = [module for _, module in named_blocks]
        calls = [recording.calls[index] for index in recording.order]
        # What the blocks hold as the plan will find them (a quantised base at its packed
        # sizes), in run order: apply() tells a model the plan was not made for by it.
        fingerprint = chain_fingerprint(model, [name for name, _ in named_blocks])
        chain_breaks = recording.chain_breaks()

        def step() -> torch.Tensor:
            # As a training loop runs it: gradients start out as None (optimizer.zero_grad()).
            model.zero_grad(set_to_none=True)
            loss = training_step(model, sample, loss_fn, keep_output, out)
            advance()
            return loss

        def output_bytes() -> int:
            return _distinct_bytes(tensors_in(out.output), model_storages | sample_storages)

        def tracked() -> list[Any]:
            return [model, *tensors_in(sample), *tensors_in(out.output)]

        # With blocks standing in, a step can run with its first block alone where the loss
        # then still needs a gradient (the first block's output does).
        first_output = calls[1].leaves[calls[1].hidden] if len(calls) > 1 else None
        first_alone = (stand_ins.first_alone if stand_ins is not None and first_output
                       is not None and first_output.requires_grad else None)
        kept_plain: list[tuple[StepMemory, float]] = []  # the plain step of the kept blocks

        def metered(head_differs: bool = False) -> tuple[StepMemory, float]:
            """One step under the meter, from no gradients, and its seconds; with blocks
            standing in, as the whole chain has them. ``head_differs``: the step differs from
            the plain one metered first in its output head alone, which is all that runs
            again there (``head_splice``)."""
            model.zero_grad(set_to_none=True)  # the memory at the start has no gradients
            if head_differs and kept_plain and first_alone is not None:
                run = StepMemory(modules[0], modules[-1], device, marked=modules[:1])
                with first_alone():
                    run.measure(step, tracked())
                memory, seconds_change = head_replaced(kept_plain[0][0], run)
                seconds = kept_plain[0][1] + seconds_change
            else:
                memory = (stand_ins.step_memory(device) if stand_ins is not None
                          else StepMemory(modules[0], modules[-1], device))
                start = clock.now()
                memory.measure(step, tracked())
                seconds = clock.now() - start
                if stand_ins is None:
                    return memory, seconds
                kept_plain.append((memory, seconds))
            memory, added_seconds = splice(memory, stand_ins.kept, len(modules))
            return memory, seconds + added_seconds

        model_storages = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        sample_storages = {storage_key(tensor) for tensor in tensors_in(sample)}
        plain: PlainHead | None = None  # on a modeled clock, the plain step's head
        if modeled:
            held = recording.held_storages()
            if any(storage_key(tensor) in held for tensor in tensors_in(out.output)):
                # The recorded step's output shares memory with a block's argument, which the
                # recording keeps (T5's encoder output, its decoder blocks' argument): it would
                # never be let go. The output of one more step is the loop's previous one.
                steps += 1
                step()
            previous_output_bytes = output_bytes()
            plain = PlainHead(modules[-1], None if isinstance(head, str) else head[1], device)
            with BlockForwardTimer(modules, device) as timer, plain:
                timer.begin_step()
                memory, step_seconds = metered()
                timer.end_step()
        else:
            step()  # lazy initialisations, allocator caches
            with BlockForwardTimer(modules, device) as timer:

                def timed_step() -> None:
                    timer.begin_step()
                    step()
                    timer.end_step()

                step_seconds = median_seconds(timed_step, repeats, device)
            previous_output_bytes = output_bytes()
            # The previous output is let go when the step's forward returns, as in the loop:
            # nothing but ``out`` may hold it (measure() empties its list).
            memory, _ = metered()
        in_step_forward = timer.median_seconds()
        if stand_ins is not None:  # the blocks standing in forward as the last kept one
            in_step_forward[stand_ins.kept:] = [in_step_forward[stand_ins.kept - 1]] * len(
                stand_ins.standing_in)
        if not isinstance(head, str):
            def expect(more_steps: int) -> None:
                nonlocal steps
                steps += more_steps

            def previous_step() -> torch.Tensor:
                # Its output alone counts: the first block's forward is enough.
                with first_alone() if first_alone is not None else contextlib.nullcontext():
                    return step()

            head = measure_chunked_head(
                model, head, step, output_bytes, lambda: metered(head_differs=True),
                modules[-1], device, repeats, expect, plain, previous_step)
        whole_steps.close()
        out.output = None
        optimizer_step = measure_optimizer_step(
            optimizer, model, clock.modeled_device_kind() or device, trained)
        measured: list[BlockProfile] = []
        saved_side_inputs: list[dict[int, int]] = []
        time_ratios = []
        keys = []
        kinds = [block_kind(module, call) for module, call in zip(modules, calls, strict=True)]
        # On fake tensors timed by a modeled clock (estimate), identical blocks measure the
        # same: each one's first pass is checked against the first like it, the rest reused.
        alike: dict[Any, tuple[BlockProfile, dict[int, int], Any]] = {}
        first_of_kind: dict[Any, BlockProfile] = {}  # whose op-level choices the others share
        for index, ((name, module), call, trainable_bytes, gradient_bytes, forward_in_step,
                    kind) in enumerate(zip(named_blocks, calls, _gradient_bytes(modules),
                                           _gradient_bytes(modules, received),
                                           in_step_forward, kinds, strict=True)):
            sides = call.side_storages(model_storages)
            key = (kind, tuple(p.requires_grad for p in module.parameters()),
                   tuple(sorted(sides.items())), trainable_bytes, forward_in_step)
            keys.append(key)
            if stand_ins is not None and index >= stand_ins.kept:
                # It stood in: measured as the last kept block, once shown to compute alike.
                last = stand_ins.kept - 1
                if key != keys[last]:
                    raise NotSpliceable("a block standing in is called otherwise")
                with call.ambient():
                    stand_ins.computes_alike(module, call, modules[last], calls[last])
                block = replace(measured[last], name=name)
                saved_sides, ratios = saved_side_inputs[last], time_ratios[last]
            else:
                with call.ambient():
                    block, saved_sides, ratios = measure_block(
                        name, module, call, repeats, device, gradient_bytes, forward_in_step,
                        sides, like=alike.get(key) if clock.modeled() else None,
                        same_kind=first_of_kind.get(kind),
                    )
                alike.setdefault(key, (block, saved_sides, ratios))
                first_of_kind.setdefault(kind, block)
            measured.append(block)
            saved_side_inputs.append(saved_sides)
            time_ratios.append(ratios)
            advance()
    measured = pooled_times(measured, time_ratios, kinds)
    measured, output_held_bytes = with_side_inputs(
        measured, recording, chain_breaks, model_storages, saved_side_inputs, sample_storages,
        recording.output_storages if keep_output else set(),
    )
    between = recording.gradients_made_after()
    # The first block's side inputs exist when the chain starts (masks, rotary cos/sin).
    first_side_bytes = sum(calls[0].side_storages(model_storages | sample_storages).values())
    assembled = assemble(
        measured, memory, step_seconds, device, chain_breaks,
        sum(between[1:]) + output_held_bytes, _input_is_the_samples(recording, sample),
        previous_output_bytes, first_side_bytes,
    )
    accumulated = accumulated_gradient_bytes(model, accumulation_steps)
    buckets = ddp_bucket_bytes(model, ddp)
    plain = steady_state(assembled, memory, optimizer_step, accumulated, buckets, model,
                          sample, keep_output)
    plain.notes[BLOCK_FINGERPRINTS], plain.notes[CHAIN_LENGTHS] = fingerprint
    if modeled:
        plain.notes["blocks_traced_in_steps"] = (stand_ins.kept if stand_ins is not None
                                                 else len(modules))
    plain.notes[MODELED_TIMES] = modeled
    if isinstance(head, str):
        plain.notes["chunked_head"] = head
        return plain
    for chunked in head:
        step = steady_state(
            assemble(measured, chunked.memory, step_seconds, device, chain_breaks,
                      sum(between[1:]) + output_held_bytes, plain.chain_input_fixed,
                      chunked.previous_output_bytes, first_side_bytes),
            chunked.memory, optimizer_step, accumulated, buckets, model, sample, keep_output,
        )
        plain.chunked_heads.append(chunked_head(chunked, step))
    return plain


def _input_is_the_samples(recording: Recording, sample: Any) -> bool:
    """Whether the chain's first block took a tensor of the sample as its hidden state (a
    CNN's images), which the memory at the step's start counts already."""
    first = first_tensor(recording.arguments[recording.order[0]])
    return first is not None and storage_key(first) in {
        storage_key(tensor) for tensor in tensors_in(sample)
    }


def _progress_callback(progress: Any) -> Callable[[int, int], None]:
    """``progress`` as a callable; ``None`` and ``False`` (the old "no bar") report nothing."""
    if progress is None or progress is False:
        return lambda done, total: None
    if not callable(progress):
        raise UsageError(
            f"progress must be a callable taking (done, total), or None; got {progress!r}. "
            "For a bar on stderr: with gradckpt.cli.progress.progress_bar('profiling') as bar: "
            "gradckpt.profile(..., progress=bar)"
        )
    return progress


def _distinct_bytes(tensors: list[torch.Tensor], excluded: set) -> int:
    """Bytes of the distinct storages among ``tensors``, leaving out those in ``excluded``."""
    sizes = {}
    for tensor in tensors:
        key = storage_key(tensor)
        if key is not None and key not in excluded:
            sizes[key] = tensor.untyped_storage().nbytes()
    return sum(sizes.values())


def _with_stand_ins(received: set[int] | None, stand_ins: StandIns | None) -> set[int] | None:
    """``received`` (the ``id`` of each parameter the recorded step gave a gradient) with the
    parameters of the blocks standing in that their twin, the last kept block, trains,
    parameter for parameter (they are built alike)."""
    if received is None or stand_ins is None:
        return received
    twin = list(stand_ins.blocks[stand_ins.kept - 1].parameters())
    return received | {
        id(parameter)
        for block in stand_ins.blocks[stand_ins.kept:]
        for parameter, its_twin in zip(block.parameters(), twin, strict=True)
        if id(its_twin) in received
    }


def _gradient_bytes(blocks: list[nn.Module], received: set[int] | None = None) -> list[int]:
    """Per block, the bytes of its trainable parameters' gradients (a parameter shared by
    several blocks counts in the last: its gradient appears in the first backward); with
    ``received`` (the ``id`` of each parameter the step gave a gradient), of those alone: a
    decoder-only model's unused cross-attention gets none, and counted, the gradients
    alive in the chain's backward came out 66 KB under BigBirdPegasus's measured step."""
    owner = {}
    for index, block in enumerate(blocks):
        for parameter in block.parameters():
            if parameter.requires_grad and (received is None or id(parameter) in received):
                owner[parameter] = index
    sizes = [0] * len(blocks)
    for parameter, index in owner.items():
        sizes[index] += tensor_bytes(parameter)
    return sizes
