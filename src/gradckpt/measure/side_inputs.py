"""Side inputs: the tensor arguments of a block besides its hidden state (attention masks, an
encoder's output, rotary cos/sin), and the memory they hold, counted once for the whole chain.

Each block is measured on its own (``block.py``), so a side input that every layer takes would
count once per block; this module puts each one's bytes, and its gradient's, in the one block
where the chain really holds them (see ``BlockProfile.side_bytes``).
"""

from __future__ import annotations

from dataclasses import replace

from ..profile_types import BlockProfile
from .recording import BlockCall, Recording
from .tensors import is_passed_object

__all__ = ["with_side_inputs"]


def with_side_inputs(
    blocks: list[BlockProfile], recording: Recording, chain_breaks: list[int],
    model_storages: set, saved_side_inputs: list[dict[int, int]], sample_storages: set,
    output_held: set,
) -> tuple[list[BlockProfile], int]:
    """The blocks (in run order) with ``side_bytes``, ``held_side_bytes`` and
    ``side_gradient_bytes`` (see ``BlockProfile``).

    ``side_bytes``: each side input some block saves (``saved_side_inputs``), counted once, in
    the first block that takes it; after a chain break, what the modules between the two parts
    saved, the tensors counted already left out. ``held_side_bytes``: each side input no block
    saves, once, in the first block that takes it, unless it is part of the sample (counted in
    the fixed bytes). ``side_gradient_bytes``: side inputs'
    gradients, and those of the modules between two parts of the chain, which appear once the
    later part's backward is done (after the first block's: the embedding's, outside the
    chain's backward); and saved side inputs that the step's output holds (``output_held``),
    through the backward of the blocks before their first taker. Also returns the bytes of
    those, which the measured head leftovers include and must not count twice."""
    order = recording.order
    calls = [recording.calls[index] for index in order]
    returned = [recording.returned.get(index, set()) for index in order]
    saved_before = [recording.saved_after.get(order[position - 1], {})
                    if position in chain_breaks else {} for position in range(len(order))]
    saved = {key: nbytes for sides in saved_side_inputs for key, nbytes in sides.items()}
    counted = set(saved) | model_storages
    side_bytes = [
        sum(nbytes for key, nbytes in before.items() if key not in counted)
        for before in saved_before
    ]
    not_held = counted | sample_storages | {key for before in saved_before for key in before}
    held_side_bytes = [0] * len(blocks)
    side_gradient_bytes = [0] * len(blocks)
    output_held_bytes = 0
    takers: dict[int, list[int]] = {}
    gradients: dict[int, int] = {}
    for index, call in enumerate(calls):
        for key, nbytes in call.side_storages(model_storages).items():
            if key in saved:
                side_nbytes = saved.pop(key)
                side_bytes[index] += side_nbytes
                if key in output_held:
                    # The step's output holds it (an encoder's last hidden state): it outlives
                    # its first taker's backward, through the backward of the blocks before.
                    output_held_bytes += side_nbytes
                    for earlier in range(index):
                        side_gradient_bytes[earlier] += side_nbytes
            elif key not in not_held and key not in takers:
                held_side_bytes[index] += nbytes
            takers.setdefault(key, []).append(index)
        gradients.update(call.side_gradients(model_storages))
    for key, nbytes in gradients.items():
        # Made by the last taker's backward, summed into by the others' down to the first's,
        # and into the block that returned the tensor, if one did (its backward uses it).
        first = min(takers[key])
        if first > 0 and key in returned[first - 1]:
            first -= 1
        for index in range(first, max(takers[key])):
            side_gradient_bytes[index] += nbytes
    between = recording.gradients_made_after()
    for index in range(len(blocks)):
        side_gradient_bytes[index] += sum(between[index + 1:])
    # What a block stores in an object it was passed lives as long as the segments holding
    # that object: counted from the first block taking it, like a side input no block saves.
    for index, block in enumerate(blocks):
        if block.argument_stored_bytes:
            held_side_bytes[_first_taker(calls, index)] += block.argument_stored_bytes
    # A tensor a block returns that later blocks take (T5's position bias) is a side input,
    # counted there already, not with what the loop holds until the next block returns.
    sides = {key: nbytes for call in calls for key, nbytes in call.side_storages(
        model_storages).items()}
    returned_bytes = [
        max(0, block.returned_bytes - sum(sides.get(key, 0) for key in keys))
        for block, keys in zip(blocks, returned, strict=True)
    ]
    return [
        replace(block, side_bytes=side, held_side_bytes=held, side_gradient_bytes=gradient,
                returned_bytes=returned_bytes_of_block)
        for block, side, held, gradient, returned_bytes_of_block in zip(
            blocks, side_bytes, held_side_bytes, side_gradient_bytes, returned_bytes,
            strict=True)
    ], output_held_bytes


def _first_taker(calls: list[BlockCall], index: int) -> int:
    """The first block (position in run order) whose call passes one of the objects block
    ``index`` was passed (neither tensors nor plain values); ``index`` itself if none did."""
    passed = {id(leaf) for leaf in calls[index].leaves if is_passed_object(leaf)}
    for position, call in enumerate(calls[:index]):
        if any(id(leaf) in passed for leaf in call.leaves if is_passed_object(leaf)):
            return position
    return index
