"""Blocks given by the user: ``blocks=`` of ``profile``, ``estimate`` and ``enable`` checked
and turned into ``(qualified_name, module)`` pairs (``resolve_blocks``); without it, the chain
``find_blocks`` finds (``chain.py``, whose docstring states how).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> [name for name, _ in resolve_blocks(model, model)]
    ['0', '1', '2']
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..errors import UsageError, did_you_mean
from .chain import HOW_TO_PASS_BLOCKS, find_blocks

__all__ = ["resolve_blocks"]


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
        raise UsageError(f"blocks= is empty; {HOW_TO_PASS_BLOCKS}")

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
