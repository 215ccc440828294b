"""Finding the chain of blocks that checkpointing works on.

Checkpointing plans are made over a *chain*: blocks that run one after another in the forward
pass, each taking the previous one's output (a transformer's layers, the stages of a CNN). Most
models hold that chain in one container, so ``find_blocks`` looks for it there:

1. A *stack* is an ``nn.ModuleList`` or ``nn.Sequential`` whose children are 2 or more modules of
   one class (``model.layers`` of Llama, ``transformer.h`` of GPT-2, ``encoder.layer`` of BERT).
   The model itself counts when it is such a container. A module wrapped by
   ``gradckpt.checkpoint_module`` counts as its original class.
2. Only the outermost stacks count: a stack inside another stack's blocks (the list of sub-layers
   inside a T5 block, the experts inside a mixture-of-experts layer) is part of those blocks.
3. The *main* stack is the one whose blocks hold the most parameters. Every other stack is
   returned too when it holds at least a tenth of the main stack's parameters, so that
   encoder-decoder models (T5, BART, Whisper) give their encoder's and their decoder's layers,
   or when its blocks are of the main stack's class, so that a ResNet gives all four of its
   stages although the early ones hold few parameters (they hold most of the activations). Small
   lists of other modules beside the main stack (per-codebook embeddings or output heads, which
   run side by side rather than one after another) are left out.
4. Stacks come in the order they first appear in ``model.named_modules()``, which is the order
   their modules were created in ``__init__``. In Hugging Face encoder-decoder models that is
   the execution order, encoder first (the tests check it by running the models). Nothing but
   running the model can tell the order of stacks that are not one after another in the code:
   CLIP creates its text tower first but runs its vision tower first. Given a ``sample``,
   ``find_blocks`` runs the forward pass once without grad, with a forward pre-hook on each
   block, and returns the blocks in the order they first ran; the model's buffers and the RNG
   state are put back afterwards. A block that does not run on the sample raises ``UsageError``.
5. No stack, but the model itself is an ``nn.Sequential`` of 2 or more children of different
   classes (``Linear, ReLU, Linear``): its children are the chain, since a Sequential runs them
   one after another by definition.

Anything else (a single layer, blocks in an ``nn.ModuleDict``, the layers of a hybrid model kept
in one list but of several classes) raises ``UsageError``; pass the chain yourself as ``blocks=``,
which ``resolve_blocks`` checks and turns into ``(name, module)`` pairs.

Example:
    >>> import torch
    >>> from gradckpt.measure import find_blocks
    >>> from gradckpt.toy_models import GPTConfig, TinyGPT
    >>> model = TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))
    >>> [name for name, _ in find_blocks(model)]
    ['transformer.h.0', 'transformer.h.1', 'transformer.h.2']
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..ecosystem_hooks import ecosystem_hooks_on
from ..errors import UsageError, did_you_mean
from .model_state import buffers_and_rng_preserved
from .step import run_model

__all__ = ["find_blocks", "resolve_blocks"]

# A stack beside the main one counts when it holds at least this share of the main stack's
# parameters: an encoder-decoder model's smaller stack holds about as many (T5's decoder layers
# hold more than its encoder's, for their cross-attention), while lists of heads or embeddings
# that run side by side hold a few percent.
_SECONDARY_STACK_MIN_SHARE = 0.1

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
    meanwhile. Blocks that do not run on the sample raise ``UsageError``, naming them.

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
    blocks = _blocks_by_structure(model)
    if sample is None:
        return blocks
    return _in_run_order(model, blocks, sample)


def _blocks_by_structure(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Rules 1-5 of the module docstring: the chain, stacks in creation order."""
    stacks = _outermost_stacks(model)
    if stacks:
        main_name, main_stack = max(stacks, key=lambda item: _parameter_count(item[1]))
        main_parameters = _parameter_count(main_stack)
        main_class = _block_class(main_stack)
        chosen = [
            (name, stack)
            for name, stack in stacks
            if name == main_name
            or _parameter_count(stack) >= _SECONDARY_STACK_MIN_SHARE * main_parameters
            or _block_class(stack) is main_class
        ]
        return [
            (_join(name, child_name), child)
            for name, stack in chosen
            for child_name, child in stack.named_children()
        ]

    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return list(model.named_children())

    raise UsageError(
        f"find_blocks() found no chain of blocks in {type(model).__name__}: it looks for an "
        "nn.ModuleList or nn.Sequential holding 2 or more modules of the same class (such as "
        "model.layers or transformer.h in Hugging Face models), or a model that is itself an "
        f"nn.Sequential of 2 or more modules; {_HOW_TO_PASS_BLOCKS}"
    )


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


def _outermost_stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every stack (rule 1) that is not inside another stack (rule 2), in named_modules order."""
    stacks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not _is_stack(module):
            continue
        if any(_is_inside(name, outer) for outer, _ in stacks):
            continue  # named_modules lists parents before children: the outer one is in already
        stacks.append((name, module))
    return stacks


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({_original_class(child) for child in children}) == 1


def _original_class(module: nn.Module) -> type:
    # checkpoint_module swaps a module's class for a subclass that remembers the original
    return getattr(type(module), "_gradckpt_original_class", type(module))


def _block_class(stack: nn.Module) -> type:
    return _original_class(next(iter(stack.children())))


def _parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _is_inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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


def _in_run_order(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], sample: Any
) -> list[tuple[str, nn.Module]]:
    """``blocks`` sorted by when each first ran in one forward pass of ``model`` on ``sample``."""
    first_call: dict[int, int] = {}  # block index -> how many blocks had run before it

    def note(index: int, _module: nn.Module, _args: tuple) -> None:
        first_call.setdefault(index, len(first_call))  # a block called again keeps its place

    handles = []
    try:
        for index, (_, module) in enumerate(blocks):
            handles.append(module.register_forward_pre_hook(functools.partial(note, index)))
        with buffers_and_rng_preserved(model), ecosystem_hooks_on(model), torch.no_grad():
            run_model(model, sample)
    finally:
        for handle in handles:
            handle.remove()

    missing = [name for index, (name, _) in enumerate(blocks) if index not in first_call]
    if missing:
        raise UsageError(
            f"find_blocks(): blocks {missing} did not run in the model's forward pass on this "
            f"sample, so their place in the chain is unknown; give a sample that runs them all, "
            f"or {_HOW_TO_PASS_BLOCKS}"
        )
    # sorted() is stable, and ties cannot happen: every block that ran has its own index
    order = sorted(range(len(blocks)), key=first_call.__getitem__)
    return [blocks[index] for index in order]
