"""Finding the chain of blocks that checkpointing works on.

Checkpointing plans are made over a *chain*: blocks that run one after another in the forward
pass, each taking the previous one's output (a transformer's layers, the stages of a CNN). Most
models hold that chain in one container, so ``find_blocks`` looks for it there:

1. A *stack* is an ``nn.ModuleList`` or ``nn.Sequential`` whose children are 2 or more modules of
   one class (``model.layers`` of Llama, ``transformer.h`` of GPT-2, ``encoder.layer`` of BERT).
   The model itself counts when it is such a container. A module wrapped by
   ``gradckpt.checkpoint_module`` counts as its original class.
   An ``nn.ModuleList`` of 2 or more modules of *several* classes (a hybrid model's layers:
   attention and linear-attention or state-space layers, or cross-attention layers between
   self-attention ones, in one ``model.layers``) is a stack too when it is the *main* one: it
   holds more parameters than every one-class stack outside it. Its children are the blocks,
   each layer whole (an attention layer with its feed-forward). Smaller lists of several
   classes are parts of something else (the sub-layers of a T5 block); an ``nn.Sequential`` of
   several classes inside a model is most often a small pipeline (an MLP, a classifier head)
   and counts only as the model itself (rule 5).
2. Only the outermost stacks count: a stack inside another stack's blocks (the list of sub-layers
   inside a T5 block, the experts inside a mixture-of-experts layer) is part of those blocks.
   Except in a stack of *stages*, whose blocks are the stages' layers, every layer of every
   stage in turn: a list of lists of one class (PoolFormer's and PVT's ``encoder.block[i][j]``;
   a list cannot be called, so it is no block), or a stack whose every block holds, among its
   own children, exactly one list of one class (Swin's ``layers[i].blocks`` beside its patch
   merging, SegFormer's ``stages[i].blocks`` beside its patch embeddings and norm, ConvNeXt's
   and ResNet's ``stages[i].layers``), where the blocks differ (parameters of other names or
   shapes: stages of several widths) and those lists hold more than half of the stack's
   parameters. Blocks all alike are the repeated layers themselves, a list in each a part of
   it (a residual block's body, run between the block's input and its sum with it), and so
   is a list holding less than half (MobileBERT's feed-forward layers beside its attention).
   What a stage runs besides its layers (downsampling, patch merging or embeddings, a norm)
   runs between the last layer of one stage and the first of the next: the recording sees
   that the next layer does not take the previous one's output (a chain break,
   ``Profile.chain_breaks``), and no segment spans it. Lists beside a list of stages, in the
   same module, with one module per stage and fewer parameters (PoolFormer's and PVT's
   per-stage ``encoder.patch_embeddings``, run between the stages) are such parts, not a
   stack of the chain. Only one level is opened: the layers' own lists (the convolutions of a
   ResNet bottleneck) are parts of the layers.
3. The *main* stack is the one whose blocks hold the most parameters. Every other stack is
   returned too when it holds at least a tenth of the main stack's parameters, so that
   encoder-decoder models (T5, BART, Whisper) give their encoder's and their decoder's layers,
   or when its blocks are of the main stack's classes, so that a ResNet gives all four of its
   stages although the early ones hold few parameters (they hold most of the activations). Small
   lists of other modules beside the main stack (per-codebook embeddings or output heads, which
   run side by side rather than one after another) are left out.
4. Stacks come in the order they first appear in ``model.named_modules()``, which is the order
   their modules were created in ``__init__``. In Hugging Face encoder-decoder models that is
   the execution order, encoder first (the tests check it by running the models). Nothing but
   running the model can tell the order of stacks that are not one after another in the code:
   CLIP creates its text tower first but runs its vision tower first. Given a ``sample``,
   ``find_blocks`` runs the forward pass once without grad, with a forward pre-hook on the
   blocks of every stack, and returns the blocks in the order they first ran; the model's
   buffers and the RNG state are put back afterwards. Rules 1-3 then choose among the stacks
   that ran: a whole stack that does not run on the sample (the vision tower of a multimodal
   model given text only) is left out, and so are the layers of one class in a list of several
   when none of them runs (Mllama's cross-attention layers, given no image). A stack that runs
   only partly (some of its blocks of one class run, some not) raises ``UsageError`` naming
   the blocks that did not run, and so does a sample on which no stack runs. ``profile`` (and
   so ``enable`` and ``estimate``) records its step with the blocks found by structure and
   applies the same rule to them; where none of them ran (a vision tower that outweighs the
   language model, chosen by structure, given text) it takes the chain ``find_blocks(model,
   sample)`` finds instead, and measures that: two more forward passes (the recording step
   that shows it, and that run), for such models only.
   Given ``blocks=`` of which none ran, it names the stacks that ``find_blocks`` finds
   running.
5. No stack, but the model itself is an ``nn.Sequential`` of 2 or more children of different
   classes (``Linear, ReLU, Linear``): its children are the chain, since a Sequential runs them
   one after another by definition.

Run on a sample, the blocks of two or more lists can turn out to run *interleaved*: XLM keeps
its attention layers, feed-forward layers and layer norms in parallel lists and runs
``attentions[i]``, then ``ffns[i]``, then ``attentions[i + 1]``. Where each block takes the one
before's output they are still a chain, in run order. Where they do not (XLM adds a residual
and a layer norm between them), they are no chain that can be cut into segments, and
``UsageError`` names the lists before any block is measured or checkpointed.

Anything else (a single layer, blocks in an ``nn.ModuleDict``) raises ``UsageError``; pass the
chain yourself as ``blocks=``, which ``resolve_blocks`` checks and turns into ``(name, module)``
pairs.

Example:
    >>> import torch
    >>> from gradckpt.measure import find_blocks
    >>> from gradckpt.toy_models import GPTConfig, TinyGPT
    >>> model = TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))
    >>> [name for name, _ in find_blocks(model)]
    ['transformer.h.0', 'transformer.h.1', 'transformer.h.2']
    >>> hybrid = torch.nn.Module()  # layers of several classes in one list (rule 1)
    >>> hybrid.layers = torch.nn.ModuleList(
    ...     [torch.nn.Linear(8, 8), torch.nn.GRU(8, 8), torch.nn.Linear(8, 8)])
    >>> [name for name, _ in find_blocks(hybrid)]
    ['layers.0', 'layers.1', 'layers.2']
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..ecosystem_hooks import ecosystem_hooks_on
from ..engine import first_tensor
from ..engine.segments import is_alias
from ..errors import UsageError, did_you_mean
from .model_state import buffers_and_rng_preserved
from .stacks import (
    candidate_stacks,
    chosen_stacks,
    original_class,
    stack_blocks,
)
from .step import run_model

__all__ = ["NoneOfTheBlocksRan", "chain_that_runs", "find_blocks", "resolve_blocks"]

_HOW_TO_PASS_BLOCKS = (
    "pass the blocks yourself, in the order the forward pass runs them, as blocks= to "
    "gradckpt.profile(), estimate() or enable(): a list of modules (blocks=[model.encoder, "
    "model.decoder]), of qualified names as in model.named_modules() "
    "(blocks=['encoder', 'decoder']), or an nn.ModuleList (blocks=model.layers)"
)


def find_blocks(model: nn.Module, sample: Any = None) -> list[tuple[str, nn.Module]]:
    """The model's chain of repeated blocks, as ``(qualified_name, module)`` in execution order.

    Names are as in ``model.named_modules()``. How the chain is found is described at the top of
    this module; a model without one raises ``UsageError`` explaining how to pass ``blocks=``.

    Without ``sample``, stacks come in the order they were created (rule 4). With ``sample``
    (a tensor, a tuple of positional arguments or a dict of keywords, as ``gradckpt.profile``
    takes it), the model runs its forward pass on it once under ``torch.no_grad()`` and the
    blocks come in the order they first ran. The run leaves no trace: buffers (BatchNorm's
    running statistics) and the CPU and CUDA RNG state are put back, hooks removed, and the
    registered ecosystem hooks (``gradckpt.ecosystem_hooks``: Hugging Face caches off) run
    meanwhile. The stacks are chosen among those that ran (a vision tower given text is left
    out); blocks of a stack that ran partly raise ``UsageError``, naming them, and so do lists
    run interleaved that are no chain.

    Example:
        >>> import torch
        >>> from gradckpt.toy_models import mlp_chain
        >>> [name for name, _ in find_blocks(mlp_chain(depth=3, width=8))]
        ['0', '1', '2']
        >>> encoder = torch.nn.TransformerEncoder(
        ...     torch.nn.TransformerEncoderLayer(16, 2), num_layers=2, enable_nested_tensor=False)
        >>> [name for name, _ in find_blocks(encoder)]
        ['layers.0', 'layers.1']
        >>> class TwoTowers(torch.nn.Module):  # like CLIP: text made first, vision run first
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.text = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        ...         self.vision = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        ...     def forward(self, x):
        ...         return self.text(self.vision(x))
        >>> [name for name, _ in find_blocks(TwoTowers())]
        ['text.0', 'text.1', 'vision.0', 'vision.1']
        >>> [name for name, _ in find_blocks(TwoTowers(), sample=torch.ones(2, 4))]
        ['vision.0', 'vision.1', 'text.0', 'text.1']
        >>> find_blocks(torch.nn.Linear(4, 4))
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: find_blocks() found no chain of blocks in Linear: ...
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"find_blocks() needs a torch.nn.Module, got {type(model).__name__}")
    if sample is None:
        return _blocks_of(chosen_stacks(model), model)
    return _blocks_that_run(model, sample)


def _blocks_of(stacks: list[tuple[str, nn.Module]], model: nn.Module
               ) -> list[tuple[str, nn.Module]]:
    """The children of ``stacks``, as ``(qualified_name, module)``; ``UsageError`` where there
    are no stacks."""
    if not stacks:
        raise UsageError(
            f"find_blocks() found no chain of blocks in {type(model).__name__}: it looks for an "
            "nn.ModuleList or nn.Sequential holding 2 or more modules of the same class (such "
            "as model.layers or transformer.h in Hugging Face models), or a model that is "
            f"itself an nn.Sequential of 2 or more modules; {_HOW_TO_PASS_BLOCKS}"
        )
    return [block for name, stack in stacks for block in stack_blocks(name, stack)]


def resolve_blocks(
    model: nn.Module, blocks: Iterable[nn.Module | str] | nn.Module | str | None = None
) -> list[tuple[str, nn.Module]]:
    """Turn a user's ``blocks=`` into ``(qualified_name, module)`` pairs, in the order given.

    ``blocks`` may be:

    - ``None``: the chain ``find_blocks(model)`` finds;
    - a list (or tuple) of submodules of ``model`` and/or their qualified names as in
      ``model.named_modules()``;
    - an ``nn.ModuleList`` or ``nn.Sequential`` (its children are the blocks), or the qualified
      name of one (``"model.layers"``).

    The order given is taken to be the execution order. Every block must be a submodule of
    ``model`` (not the model itself), listed once, and no block may lie inside another.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> [name for name, _ in resolve_blocks(model, ["0", model[2]])]
        ['0', '2']
        >>> resolve_blocks(model, ["3"])
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: blocks=: item 0, '3', is not a submodule of Sequential; ...
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"resolve_blocks() needs a torch.nn.Module, got {type(model).__name__}")
    if blocks is None:
        return find_blocks(model)

    names_by_id = {id(module): name for name, module in model.named_modules() if name}

    if isinstance(blocks, str):  # the name of a container, whose children are the blocks
        container = _module_by_name(model, blocks, what=f"blocks={blocks!r}")
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise UsageError(
                f"blocks={blocks!r} names a {type(container).__name__}, not an nn.ModuleList "
                f"or nn.Sequential whose children could be the blocks; to use this one module "
                f"as the only block write blocks=[{blocks!r}]"
            )
        blocks = list(container.children())
    elif isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        blocks = list(blocks.children())
    elif isinstance(blocks, nn.Module):
        raise UsageError(
            f"blocks= got a single {type(blocks).__name__}; pass a list of blocks "
            f"(blocks=[module, ...]) or an nn.ModuleList / nn.Sequential holding them"
        )
    elif isinstance(blocks, Iterable) and not isinstance(blocks, (bytes, dict)):
        blocks = list(blocks)
    else:
        raise UsageError(
            f"blocks= must be None, a list of modules or qualified names, or an nn.ModuleList; "
            f"got {type(blocks).__name__}"
        )
    if not blocks:
        raise UsageError(f"blocks= is empty; {_HOW_TO_PASS_BLOCKS}")

    resolved: list[tuple[str, nn.Module]] = []
    for index, item in enumerate(blocks):
        if isinstance(item, str):
            module = _module_by_name(model, item, what=f"blocks=: item {index}, {item!r},")
        elif isinstance(item, nn.Module):
            module = item
        else:
            raise UsageError(
                f"blocks=: item {index} has type {type(item).__name__}; each block must be a "
                f"submodule of the model or its qualified name (a str)"
            )
        if module is model:
            raise UsageError(
                f"blocks=: item {index} is the model itself; the blocks are the parts of the "
                f"model that run one after another (e.g. its layers)"
            )
        if id(module) not in names_by_id:
            raise UsageError(
                f"blocks=: item {index}, a {type(module).__name__}, is not a submodule of "
                f"{type(model).__name__} (compared by identity: a copy of a layer does not "
                f"count); pass modules taken from the model, or their names"
            )
        resolved.append((names_by_id[id(module)], module))

    names = [name for name, _ in resolved]
    for position, name in enumerate(names):
        if name in names[:position]:
            raise UsageError(f"blocks=: {name!r} is listed twice; each block runs once per step")
        for other in names:
            if other.startswith(name + "."):
                raise UsageError(
                    f"blocks=: {other!r} lies inside {name!r}; blocks must not contain one "
                    f"another (list either the outer block or the inner ones)"
                )
    return resolved


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _module_by_name(model: nn.Module, name: str, *, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        pass
    all_names = [module_name for module_name, _ in model.named_modules() if module_name]
    hint = did_you_mean(name, all_names) or (
        f"; its top-level modules are {', '.join(repr(n) for n, _ in model.named_children())}"
    )
    raise UsageError(
        f"{what} is not a submodule of {type(model).__name__}{hint} "
        f"(names as in model.named_modules())"
    )


# --------------------------------------------------------------------------------------------
# Run order (find_blocks with a sample)
# --------------------------------------------------------------------------------------------


def _blocks_that_run(model: nn.Module, sample: Any) -> list[tuple[str, nn.Module]]:
    """Rule 4 with a sample: the blocks of the stacks chosen among those that ran on
    ``sample``, sorted by when each first ran in one no-grad forward pass of ``model``."""
    stacks = candidate_stacks(model)
    if not stacks:
        _blocks_of(stacks, model)  # raises: no chain, and nothing to run the model for
    watched = _blocks_of(stacks, model)
    first_call: dict[int, int] = {}  # index in watched -> how many blocks had run before it
    hidden: dict[int, Any] = {}  # each block's first call: its hidden state, its output
    outputs: dict[int, Any] = {}

    def note(index: int, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if index not in first_call:  # a block called again keeps its place
            first_call[index] = len(first_call)
            hidden[index] = first_tensor((args, kwargs))

    def noted_output(index: int, _module: nn.Module, _args: tuple, output: Any) -> None:
        outputs.setdefault(index, first_tensor(output))

    handles = []
    try:
        for index, (_, module) in enumerate(watched):
            handles.append(module.register_forward_pre_hook(
                functools.partial(note, index), with_kwargs=True))
            handles.append(module.register_forward_hook(functools.partial(noted_output, index)))
        with buffers_and_rng_preserved(model), ecosystem_hooks_on(model), torch.no_grad():
            run_model(model, sample)
    finally:
        for handle in handles:
            handle.remove()

    ran_ids = {id(watched[index][1]) for index in first_call}
    chosen = chosen_stacks(model, ran=lambda name, stack: any(
        id(block) in ran_ids for _, block in stack_blocks(name, stack)))
    if not chosen:  # no stack ran: the blocks found by structure did not
        chosen = chosen_stacks(model)
    index_of = {name: index for index, (name, _) in enumerate(watched)}
    blocks = [index_of[name] for name, _ in _blocks_of(chosen, model)]
    _, missing = blocks_not_run([watched[index] for index in blocks],
                                [position for position, index in enumerate(blocks)
                                 if index in first_call])
    if missing:
        raise UsageError(
            f"find_blocks(): blocks {[watched[blocks[position]][0] for position in missing]} "
            "did not run in the model's forward pass on this sample, so their place in the "
            f"chain is unknown; give a sample that runs them all, or {_HOW_TO_PASS_BLOCKS}"
        )
    blocks = [index for index in blocks if index in first_call]
    # sorted() is stable, and ties cannot happen: every block that ran has its own index
    order = sorted(blocks, key=first_call.__getitem__)
    check_not_interleaved(
        [watched[index][0] for index in order],
        [position for position in range(1, len(order))
         if outputs.get(order[position - 1]) is None or hidden[order[position]] is None
         or not is_alias(hidden[order[position]], outputs[order[position - 1]])],
    )
    return [watched[index] for index in order]


# --------------------------------------------------------------------------------------------
# Rules on a run: stacks left out, stacks run interleaved (find_blocks with a sample, and the
# step profile records)
# --------------------------------------------------------------------------------------------


class NoneOfTheBlocksRan(UsageError):
    """None of the blocks a step was recorded with ran on the sample (``recording.py``);
    ``profile`` turns it into the chain that runs (``chain_that_runs``) or a ``UsageError``
    saying what to pass."""


def chain_that_runs(
    model: nn.Module, sample: Any, not_run: NoneOfTheBlocksRan, blocks_given: bool
) -> list[tuple[str, nn.Module]]:
    """Where none of the blocks a step was recorded with ran on ``sample`` (``not_run``): with
    blocks found by structure, the chain ``find_blocks(model, sample)`` finds among the stacks
    that ran (rule 4). Raises ``UsageError`` with ``not_run``'s message where the blocks were
    given (``blocks_given``: the message names those that run instead) or no stack runs.

    Example:
        >>> import torch
        >>> class TwoTowers(torch.nn.Module):  # a vision tower that outweighs the text one
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.vision = torch.nn.Sequential(torch.nn.Linear(64, 64),
        ...                                           torch.nn.Linear(64, 64))
        ...         self.text = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Tanh())
        ...     def forward(self, x):  # given text: the vision tower does not run
        ...         return self.text(x)
        >>> model, text = TwoTowers(), torch.ones(2, 4)
        >>> [name for name, _ in find_blocks(model)]
        ['vision.0', 'vision.1']
        >>> not_run = NoneOfTheBlocksRan("blocks [0, 1] did not run (vision.0, vision.1)")
        >>> [name for name, _ in chain_that_runs(model, text, not_run, blocks_given=False)]
        ['text.0', 'text.1']
        >>> chain_that_runs(model, text, not_run, blocks_given=True)
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: blocks [0, 1] did not run (vision.0, vision.1); those of ...
    """
    if blocks_given:
        raise UsageError(f"{not_run}{blocks_that_run_instead(model, sample)}") from None
    try:
        return find_blocks(model, sample)
    except Exception:  # no stack runs (or the model fails without grad): as told by not_run
        raise UsageError(
            f"{not_run}, and no other list of blocks runs on it either; pass blocks= with the "
            "blocks that run, in order"
        ) from None


def blocks_that_run_instead(model: nn.Module, sample: Any) -> str:
    """Where none of the blocks a step was recorded with ran on ``sample``: the ``blocks=``
    that ``find_blocks(model, sample)`` finds among the stacks that do run, as the end of the
    error's message (the general advice where it finds none, or the model fails on it)."""
    try:
        found = find_blocks(model, sample)
    except Exception:  # the error being raised says what did not run; this only adds to it
        return "; pass blocks= with the blocks that run, in order"
    stacks = list(dict.fromkeys(_stack_name(name) for name, _ in found))
    if len(stacks) == 1 and stacks[0]:
        how = f"blocks={stacks[0]!r}"
    else:
        how = f"blocks={[name for name, _ in found]}"
    return (f"; those of {', '.join(stacks) or 'the model'} do run on it (find_blocks(model, "
            f"sample) finds them): pass {how}")


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
        return _stack_name(name), original_class(module)

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
    stacks = [_stack_name(name) for name in names]
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


def _stack_name(block_name: str) -> str:
    return block_name.rpartition(".")[0]
