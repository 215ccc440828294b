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
``UsageError`` names the lists before any block is measured or checkpointed. What a run showed
(blocks that did not run, lists run interleaved) is judged in ``chain_checks.py``, for
``find_blocks`` given a sample and for the step ``profile`` records alike.

Anything else (a single layer, blocks in an ``nn.ModuleDict``) raises ``UsageError``; pass the
chain yourself as ``blocks=``, which ``resolve_blocks`` (``given_blocks.py``) checks and turns
into ``(name, module)`` pairs.

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
from typing import Any

import torch
from torch import nn

from ..ecosystem_hooks import ecosystem_hooks_on
from ..engine import first_tensor
from ..engine.segments import is_alias
from ..errors import UsageError
from .chain_checks import NoneOfTheBlocksRan, blocks_not_run, check_not_interleaved, stack_name
from .model_state import buffers_and_rng_preserved
from .stacks import candidate_stacks, chosen_stacks, stack_blocks
from .step import run_model

__all__ = ["HOW_TO_PASS_BLOCKS", "blocks_that_run_instead", "chain_that_runs", "find_blocks"]

HOW_TO_PASS_BLOCKS = (
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
            f"itself an nn.Sequential of 2 or more modules; {HOW_TO_PASS_BLOCKS}"
        )
    return [block for name, stack in stacks for block in stack_blocks(name, stack)]

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
            f"chain is unknown; give a sample that runs them all, or {HOW_TO_PASS_BLOCKS}"
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
# Where none of the blocks a step was recorded with ran (profile)
# --------------------------------------------------------------------------------------------


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
    stacks = list(dict.fromkeys(stack_name(name) for name, _ in found))
    if len(stacks) == 1 and stacks[0]:
        how = f"blocks={stacks[0]!r}"
    else:
        how = f"blocks={[name for name, _ in found]}"
    return (f"; those of {', '.join(stacks) or 'the model'} do run on it (find_blocks(model, "
            f"sample) finds them): pass {how}")
