"""Stacks: the lists of blocks in a model's structure, and which of them make its chain.

``chain.find_blocks`` documents the rules (its module docstring, rules 1-5); this module
implements the structural part: which modules are stacks (``candidate_stacks``), which of
them the chain is made of (``chosen_stacks``), and a stack's blocks (``stack_blocks``: its
children, or the layers of each of its stages), before anything runs.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    >>> [name for name, _ in candidate_stacks(model)]
    ['1']
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["block_classes", "candidate_stacks", "chosen_stacks", "is_inside", "is_stack",
           "join_name", "original_class", "parameter_count", "stack_blocks", "stage_layers"]

# A stack beside the main one counts when it holds at least this share of the main stack's
# parameters: an encoder-decoder model's smaller stack holds about as many (T5's decoder layers
# hold more than its encoder's, for their cross-attention), while lists of heads or embeddings
# that run side by side hold a few percent.
_SECONDARY_STACK_MIN_SHARE = 0.1


def chosen_stacks(model: nn.Module, ran: Any = None) -> list[tuple[str, nn.Module]]:
    """Rules 1-3 and 5 of ``chain``'s module docstring: the stacks of the chain, in creation order;
    with ``ran`` (a predicate on a stack's name and module), chosen among the stacks it holds
    true for."""
    candidates = candidate_stacks(model)
    if ran is not None:
        candidates = [(name, stack) for name, stack in candidates if ran(name, stack)]
    if not candidates:
        return []
    one_class = [(name, stack) for name, stack in candidates if is_stack(stack)]
    mixed = [(name, stack) for name, stack in candidates if not is_stack(stack)]
    stacks = one_class
    if mixed:  # the biggest list of several classes, where it is the main stack (rule 1)
        mixed_name, mixed_stack = max(mixed, key=lambda item: parameter_count(item[1]))
        outside = [(name, stack) for name, stack in one_class
                   if not is_inside(name, mixed_name)]
        if all(parameter_count(mixed_stack) > parameter_count(stack) for _, stack in outside):
            kept = {mixed_name, *(name for name, _ in outside)}
            stacks = [(name, stack) for name, stack in candidates if name in kept]
    main_name, main_stack = max(stacks, key=lambda item: parameter_count(item[1]))
    main_parameters = parameter_count(main_stack)
    main_classes = block_classes(main_stack)
    return [
        (name, stack)
        for name, stack in stacks
        if name == main_name
        or (parameter_count(stack) >= _SECONDARY_STACK_MIN_SHARE * main_parameters
            and not _parts_of_stages(name, stack, stacks))
        or block_classes(stack) <= main_classes
    ]


def stage_layers(name: str, stack: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """Where ``stack`` is a list of *stages* (rule 2), the list of layers in each stage, as
    ``(qualified_name, list)`` in stage order; ``None`` where its children are the blocks.

    A stack's children are stages when each of them is a list of one class itself (an
    ``nn.ModuleList``, which cannot be called, or an ``nn.Sequential``: PoolFormer's
    ``encoder.block[i]``), or when each holds, among its own children, exactly one list of
    one class (Swin's ``layers[i].blocks``, beside its patch merging; ConvNeXt's
    ``stages[i].layers``, beside a downsampling list of several classes), where the stages
    differ (in their parameters' names and shapes: widths, depths, a transition the last
    stage lacks) and those lists hold more than half of the stack's parameters. Blocks all
    alike are the model's repeated layers, and a list in each a part of it (a residual
    block's body, MobileBERT's feed-forward layers beside its attention); so is a list
    holding less than half: the stages' other parts are transitions (downsampling, patch
    embeddings, norms).

    Example:
        >>> from torch import nn
        >>> stages = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]),
        ...                         nn.ModuleList([nn.Linear(2, 2)])])
        >>> [name for name, _ in stage_layers("stages", stages)]
        ['stages.0', 'stages.1']
        >>> stage_layers("layers", nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])) is None
        True
    """
    if not is_stack(stack):
        return None
    children = list(stack.children())
    if not all(_is_list_of_one_class(child) for child in children) and len(
            {_parameter_shapes(child) for child in children}) == 1:
        return None  # alike blocks are the repeated layers, their lists parts of each
    layers = []
    for child_name, child in stack.named_children():
        if _is_list_of_one_class(child):
            inner = [("", child)]
        else:
            inner = [(grandchild_name, grandchild)
                     for grandchild_name, grandchild in child.named_children()
                     if _is_list_of_one_class(grandchild)]
        if len(inner) != 1:
            return None
        stage_name = join_name(name, child_name)
        inner_name, inner_list = inner[0]
        layers.append((join_name(stage_name, inner_name) if inner_name else stage_name,
                       inner_list))
    if sum(parameter_count(inner) for _, inner in layers) * 2 <= parameter_count(stack):
        return None  # the lists are a part of each block (MobileBERT's feed-forward layers)
    return layers


def stack_blocks(name: str, stack: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of the stack named ``name``, as ``(qualified_name, module)`` in creation
    order: its children, or, for a list of stages, the layers of each stage in turn (rule 2).

    Example:
        >>> from torch import nn
        >>> stages = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]),
        ...                         nn.ModuleList([nn.Linear(2, 2)])])
        >>> [name for name, _ in stack_blocks("encoder.block", stages)]
        ['encoder.block.0.0', 'encoder.block.0.1', 'encoder.block.1.0']
    """
    lists = stage_layers(name, stack) or [(name, stack)]
    return [(join_name(list_name, child_name), child)
            for list_name, layers in lists for child_name, child in layers.named_children()]


def _parameter_shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(parameter.shape)) for name, parameter in module.named_parameters())


def _is_list_of_one_class(module: nn.Module) -> bool:
    children = list(module.children())
    return (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 1
            and len({original_class(child) for child in children}) == 1)


def _parts_of_stages(name: str, stack: nn.Module, stacks: list[tuple[str, nn.Module]]) -> bool:
    """Whether ``stack`` is a list beside a bigger list of stages, in the same module, with one
    module per stage: the stages' other parts (PVT's and PoolFormer's per-stage patch
    embeddings beside ``encoder.block``), which run between the stages' layers (rule 2)."""
    parent = name.rpartition(".")[0]
    return any(
        other_name != name and other_name.rpartition(".")[0] == parent
        and len(other) == len(stack) and stage_layers(other_name, other) is not None
        and parameter_count(other) > parameter_count(stack)
        for other_name, other in stacks
    )


def candidate_stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every stack of one class (rule 1) not inside another one (rule 2), and every
    ``nn.ModuleList`` of several classes not inside those, in named_modules order; the model
    itself where there are none and it is an ``nn.Sequential`` of 2 or more (rule 5)."""
    stacks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not is_stack(module):
            continue
        if any(is_inside(name, outer) for outer, _ in stacks):
            continue  # named_modules lists parents before children: the outer one is in already
        stacks.append((name, module))
    mixed = [
        (name, module) for name, module in model.named_modules()
        if name and is_mixed_list(module)
        and not any(is_inside(name, outer) for outer, _ in stacks)
    ]
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    found = sorted([*stacks, *mixed], key=lambda item: order[item[0]])
    if not found and isinstance(model, nn.Sequential) and len(model) >= 2:
        return [("", model)]
    return found


def is_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({original_class(child) for child in children}) == 1


def is_mixed_list(module: nn.Module) -> bool:
    children = list(module.children())
    return (isinstance(module, nn.ModuleList) and len(children) >= 2
            and len({original_class(child) for child in children}) > 1)


def original_class(module: nn.Module) -> type:
    # checkpoint_module swaps a module's class for a subclass that remembers the original
    return getattr(type(module), "_gradckpt_original_class", type(module))


def block_classes(stack: nn.Module) -> set[type]:
    return {original_class(child) for child in stack.children()}


def parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def is_inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
