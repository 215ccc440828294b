"""What the cost model reads of each block beside its own profile: the gradients alive when
its backward starts, the side inputs and returned tensors held around it, and the output an
op-level choice keeps of it (shared by the walk and the solvers' chain costs)."""

from __future__ import annotations

from ..engine.fates import OFFLOAD_OPS, operations_kept_by, save_ops_policy_name
from ..op_choices import policy_cost
from ..profile_types import BlockProfile, Profile


def gradients_after(profile: Profile) -> list[int]:
    """Per block i, the gradients allocated when its backward starts: the parameter gradients
    of the head and of every later block (gradients start the step as None), and those of
    side inputs later blocks took too (``BlockProfile.side_gradient_bytes``).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", gradient_bytes=10) for i in range(3)]
        >>> gradients_after(Profile(blocks, 0, 0, 1.0, head_gradient_bytes=5))
        [25, 15, 5]
    """
    after = [0] * len(profile.blocks)
    total = profile.head_gradient_bytes
    for index in range(len(profile.blocks) - 1, -1, -1):
        after[index] = total + profile.blocks[index].side_gradient_bytes
        total += profile.blocks[index].gradient_bytes
    return after


def side_inputs_held(profile: Profile, checkpointing: bool) -> list[int]:
    """Per block, the side inputs counted in it (``BlockProfile.side_bytes``), plus, when the
    plan checkpoints anything, those no block saves (``held_side_bytes``): a segment keeps
    them for its recomputation, the plain model frees them after its forward.

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> blocks = [example_block("h.0", side_bytes=4), example_block("h.1", held_side_bytes=8)]
        >>> profile = Profile(blocks, 0, 0, 1.0)
        >>> side_inputs_held(profile, False), side_inputs_held(profile, True)
        ([4, 0], [4, 8])
    """
    return [block.side_bytes + (block.held_side_bytes if checkpointing else 0)
            for block in profile.blocks]


def returned_alive(profile: Profile) -> list[int]:
    """Per block, the tensors the block before it returned besides its hidden state
    (``BlockProfile.returned_bytes``), which the model's loop holds while this block runs
    forward: they count there when that block is checkpointed (kept, its graph saves them).
    None after a chain break, where the loop that held them has ended.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", returned_bytes=8) for i in range(3)]
        >>> returned_alive(Profile(blocks, 0, 0, 1.0)), returned_alive(
        ...     Profile(blocks, 0, 0, 1.0, chain_breaks=[2]))
        ([0, 8, 8], [0, 8, 0])
    """
    return [0] + [
        0 if index in profile.chain_breaks else profile.blocks[index - 1].returned_bytes
        for index in range(1, len(profile.blocks))
    ]


def output_kept_bytes(
    block: BlockProfile, policy: str, host_link_bytes_per_second: float | None = None
) -> int:
    """Of the outputs ``policy`` keeps of ``block`` checkpointed, its own output's bytes
    (``OpChoice.output_kept_bytes``, measured with the choice; 0 where not measured). An
    ``"offload-ops:..."`` policy keeps them on the device only where there is no host link to
    offload over (the CPU: the engine keeps them there), as the ``"save-ops:..."`` choice of
    the same operations does; over a link, they wait on the host.

    Example:
        >>> from gradckpt.profile_types import OpChoice, example_block
        >>> block = example_block(op_choices=[OpChoice("save-ops:aten.relu", 0, 0.1, 20, 30, 10)])
        >>> output_kept_bytes(block, "save-ops:aten.relu"), output_kept_bytes(block, "save-matmuls")
        (10, 0)
        >>> [output_kept_bytes(block, "offload-ops:aten.relu", link) for link in (None, 20e9)]
        [10, 0]
    """
    if policy.startswith(OFFLOAD_OPS):
        if host_link_bytes_per_second:
            return 0
        policy = save_ops_policy_name(operations_kept_by(policy))
    name = policy_cost(block, policy).policy
    return next((choice.output_kept_bytes for choice in block.op_choices
                 if choice.policy == name), 0)
