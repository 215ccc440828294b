"""What a run showed of the chain's blocks: which of them did not run, and whether blocks of
several lists that ran interleaved are still a chain.

``chain.find_blocks`` given a sample (its module docstring, rule 4 and the paragraph after
rule 5) and the step ``profile`` records (``recording.py``) apply the same rules to the blocks
they saw run: a stack that did not run is left out, blocks missing from a stack that ran
partly raise ``UsageError`` (``NoneOfTheBlocksRan`` where none ran), and so do lists run
interleaved where a block does not take the previous one's output. These functions only read
the blocks' names and classes and which of them ran; nothing here runs the model.

Example:
    >>> from torch import nn
    >>> blocks = [("encoder.0", nn.Linear(1, 1)), ("decoder.0", nn.Conv1d(1, 1, 1))]
    >>> blocks_not_run(blocks, ran=[0])  # the decoder did not run: left out
    ([1], [])
    >>> stack_name("encoder.0")
    'encoder'
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..errors import UsageError
from .stacks import original_class

__all__ = ["NoneOfTheBlocksRan", "blocks_not_run", "check_not_interleaved", "stack_name"]


class NoneOfTheBlocksRan(UsageError):
    """None of the blocks a step was recorded with ran on the sample (``recording.py``);
    ``profile`` turns it into the chain that runs (``chain.chain_that_runs``) or a
    ``UsageError`` saying what to pass."""


def blocks_not_run(
    blocks: list[tuple[str, nn.Module]], ran: Iterable[int]
) -> tuple[list[int], list[int]]:
    """Of ``blocks`` (``(qualified_name, module)``: a block's list is its parent), those that
    did not run, given the indices of those that ran: ``(left_out, missing)``. Where any block
    ran, a block is left out when no block of its list and class ran: a whole stack that did
    not run (a vision tower given text), or all the layers of one class in a list of several
    that did not (cross-attention layers, given no image). The others (of a list and class
    that ran partly, or all of them where none ran) are missing.

    Example:
        >>> from torch import nn
        >>> blocks = [("vision.0", nn.Conv1d(1, 1, 1)), ("vision.1", nn.Conv1d(1, 1, 1)),
        ...           ("text.0", nn.Linear(1, 1)), ("text.1", nn.Linear(1, 1))]
        >>> blocks_not_run(blocks, ran=[2, 3])  # text only: the vision tower is left out
        ([0, 1], [])
        >>> blocks_not_run(blocks, ran=[2])
        ([0, 1], [3])
        >>> blocks_not_run(blocks, ran=[])
        ([], [0, 1, 2, 3])
    """
    ran = set(ran)
    not_run = [index for index in range(len(blocks)) if index not in ran]
    if not ran:
        return [], not_run

    def kind(index: int) -> tuple[str, type]:
        name, module = blocks[index]
        return stack_name(name), original_class(module)

    kinds_that_ran = {kind(index) for index in ran}
    left_out = [index for index in not_run if kind(index) not in kinds_that_ran]
    return left_out, [index for index in not_run if index not in left_out]


def check_not_interleaved(names: list[str], breaks: Iterable[int]) -> None:
    """Raise ``UsageError`` where the blocks named ``names``, in the order they ran, come from
    lists run interleaved (one list's block between two of another's) and, where the run
    passes from one list to another, a block does not take the previous one's output
    (``breaks``: those positions in ``names``): XLM's parallel attention and feed-forward
    lists, with a residual and a layer norm between them.

    Example:
        >>> check_not_interleaved(["attn.0", "mlp.0", "attn.1", "mlp.1"], breaks=[])  # a chain
        >>> check_not_interleaved(["encoder.0", "encoder.1", "decoder.0"], breaks=[2])
        >>> check_not_interleaved(["attn.0", "mlp.0", "attn.1", "mlp.1"], breaks=[1, 2, 3])
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: blocks of several lists, attn, mlp, run interleaved ...
    """
    stacks = [stack_name(name) for name in names]
    runs = [stack for position, stack in enumerate(stacks)
            if position == 0 or stack != stacks[position - 1]]
    if len(runs) == len(set(runs)):
        return  # each list runs through before the next starts
    broken = [names[position] for position in sorted(set(breaks))
              if 0 < position < len(names) and stacks[position] != stacks[position - 1]]
    if not broken:
        return  # interleaved, but each block takes the previous one's output: still a chain
    lists = list(dict.fromkeys(stacks))
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    raise UsageError(
        f"blocks of several lists, {', '.join(lists)}, run interleaved ({shown}), "
        f"and they are no chain: {broken[0]!r} does not take the previous block's output as "
        "its input (the model computes something between them, such as a residual and a "
        "layer norm). Checkpointing plans over a chain of blocks, each taking the previous "
        "one's output, which these lists together are not; pass blocks= with modules that "
        "are: modules that each hold one layer whole (an attention with its feed-forward), or "
        f"one of these lists (blocks='{lists[-1]}'), whose blocks are then checkpointed one "
        "by one"
    )


def stack_name(block_name: str) -> str:
    """The list a block belongs to: its qualified name's parent (``""``: the model itself)."""
    return block_name.rpartition(".")[0]
