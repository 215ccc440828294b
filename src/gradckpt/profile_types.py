"""What a profile knows about a model: per-block sizes and times, and the step as a whole.

``gradckpt.profile`` measures these on a real training step; ``gradckpt.estimate`` will predict
them. The solvers read nothing else, so everything a plan's cost depends on is here, in bytes and
seconds.

Example:
    >>> block = BlockProfile(name="h.0", input_bytes=100, output_bytes=100, saved_bytes=500,
    ...                      input_saved=True, forward_seconds=1.0, backward_seconds=2.0)
    >>> profile = Profile(blocks=[block], peak_bytes=2000, fixed_bytes=1400, step_seconds=3.5)
    >>> Profile.from_json(profile.to_json()) == profile
    True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

__all__ = ["MODELED_TIMES", "PLANNED_POLICY", "BlockProfile", "ChunkedHead", "OpChoice", "Profile",
           "example_block"]


PLANNED_POLICY = "save-matmuls"  # a preset of gradckpt.engine.fates

MODELED_TIMES = "times_modeled"
"""``Profile.notes`` key that ``profile`` sets: True where the times were read on a modeled
clock (``estimate``: the same operations take the same time), False where they were measured on
the wall's. Only measured times carry noise for the solvers to allow for
(``solvers.timing_noise``); a profile without the note (made by hand, or saved before it) is
compared exactly too."""
"""The operation-level policy plans choose from: ``profile`` measures each block under it, and
the optimal solver weighs a segment under it against recomputing everything."""


@dataclass
class OpChoice:
    """The block checkpointed on its own keeping the outputs of some of its operations
    (``policy``, ``"save-ops:..."``) and recomputing the rest, as ``profile`` measured it:

    - ``kept_bytes``: the kept outputs (held from its forward until its recomputation).
    - ``forward_share``: the share of its forward time that the kept operations take, which
      recomputation saves (``gradckpt.op_choices`` turns it into seconds).
    - ``forward_peak_bytes``, ``backward_peak_bytes``: as ``BlockProfile``'s
      ``policy_forward_peak_bytes`` and ``policy_backward_peak_bytes`` for this policy (the
      backward's with ``output_kept_bytes`` in it).
    - ``output_kept_bytes``: the block's own output, where the policy keeps it (its last
      operation's: a ReLU's), which ``kept_bytes`` leaves to the next item; where that item
      saves nothing of it (a pooling), the policy's cache alone holds it until the
      recomputation (``gradckpt.cost`` counts it there).
    """

    policy: str
    kept_bytes: int
    forward_share: float
    forward_peak_bytes: int
    backward_peak_bytes: int
    output_kept_bytes: int = 0


@dataclass
class BlockProfile:
    """One block of the chain, run plainly (no checkpointing).

    - ``input_bytes``: its hidden-state input (what a segment starting here keeps).
    - ``output_bytes``: its hidden-state output (the next block's input, and the size of the
      gradient flowing back into it).
    - ``saved_bytes``: what its autograd graph keeps alive after its forward pass, its input
      included when the graph keeps that (``input_saved``).
    - ``forward_seconds``, ``backward_seconds``: time of its forward and backward pass (as
      ``profile`` measures them, at the pace of the profile's plain steps: the forward timed
      inside them, so it and ``Profile.step_seconds`` share the machine's moments).
    - ``forward_peak_bytes``: the most memory its forward pass holds above what was allocated when
      it started (temporaries, its output and what it saves).
    - ``backward_peak_bytes``: the same for its backward pass, above what was allocated when that
      started (its saved tensors and the incoming gradient are already counted there).
    - ``matmul_bytes``, ``matmul_seconds``: outputs and forward time of its matrix multiplies and
      attention kernels: what ``policy="save-matmuls"`` keeps and then does not recompute.
    - ``saved_bytes_by_op``, ``forward_seconds_by_op``: ``saved_bytes`` and ``forward_seconds``
      by the ATen operation that made them (``"aten.mm"``; ``"input"``: the block's input),
      largest first: what an op-level choice (keep this output, recompute that) weighs.
    - ``kept_bytes_by_op``: what a policy keeping an operation's outputs (``"save-ops:..."``)
      keeps of it in this block: the outputs of all its calls that a policy is asked about
      (no views, no in-place operations). Operations whose outputs the block changes in place
      are left out: keeping them would cost the engine a private copy.
    - ``op_choices``: a few sets of operations to keep (``OpChoice``), measured: the ones
      ``gradckpt.op_choices.menu_of`` finds worth it, which the optimal solver weighs.
    - ``policy_dispatch_seconds``: what a policy's per-operation dispatch adds to the block
      checkpointed alone (its forward and its recomputation): its operations counted times
      this machine's cost per dispatched operation (``engine``'s
      ``dispatch_seconds_per_operation``); 0 for an estimate, whose device hides it.
    - ``gradient_bytes``: the gradients of its trainable parameters, and of the leaves its
      forward makes that need one (a tensor made with ``requires_grad_()``, which the graph
      holds). They appear during its backward pass (inside ``backward_peak_bytes``) and stay
      until the step ends, so they weigh on the backward of every block before it.
    - ``policy_forward_peak_bytes``, ``policy_backward_peak_bytes``, ``policy_extra_seconds``:
      the block checkpointed on its own with ``policy="save-matmuls"``, measured: its forward's
      peak above its input (the kept outputs included), its backward's peak, recomputation
      included, above what exists when that starts (its input, the kept outputs, the incoming
      gradient), and how much longer its forward and backward take than the plain block's.
      ``None`` (not measured, e.g. a hand-made profile): the cost model bounds them from the
      plain numbers above.
    - ``checkpointed_forward_peak_bytes``, ``checkpointed_backward_peak_bytes``: the same for
      the block checkpointed on its own without a policy: its forward's peak above its input
      (nothing saved: far below ``forward_peak_bytes``), and its backward's peak, the
      recomputation included, above what exists when that starts (its input and the incoming
      gradient). ``None``: bounded from the plain numbers.
    - ``checkpointed_extra_seconds``: how much longer its forward and backward take checkpointed
      alone than plain: its recomputation as the engine runs it (about 1.1x its forward on a
      CPU, for gradckpt and ``torch.utils.checkpoint`` alike). ``None``: ``forward_seconds``.
    - ``side_bytes``: tensors the chain's graph saves that no block made and that are no
      block's hidden state, passed to this block first: the encoder output every decoder block
      reads (their cross-attention saves it), a Llama's rotary cos/sin. Several blocks save the
      same tensor, but it exists once, and checkpointing does not free it (a segment keeps its
      blocks' inputs), so it is counted once, here, and in no block's ``saved_bytes``: retained
      from this block's forward (at the top of the chain: from the forward of the segment
      holding this block) until that block's or segment's backward, whatever the plan. After a
      chain break it also holds what the modules between the two parts saved (an encoder's
      final norm), which lives just as long.
    - ``side_gradient_bytes``: gradients made outside the blocks' own parameters that are alive
      when its backward starts: a side input's, made by the backward of the last block taking
      the tensor, summed into by the others', freed after the first one's (the encoder
      output's gradient across a decoder's backward), or after the backward of the block that
      returned it (T5's position bias, made by a stack's first block); and those of the modules
      between two
      parts of the chain (a decoder's position embedding), made once the later part's
      backward is done. Besides gradients, a saved side input that the step's output holds
      (an encoder's last hidden state in a Hugging Face ``Seq2SeqLMOutput``) counts here in the
      blocks before its first taker: it outlives its takers' backward.
    - ``held_side_bytes``: side inputs no block saves, passed to this block first (T5's
      position bias, which its stacks' first block makes and every later one adds to its
      attention scores; attention masks). The plain model frees them after its forward; a
      checkpointed segment keeps them until its backward, since its recomputation needs them.
      So with any segment in the plan they count like ``side_bytes``; with none, not at all.
      An upper bound where this block is kept: then they live, in fact, until the backward
      of the first checkpointed block taking them, if any.
    - ``output_saved``: its graph saves its output (a CNN block ending in ReLU saves what
      it returns), which is among its ``saved_bytes``. That output is the next block's input,
      the same tensor: kept after this block, the next block retains nothing more for its
      input, and a segment starting there keeps it at no cost (``Profile.input_held``).
    - ``returned_bytes``: the tensors it returns besides its hidden state (a decoder layer's
      attention weights), no block's side input: the model's loop holds them with the
      hidden state (``outputs = layer(...)``) until the next block returns. Kept, the block's
      graph saves them (the attention weights feed the matmul with the values); in a
      checkpointed segment nothing else holds them, and they count during the next block's
      forward (``cost.returned_alive``).
    - ``argument_stored_bytes``: tensors its forward leaves in an object it was passed (not a
      tensor: Gemma 4's dictionary of key/value states that later layers share). A
      checkpointed segment holds its blocks' arguments for recomputation, that object too, so
      what is stored there lives until the backward of the first checkpointed block taking
      it: counted, like the side inputs no block saves, in ``held_side_bytes`` of the first
      block taking the object (``measure.side_inputs``).
    """

    name: str
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    input_saved: bool
    forward_seconds: float
    backward_seconds: float
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    matmul_bytes: int = 0
    matmul_seconds: float = 0.0
    gradient_bytes: int = 0
    saved_bytes_by_op: dict[str, int] = field(default_factory=dict)
    forward_seconds_by_op: dict[str, float] = field(default_factory=dict)
    kept_bytes_by_op: dict[str, int] = field(default_factory=dict)
    op_choices: list[OpChoice] = field(default_factory=list)
    policy_dispatch_seconds: float = 0.0
    policy_forward_peak_bytes: int | None = None
    policy_backward_peak_bytes: int | None = None
    policy_extra_seconds: float | None = None
    checkpointed_forward_peak_bytes: int | None = None
    checkpointed_backward_peak_bytes: int | None = None
    checkpointed_extra_seconds: float | None = None
    side_bytes: int = 0
    side_gradient_bytes: int = 0
    held_side_bytes: int = 0
    output_saved: bool = False
    returned_bytes: int = 0
    argument_stored_bytes: int = 0

    def recompute_seconds(self) -> float:
        """Extra seconds each time a segment recomputes this block: measured, or its forward.

        Example:
            >>> example_block(forward_seconds=2.0).recompute_seconds()
            2.0
            >>> example_block(forward_seconds=2.0, checkpointed_extra_seconds=2.2
            ...               ).recompute_seconds()
            2.2
        """
        if self.checkpointed_extra_seconds is None:
            return self.forward_seconds
        return self.checkpointed_extra_seconds

    def policy_recompute_seconds(self) -> float:
        """Extra seconds of this block checkpointed under ``"save-matmuls"``: measured, or its
        forward minus the matmuls it keeps.

        Example:
            >>> example_block(forward_seconds=3.0, matmul_seconds=2.0).policy_recompute_seconds()
            1.0
        """
        if self.policy_extra_seconds is not None:
            return self.policy_extra_seconds
        return self.forward_seconds - self.matmul_seconds

    def segment_forward_peak_bytes(self) -> int:
        """The most its forward holds above its input inside a checkpointed segment (which
        saves nothing): measured, or ``forward_peak_bytes`` (which counts what it saves: an
        upper bound).

        Example:
            >>> example_block(forward_peak_bytes=90, checkpointed_forward_peak_bytes=30
            ...               ).segment_forward_peak_bytes()
            30
        """
        if self.checkpointed_forward_peak_bytes is None:
            return self.forward_peak_bytes
        return self.checkpointed_forward_peak_bytes

    def policy_transient_bytes(self) -> int:
        """Checkpointed alone under ``"save-matmuls"``: the most its forward holds above its
        input and its kept outputs. Unmeasured: ``forward_peak_bytes``, which counts the kept
        outputs a second time (an upper bound)."""
        if self.policy_forward_peak_bytes is None:
            return self.forward_peak_bytes
        return max(self.policy_forward_peak_bytes - self.matmul_bytes, 0)


@dataclass
class ChunkedHead:
    """The step measured again with its output head and loss in chunks of tokens
    (``gradckpt.linear_cross_entropy``: each chunk's logits made in forward, freed, made again
    in backward), what a plan may choose instead of the plain head. The fields are the
    ``Profile`` fields of the same names for that step (its other fields do not change), plus:

    - ``name``: the head module's qualified name in the model (``"lm_head"``).
    - ``chunks``: how many pieces the tokens are cut into.
    - ``extra_seconds``: how much longer the head and loss take, forward and backward, than
      the plain head's: the head's forward again, and a little per chunk (timed side by side
      with the plain head in the same steps for the fewest and the most chunks measured,
      in proportion to the chunk count in between).
    """

    name: str
    chunks: int
    head_bytes: int
    head_gradient_bytes: int
    other_peak_bytes: int
    optimizer_step_bytes: int
    previous_output_bytes: int
    peak_bytes: int
    extra_seconds: float


@dataclass
class Profile:
    """A model's chain of blocks plus the step around it.

    - ``peak_bytes``: the peak memory of one training step without checkpointing, in the
      steady state of the loop (from step 2 on: the optimizer's state exists, and with
      accumulation the earlier micro-batches' gradients): what a percentage budget is of.
    - ``fixed_bytes``: what is allocated throughout the step whatever the plan: parameters,
      buffers, the inputs, the optimizer's state (``optimizer_state_bytes``) and, with
      gradient accumulation, the gradients held between micro-batches
      (``accumulated_gradient_bytes``). A plan's predicted peak is this plus the peak
      ``gradckpt.cost.simulate`` finds above it.
    - ``step_seconds``: the measured time of one training step without checkpointing.
    - ``head_bytes``: the most memory the part of the step after the chain (output head, loss
      and their backward, up to the chain's output gradient) holds above ``fixed_bytes`` and
      what the chain retains for backward: the logits and their gradient, mostly.
    - ``head_gradient_bytes``: what that part leaves allocated while the chain's backward runs
      (the head's parameter gradients).
    - ``other_peak_bytes``: the highest point, above ``fixed_bytes``, of the step outside the
      chain's activations (before the chain, and after its backward: the embedding's backward
      with every gradient allocated). Plans do not change it.
    - ``chain_breaks``: the blocks i whose hidden-state input is not block i - 1's output (an
      encoder's last layer and a decoder's first: something runs between them). No segment may
      span such a pair: its recomputation feeds each block the previous one's output.
    - ``chain_input_fixed``: the first block's input is a tensor of the sample (a CNN's
      images), counted in ``fixed_bytes``: the chain retains nothing more for it, whether the
      first block saves it or a segment starting there keeps it (``input_held(0)``).
    - ``optimizer_state_bytes``: the optimizer's state (Adam's two moments per trainable
      parameter), alive from the first ``optimizer.step()`` on; part of ``fixed_bytes``.
    - ``accumulated_gradient_bytes``: with gradient accumulation, the gradients the earlier
      micro-batches leave alive through each later one (an upper bound: counted all step,
      though the measured step also makes them); part of ``fixed_bytes``.
    - ``optimizer_step_bytes``: the highest point of ``optimizer.step()`` above
      ``fixed_bytes``: every gradient, the output the loop still holds, and the optimizer's
      own temporaries (measured by running the optimizer on fake copies of the parameters).
      Plans do not change it. 0: no optimizer step planned.
    - ``previous_output_bytes``: the previous step's output, which a loop writing
      ``out = model(**batch)`` holds until the model returns the next one: alive through
      the chain's forward and the head's (0 with ``keep_output=False``).
    - ``before_chain_bytes``: what the modules before the chain hold when its first block
      starts, its input and side inputs aside: what the embeddings save for backward (a
      BERT-like stem's layer norm input and dropout mask). Alive through the chain's
      forward; the head's and the backward's phases count it already (in ``head_bytes`` and
      ``head_gradient_bytes``, as measured).
    - ``chunked_heads``: the step with its output head and loss in chunks, measured for a few
      chunk counts (``ChunkedHead``, fewest chunks first), when the loss runs through
      ``gradckpt.linear_cross_entropy`` (a Hugging Face causal language model's does, given
      ``labels``); empty when it cannot (``notes["chunked_head"]`` says why).
      ``with_chunked_head(chunks)`` is the profile of that step.
    """

    blocks: list[BlockProfile]
    peak_bytes: int
    fixed_bytes: int
    step_seconds: float
    device: str = "cpu"
    notes: dict[str, Any] = field(default_factory=dict)
    head_bytes: int = 0
    head_gradient_bytes: int = 0
    other_peak_bytes: int = 0
    chain_breaks: list[int] = field(default_factory=list)
    chain_input_fixed: bool = False
    optimizer_state_bytes: int = 0
    accumulated_gradient_bytes: int = 0
    optimizer_step_bytes: int = 0
    previous_output_bytes: int = 0
    chunked_heads: list[ChunkedHead] = field(default_factory=list)
    before_chain_bytes: int = 0

    def chunked_head(self, chunks: int) -> ChunkedHead:
        """The measured step with the head's loss in ``chunks`` pieces (``chunked_heads``).

        Example:
            >>> head = ChunkedHead("lm_head", 8, head_bytes=40, head_gradient_bytes=0,
            ...                    other_peak_bytes=0, optimizer_step_bytes=0,
            ...                    previous_output_bytes=0, peak_bytes=1100, extra_seconds=0.5)
            >>> profile = Profile([example_block()], 1500, 1000, 4.0, chunked_heads=[head])
            >>> profile.chunked_head(8).head_bytes
            40
            >>> profile.chunked_head(4)
            Traceback (most recent call last):
            ...
            gradckpt.errors.UsageError: this profile measured the head's loss in 8 chunks, ...
        """
        for head in self.chunked_heads:
            if head.chunks == chunks:
                return head
        if not self.chunked_heads:
            raise UsageError("this profile has no chunked head: "
                             f"{self.notes.get('chunked_head', 'not measured')}")
        measured = ", ".join(str(head.chunks) for head in self.chunked_heads)
        raise UsageError(f"this profile measured the head's loss in {measured} chunks, not "
                         f"{chunks}; plan with one of those")

    def with_chunked_head(self, chunks: int) -> Profile:
        """This profile as the step with its head's loss in ``chunks`` pieces: the head's, the
        step's outside parts and the output's bytes replaced by that step's measured ones
        (``chunked_head(chunks)``), the chain's the same. The solvers take it like any
        profile; the head's extra time is not in it (``gradckpt.cost.plan_for`` adds it).

        Example:
            >>> head = ChunkedHead("lm_head", 8, head_bytes=40, head_gradient_bytes=0,
            ...                    other_peak_bytes=0, optimizer_step_bytes=0,
            ...                    previous_output_bytes=0, peak_bytes=1100, extra_seconds=0.5)
            >>> profile = Profile([example_block()], 1500, 1000, 4.0, head_bytes=400,
            ...                   chunked_heads=[head])
            >>> profile.with_chunked_head(8).head_bytes
            40
        """
        head = self.chunked_head(chunks)
        return dataclasses.replace(
            self, head_bytes=head.head_bytes, head_gradient_bytes=head.head_gradient_bytes,
            other_peak_bytes=head.other_peak_bytes,
            optimizer_step_bytes=head.optimizer_step_bytes,
            previous_output_bytes=head.previous_output_bytes, peak_bytes=head.peak_bytes,
        )

    def segment_end_limit(self, start: int) -> int:
        """The last block a segment starting at block ``start`` may reach: the one before the
        next chain break, or the chain's last block.

        Example:
            >>> blocks = [example_block(f"h.{i}", input_bytes=1, output_bytes=1, saved_bytes=1,
            ...                         backward_seconds=1.0) for i in range(5)]
            >>> profile = Profile(blocks, 0, 0, 1.0, chain_breaks=[3])
            >>> profile.segment_end_limit(0), profile.segment_end_limit(3)
            (2, 4)
        """
        following = [index for index in self.chain_breaks if index > start]
        return (min(following) if following else len(self.blocks)) - 1

    def input_held(self, index: int) -> bool:
        """Whether block ``index``'s input is retained already when it runs: by the block
        before it, when that one is kept and its graph saves its output
        (``BlockProfile.output_saved``) and the chain does not break between them; for the
        first block, when its input is part of the sample (``chain_input_fixed``).

        Example:
            >>> blocks = [example_block(f"h.{i}", input_bytes=1, output_bytes=1, saved_bytes=1,
            ...                         backward_seconds=1.0, output_saved=True) for i in range(3)]
            >>> profile = Profile(blocks, 0, 0, 1.0, chain_breaks=[2])
            >>> [profile.input_held(i) for i in range(3)]
            [False, True, False]
        """
        if index == 0:
            return self.chain_input_fixed
        return (0 < index < len(self.blocks) and index not in self.chain_breaks
                and self.blocks[index - 1].output_saved)

    def plain_retained_bytes(self) -> int:
        """What the chain retains for backward after a forward without checkpointing: every
        block's saved tensors and side inputs, each tensor once (a block's saved input that
        the block before saved as its output counts there).

        Example:
            >>> blocks = [example_block(f"h.{i}", backward_seconds=1.0, output_saved=True)
            ...           for i in range(3)]
            >>> Profile(blocks, 0, 0, 1.0).plain_retained_bytes()  # 3 x 50, two inputs shared
            130
        """
        return sum(
            block.saved_bytes + block.side_bytes
            - (block.input_bytes if block.input_saved and self.input_held(index) else 0)
            for index, block in enumerate(self.blocks)
        )

    def validate(self) -> None:
        """Raise ``UsageError`` naming the first block whose numbers cannot be right.

        Sizes and times are not negative; a block whose graph saves its input saves at least
        its input's bytes; matmuls take no more than the whole forward pass. (``profile``
        always measures consistent numbers; this catches hand-made and edited profiles.)

        Example:
            >>> block = example_block(input_bytes=100, saved_bytes=50)
            >>> Profile([block], 0, 0, 1.0).validate()
            Traceback (most recent call last):
            ...
            gradckpt.errors.UsageError: block h.0: saved_bytes (50) is below input_bytes (100) ...
        """
        for name in ("head_bytes", "head_gradient_bytes", "other_peak_bytes",
                     "optimizer_state_bytes", "accumulated_gradient_bytes",
                     "optimizer_step_bytes", "previous_output_bytes"):
            if getattr(self, name) < 0:
                raise UsageError(f"profile {name} is negative ({getattr(self, name)}); fix the "
                                 "profile or re-measure it with gradckpt.profile")
        for head in self.chunked_heads:
            if head.chunks < 2 or min(
                    head.head_bytes, head.head_gradient_bytes, head.other_peak_bytes,
                    head.optimizer_step_bytes, head.previous_output_bytes, head.peak_bytes,
                    head.extra_seconds) < 0:
                raise UsageError(f"profile chunked_heads has a negative number or fewer than "
                                 f"2 chunks ({head}); fix the profile or re-measure it with "
                                 "gradckpt.profile")
        if any(not 0 < index < len(self.blocks) for index in self.chain_breaks):
            raise UsageError(f"profile chain_breaks {self.chain_breaks} must be block indices "
                             f"1..{len(self.blocks) - 1}; fix the profile or re-measure it with "
                             "gradckpt.profile")
        for block in self.blocks:
            problem = _inconsistency(block)
            if problem:
                raise UsageError(f"block {block.name}: {problem}; fix the profile or re-measure "
                                 "it with gradckpt.profile")

    def to_json(self) -> str:
        """The profile as a JSON string (``Profile.from_json`` reads it back)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Read a profile written by ``to_json``."""
        try:
            data = json.loads(text)
            blocks = [
                BlockProfile(**{**block, "op_choices": [
                    OpChoice(**choice) for choice in block.get("op_choices", [])]})
                for block in data.pop("blocks")
            ]
            heads = [ChunkedHead(**head) for head in data.pop("chunked_heads", [])]
            return cls(blocks=blocks, chunked_heads=heads, **data)
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise UsageError(
                f"not a gradckpt profile (JSON from Profile.to_json()): {error}"
            ) from None


def _inconsistency(block: BlockProfile) -> str | None:
    for name in ("input_bytes", "output_bytes", "saved_bytes", "forward_peak_bytes",
                 "backward_peak_bytes", "matmul_bytes", "forward_seconds", "backward_seconds",
                 "matmul_seconds", "gradient_bytes", "side_bytes",
                 "side_gradient_bytes", "held_side_bytes", "returned_bytes",
                 "argument_stored_bytes"):
        if getattr(block, name) < 0:
            return f"{name} is negative ({getattr(block, name)})"
    for name in ("policy_forward_peak_bytes", "policy_backward_peak_bytes",
                 "policy_extra_seconds", "checkpointed_forward_peak_bytes",
                 "checkpointed_backward_peak_bytes", "checkpointed_extra_seconds"):
        if (getattr(block, name) or 0) < 0:
            return f"{name} is negative ({getattr(block, name)})"
    if block.input_saved and block.saved_bytes < block.input_bytes:
        return (f"saved_bytes ({block.saved_bytes}) is below input_bytes ({block.input_bytes}) "
                "though input_saved says the input is among them")
    if block.output_saved and block.saved_bytes < block.output_bytes:
        return (f"saved_bytes ({block.saved_bytes}) is below output_bytes "
                f"({block.output_bytes}) though output_saved says the output is among them")
    if block.matmul_seconds > block.forward_seconds * (1 + 1e-9):
        return (f"matmul_seconds ({block.matmul_seconds}) exceeds forward_seconds "
                f"({block.forward_seconds}), of which matmuls are a part")
    return None


def example_block(name: str = "h.0", **fields: Any) -> BlockProfile:
    """A block for examples and tests, every number named: 10 bytes in and 10 out, 50 saved
    (its input among them), a 1 s forward and a 2 s backward, unless ``fields`` say otherwise.

    Example:
        >>> block = example_block("h.1", saved_bytes=80)
        >>> block.name, block.input_bytes, block.saved_bytes, block.backward_seconds
        ('h.1', 10, 80, 2.0)
    """
    numbers: dict[str, Any] = {
        "input_bytes": 10, "output_bytes": 10, "saved_bytes": 50, "input_saved": True,
        "forward_seconds": 1.0, "backward_seconds": 2.0,
    }
    numbers.update(fields)
    return BlockProfile(name=name, **numbers)
