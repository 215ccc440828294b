"""The module form: ``checkpoint_module`` makes every call of a module a region, in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import UsageError
from .fates import PolicyLike, resolve_policy
from .region import _run_checkpointed
from .suspension import _handles_on, _standing_aside


class _CheckpointSettings:
    __slots__ = ("policy", "preserve_rng_state", "name")

    def __init__(self, policy: PolicyLike, preserve_rng_state: bool, name: str | None) -> None:
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.name = name

    def __reduce__(self) -> Any:
        return (_CheckpointSettings, (self.policy, self.preserve_rng_state, self.name))


class _CheckpointedModule(torch.nn.Module):
    """Mixin placed in front of a module's own class by ``checkpoint_module``.

    It wraps the module's whole call, hooks included, so hooks run again in recomputation
    (FSDP2 re-gathers parameters in them). Only the class changes: parameters, buffers, names,
    ``state_dict`` keys and ``repr`` stay exactly as they were.
    """

    _gradckpt_original_class: type[torch.nn.Module]

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        if _standing_aside(self):  # plans_suspended: run as the module's own class
            return super()._call_impl(*args, **kwargs)
        settings: _CheckpointSettings = self.__dict__["_gradckpt_settings"]
        return _run_checkpointed(
            super()._call_impl,
            args,
            kwargs,
            name=settings.name,
            policy=settings.policy,
            preserve_rng_state=settings.preserve_rng_state,
        )

    def _get_name(self) -> str:
        return self._gradckpt_original_class.__name__

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickle and deepcopy as the original class, then wrap again on load: the generated
        # class is not importable by name.
        wrapped_class = type(self)
        self.__class__ = self._gradckpt_original_class
        try:
            plain = self.__reduce_ex__(protocol)
        finally:
            self.__class__ = wrapped_class
        return (_rebuild_checkpointed, (plain,))


def _rebuild_checkpointed(plain: tuple) -> torch.nn.Module:
    constructor, constructor_args, *rest = plain
    module = constructor(*constructor_args)
    state = rest[0] if rest else None
    if state is not None:
        if hasattr(module, "__setstate__"):
            module.__setstate__(state)
        else:
            module.__dict__.update(state)
    module.__class__ = _checkpointed_class(type(module))
    return module


_checkpointed_classes: dict[type, type] = {}


def _checkpointed_class(original: type[torch.nn.Module]) -> type[torch.nn.Module]:
    if original not in _checkpointed_classes:
        _checkpointed_classes[original] = type(
            f"Checkpointed{original.__name__}",
            (_CheckpointedModule, original),
            {"_gradckpt_original_class": original, "__module__": original.__module__},
        )
    return _checkpointed_classes[original]


def checkpoint_module(
    module: torch.nn.Module,
    policy: PolicyLike = None,
    preserve_rng_state: bool = True,
    name: str | None = None,
) -> torch.nn.Module:
    """Make every call of ``module`` run through the checkpoint engine, in place.

    Parameter names, ``state_dict`` keys, ``repr`` and outputs stay exactly as they were; only
    what the module's forward saves for backward changes. Calling it again on a checkpointed
    module replaces its settings. ``uncheckpoint_module`` undoes it.

    Args:
        module: the block to checkpoint (one transformer layer, a stage of a CNN, ...).
        policy: as for ``checkpoint``: ``None``, a preset name or a callable.
        preserve_rng_state: as for ``checkpoint``.
        name: how errors refer to this region (default: the class name).

    Example:
        >>> import torch, gradckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> keys = list(block.state_dict())
        >>> _ = gradckpt.checkpoint_module(block, policy="save-matmuls")
        >>> list(block.state_dict()) == keys
        True
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> _ = gradckpt.uncheckpoint_module(block)
        >>> gradckpt.is_checkpointed(block)
        False
    """
    if not isinstance(module, torch.nn.Module):
        raise UsageError(
            f"checkpoint_module() needs a torch.nn.Module, got {type(module).__name__}; "
            "for a plain function use gradckpt.checkpoint(fn, *args)"
        )
    resolve_policy(policy)  # fail now, not in the middle of the first training step
    for handle in _handles_on([module]):
        index = handle.blocks.index(module)
        if any(segment.start <= index <= segment.end for segment in handle.segments):
            raise UsageError(
                f"checkpoint_module(): this {type(module).__name__} is a block of a segment of "
                "the plan applied (gradckpt.enable/apply), which recomputes it already; "
                "gradckpt.disable(model) first, or checkpoint a module inside the block"
            )
    module.__dict__["_gradckpt_settings"] = _CheckpointSettings(policy, preserve_rng_state, name)
    if not isinstance(module, _CheckpointedModule):
        module.__class__ = _checkpointed_class(type(module))
    return module


def refuse_checkpointed_modules(blocks: list[tuple[str, torch.nn.Module]]) -> None:
    """Raise ``UsageError`` naming the first of ``blocks`` (name, module) that
    ``checkpoint_module`` checkpoints: a segment cannot hold one. Its region wraps the block's
    whole call, the segment's hooks included, so the segment would open inside it in the
    forward pass and around it in the recomputation; the two would save differently. (A
    module inside a block nests as any region does; one standing aside, while ``profile``
    measures the model as without its checkpointing, runs as its own class.)"""
    for name, block in blocks:
        if isinstance(block, _CheckpointedModule) and not _standing_aside(block):
            raise UsageError(
                f"{name!r} is checkpointed by gradckpt.checkpoint_module and a plan's segment "
                f"would recompute it as well: call gradckpt.uncheckpoint_module on it first "
                f"(the plan decides what is recomputed), or leave it out of blocks="
            )


def uncheckpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """Undo ``checkpoint_module``: the module runs exactly as before. A no-op if not checkpointed.

    Example:
        >>> import torch, gradckpt
        >>> block = gradckpt.checkpoint_module(torch.nn.Linear(4, 4))
        >>> type(gradckpt.uncheckpoint_module(block)) is torch.nn.Linear
        True
    """
    if isinstance(module, _CheckpointedModule):
        module.__class__ = module._gradckpt_original_class
        module.__dict__.pop("_gradckpt_settings", None)
    return module


def is_checkpointed(model: torch.nn.Module) -> bool:
    """Whether gradckpt checkpoints ``model`` or any module inside it: a plan's segments
    (``gradckpt.enable`` / ``gradckpt.apply``, until ``gradckpt.disable``) or
    ``checkpoint_module`` (until ``uncheckpoint_module``).

    Example:
        >>> import torch, gradckpt
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> gradckpt.is_checkpointed(model)
        False
        >>> _ = gradckpt.checkpoint_module(model[1])
        >>> gradckpt.is_checkpointed(model), gradckpt.is_checkpointed(model[0])
        (True, False)
    """
    modules = list(model.modules())
    return (any(isinstance(module, _CheckpointedModule) for module in modules)
            or bool(_handles_on(modules)))


def replace_forward(module: torch.nn.Module, forward: Any) -> Callable[[], None]:
    """Set ``forward`` as ``module``'s forward (an instance attribute) and return what puts
    back the forward it had: its own instance attribute if it had one, else its class's.
    Nothing is put back if something replaced ``forward`` again since: theirs stays.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> restore = replace_forward(layer, lambda x: x)
        >>> layer(torch.ones(2)).tolist()
        [1.0, 1.0]
        >>> restore(); "forward" in layer.__dict__
        False
    """
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = forward

    def restore() -> None:
        if module.__dict__.get("forward") is not forward:
            return
        if had_own:
            module.forward = own
        else:
            del module.forward

    return restore
