"""Hugging Face Transformers: what a model needs while gradckpt works on it, the Trainer
callback, a model from its ``config.json``, and the batch it trains on.

- ``adapt_transformers`` (a registered ecosystem hook, so automatic for any model holding a
  ``PreTrainedModel``): caches off in training only, Transformers' own checkpointing off while
  gradckpt's plan is on, truthful ``is_activation_checkpointing``, and one behaviour for a later
  ``gradient_checkpointing_enable()``. docs/integrations.md shows each.
- ``GradckptCallback`` (``hf_trainer.py``): plan and apply for a ``Trainer`` run.

Transformers is imported inside the functions that need it, so that importing this module works
without it (``gradckpt`` imports it to register its hook; the command line imports it
whatever model it plans); only building a model from a config needs the ``hf`` extra.
"""

from __future__ import annotations

import functools
import json
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..ecosystem_hooks import Occasion, register_ecosystem_hook
from ..errors import did_you_mean, warn_once
from . import hf_head  # noqa: F401  (registered first: the cache guard wraps its forward)

if TYPE_CHECKING:
    from .hf_trainer import GradckptCallback  # noqa: F401  (loaded on first use: __getattr__)

__all__ = [
    "GradckptCallback", "NoLanguageModelError", "adapt_transformers", "is_language_model",
    "model_from_config_json", "token_sample", "turn_caches_off",
]

# Transformers' switches for its own checkpointing, on PreTrainedModel (the 4.x names and the 5.x
# ones). While a plan is applied gradckpt answers them itself (``_answer_checkpointing_calls``).
_ENABLE_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
_DISABLE_METHODS = ("gradient_checkpointing_disable", "activation_checkpointing_disable")


def __getattr__(name: str) -> Any:
    # The Trainer callback imports Transformers' Trainer, which is slow and optional: only on use.
    if name == "GradckptCallback":
        from .hf_trainer import GradckptCallback

        return GradckptCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def turn_caches_off(model: Any) -> Callable[[], None] | None:
    """Set ``use_cache = False`` on every config of ``model`` that has it true; return a
    function that turns them back on (``None`` when there were none).

    With ``config.use_cache`` true, a Transformers model hands its layers a cache object even in
    a training step, and each layer appends its keys and values to it. A recomputed layer would
    append them again, and profiling re-runs each layer on its own; the cache is useless for
    training anyway. ``adapt_transformers`` calls this around every forward pass that may be
    followed by a backward one.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = SimpleNamespace(use_cache=True)
        >>> restore = turn_caches_off(model)
        >>> model.config.use_cache
        False
        >>> restore()
        >>> model.config.use_cache
        True
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    turned_off = [c for c in configs.values() if getattr(c, "use_cache", False) is True]
    if not turned_off:
        return None
    return _switched_off(turned_off, "use_cache")


def _switched_off(objects: list[Any], attribute: str) -> Callable[[], None]:
    """Set ``attribute`` False on each of ``objects``; return what sets it True again."""
    for obj in objects:
        setattr(obj, attribute, False)

    def restore() -> None:
        for obj in objects:
            setattr(obj, attribute, True)

    return restore


def adapt_transformers(model: nn.Module, occasion: Occasion) -> Callable[[], None] | None:
    """What a Hugging Face model needs while gradckpt measures it or a plan is applied to it.

    Registered as an ecosystem hook (``gradckpt.ecosystem_hooks``), so ``profile``, ``apply``
    and ``enable``
    run it on every model and ``disable`` undoes it. It changes, and puts back:

    1. The key/value cache is off in every forward pass with gradients enabled (training),
       and as the model has it otherwise: ``model.eval()`` + ``generate()`` keeps its cache
       and runs exactly as without gradckpt.
    2. Transformers' own checkpointing (``gradient_checkpointing_enable()``) is off: a layer
       it checkpoints inside a block gradckpt recomputes would be recomputed twice. A one-time
       ``GradckptWarning`` says so; ``gradckpt.disable`` turns it back on.
    3. While a plan that recomputes anything is applied, ``is_gradient_checkpointing`` and
       ``is_activation_checkpointing`` are True (so PEFT, the Trainer and user code see it),
       and False again after ``gradckpt.disable``.
    4. While any plan is applied, gradckpt answers Transformers' switches: a later
       ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()`` (the Trainer
       makes one with ``gradient_checkpointing=True``) keeps the plan and warns once;
       ``..._disable()`` removes the plan, as ``gradckpt.disable`` does, then runs as usual.

    Returns the undo, or None when the model has no Hugging Face part.

    Example:
        >>> import torch, transformers, gradckpt
        >>> from gradckpt.ecosystem_hooks import Occasion
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> undo = adapt_transformers(model, Occasion(plan_applied=True, recomputes=True))
        >>> model.is_activation_checkpointing
        True
        >>> undo()
        >>> model.is_activation_checkpointing
        False
    """
    pretrained = _pretrained_models(model)
    if occasion.fake_tensors:
        return _masks_as_for_unpadded_batches() if pretrained else None
    undos = [_caches_off_while_training(model)]
    if pretrained:
        undos.append(_transformers_checkpointing_off(model))
        if occasion.plan_applied:
            if occasion.recomputes:
                undos.append(_flags_say_checkpointing(pretrained))
            undos.append(_answer_checkpointing_calls(model, pretrained))
    undos = [undo for undo in undos if undo is not None]
    if not undos:
        return None

    def restore() -> None:
        for undo in reversed(undos):
            undo()

    return restore


def _pretrained_models(model: nn.Module) -> list[nn.Module]:
    """The Transformers models in ``model`` (itself, a base model, T5's stacks, a model PEFT
    wraps). None when Transformers was never imported: then the model cannot hold one."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    pretrained_class = transformers.PreTrainedModel
    return [module for module in model.modules() if isinstance(module, pretrained_class)]


def _masks_as_for_unpadded_batches() -> Callable[[], None] | None:
    """On fake tensors, let attention skip its mask as it does on a real batch without padding.

    With no padding, Transformers passes SDPA no mask (``is_causal`` instead), which selects a
    fused kernel that saves far less for backward than the masked path. To know there is no
    padding it reads the padding mask's values, which fake tensors lack, so under
    ``estimate`` it would build the mask and take the other path. ``estimate`` plans for
    batches without padding and one sequence per row.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        return None
    originals = {}
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking, name, None)
        if original is None:
            continue
        originals[name] = original

        def unpadded(padding_mask: Any, *args: Any, _original: Any = original, **kwargs: Any):
            return _original(None, *args, **kwargs)

        setattr(masking, name, unpadded)
    # Packed sequences (several per row, told apart by position_ids restarting) are found by
    # reading position_ids; without values, as for rows of one sequence each.
    if hasattr(masking, "find_packed_sequence_indices"):
        originals["find_packed_sequence_indices"] = masking.find_packed_sequence_indices
        masking.find_packed_sequence_indices = lambda position_ids, *args, **kwargs: None

    def restore() -> None:
        for name, original in originals.items():
            setattr(masking, name, original)

    return restore


def _caches_off_while_training(model: nn.Module) -> Callable[[], None] | None:
    """A forward for ``model`` that turns its caches off for a pass with gradients on and back
    on as it returns or raises; returns what takes it off again.

    A forward, not a pair of forward hooks: torch runs no post-hook (``always_call`` included)
    when the forward raises a ``KeyboardInterrupt``, and a Ctrl-C would leave
    ``config.use_cache`` false (a ``save_pretrained`` then writes it so). It wraps the forward
    the model has (``hf_head``'s chunked loss, registered before this hook so that it wraps
    first) and holds the model only weakly (no reference cycle; see ``hf_head``).
    """
    if not any(hasattr(getattr(m, "config", None), "use_cache") for m in model.modules()):
        return None
    owner = weakref.ref(model)
    own = vars(model).get("forward")  # a forward set on the instance, if any

    @functools.wraps(own if own is not None else type(model).forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        module = owner()
        assert module is not None  # called through the module, which holds this function

        def call(*args: Any, **kwargs: Any) -> Any:
            return own(*args, **kwargs) if own is not None \
                else type(module).forward(module, *args, **kwargs)

        if not torch.is_grad_enabled():  # inference and generate(): the cache as configured
            return call(*args, **kwargs)
        restore = turn_caches_off(module)
        if kwargs.get("use_cache"):
            kwargs = {**kwargs, "use_cache": False}
        try:
            return call(*args, **kwargs)
        finally:  # every exit: a return, an exception, a KeyboardInterrupt
            if restore is not None:
                restore()

    model.forward = forward

    def remove() -> None:
        module = owner()
        if module is None or vars(module).get("forward") is not forward:
            return  # gone, or replaced since (theirs stays)
        if own is not None:
            module.forward = own
        else:
            del module.forward

    return remove


# The modules whose ``gradient_checkpointing`` flag an applied plan set (with how many plans
# did: the plan's model and a wrapper of it may both have one), not Transformers.
_flagged_by_plans: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _transformers_checkpointing_off(model: nn.Module) -> Callable[[], None] | None:
    """Turn off every ``gradient_checkpointing`` flag Transformers set; warn once.

    Not the flags a gradckpt plan set (``_flags_say_checkpointing``): ``profile`` measuring a
    planned model finds those, and they are not Transformers' checkpointing.
    """
    # The module's own flag: PEFT's wrappers forward attribute reads to the model they wrap,
    # so through getattr they would read as flagged by whatever flagged that model.
    flagged = [m for m in model.modules() if vars(m).get("gradient_checkpointing") is True
               and m not in _flagged_by_plans]
    if not flagged:
        return None
    warn_once(
        "transformers-checkpointing-replaced",
        f"Transformers' activation checkpointing is on in {type(model).__name__} "
        f"({len(flagged)} modules flagged); gradckpt turns it off while it measures the model "
        "and while its plan is applied, since a layer checkpointed by both would be recomputed "
        "twice. gradckpt.disable(model) turns it back on; to keep Transformers' instead, do not "
        "call gradckpt.enable or pass GradckptCallback to the Trainer.",
    )
    return _switched_off(flagged, "gradient_checkpointing")


def _flags_say_checkpointing(pretrained: list[nn.Module]) -> Callable[[], None]:
    """``is_activation_checkpointing`` reads ``gradient_checkpointing`` on every module. Set it
    on the PreTrainedModels only: Transformers' checkpointing happens in its layers
    (``GradientCheckpointingLayer``), which stay off; on a model class the flag only makes
    ``use_cache`` off in training, which gradckpt does anyway."""
    missing = object()
    before = [(m, m.__dict__.get("gradient_checkpointing", missing)) for m in pretrained]
    for module in pretrained:
        module.gradient_checkpointing = True
        _flagged_by_plans[module] = _flagged_by_plans.get(module, 0) + 1

    def restore() -> None:
        for module, value in before:
            if value is missing:
                module.__dict__.pop("gradient_checkpointing", None)
            else:
                module.gradient_checkpointing = value
            left = _flagged_by_plans.get(module, 1) - 1
            if left:
                _flagged_by_plans[module] = left
            else:
                _flagged_by_plans.pop(module, None)

    return restore


def _answer_checkpointing_calls(
    model: nn.Module, pretrained: list[nn.Module]
) -> Callable[[], None]:
    """Instance attributes that shadow Transformers' switches while a plan is applied."""

    def keep_the_plan(*args: Any, **kwargs: Any) -> None:
        warn_once(
            "transformers-checkpointing-call-ignored",
            f"{type(model).__name__} has a gradckpt plan applied, so Transformers' "
            "activation_checkpointing_enable() / gradient_checkpointing_enable() was not "
            "carried out: both would recompute the same layers. The plan stays; call "
            "gradckpt.disable(model) first to use Transformers' checkpointing instead.",
        )

    def remove_the_plan(owner: nn.Module, name: str) -> Callable[..., Any]:
        def disable(*args: Any, **kwargs: Any) -> Any:
            from ..apply import disable as disable_plan

            disable_plan(model)  # takes these shadows off too
            return getattr(owner, name)(*args, **kwargs)

        return disable

    installed = []
    for owner in pretrained:
        for name in _ENABLE_METHODS:
            owner.__dict__[name] = keep_the_plan
            installed.append((owner, name, keep_the_plan))
        for name in _DISABLE_METHODS:
            shadow = remove_the_plan(owner, name)
            owner.__dict__[name] = shadow
            installed.append((owner, name, shadow))

    def restore() -> None:
        for owner, name, shadow in installed:
            if owner.__dict__.get(name) is shadow:
                del owner.__dict__[name]

    return restore


register_ecosystem_hook(adapt_transformers)


class NoLanguageModelError(ValueError):
    """Transformers has neither a causal nor a sequence-to-sequence language model for a config
    (a vision model's, say): it cannot be built from the config alone."""


def model_from_config_json(path: str | Path) -> Any:
    """The language model a Hugging Face ``config.json`` describes, with random weights.

    Nothing is downloaded. Encoder-decoder configs (T5, BART) give the sequence-to-sequence
    model, the others the causal one; the key/value cache is off, as for training. A
    ``model_type`` Transformers does not know is refused naming the close ones (Transformers' own
    error lists all of its ~900 model types on one line).

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
        >>> settings = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
        ...             "vocab_size": 64, "n_positions": 32}
        >>> _ = path.write_text(json.dumps(settings))
        >>> model = model_from_config_json(path)
        >>> type(model).__name__, model.config.use_cache
        ('GPT2LMHeadModel', False)
        >>> _ = path.write_text(json.dumps({"model_type": "lama"}))
        >>> model_from_config_json(path)
        Traceback (most recent call last):
        ...
        ValueError: unknown model_type 'lama' in ...config.json; did you mean 'llama', ...
    """
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "planning a config.json needs Hugging Face Transformers: pip install 'gradckpt[hf]'"
        ) from None
    path = Path(path)
    try:
        settings = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(settings, dict) or "model_type" not in settings:
        raise ValueError(f"{path} has no 'model_type': not a Hugging Face model config.json")
    _check_model_type(settings["model_type"], path)
    config = transformers.AutoConfig.for_model(**settings)
    config.use_cache = False  # training: the key/value cache only costs memory
    # Encoder-decoder configs (T5, BART) train as sequence-to-sequence models, the rest as
    # causal language models; both on input_ids and labels.
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    try:
        return auto.from_config(config)  # random weights
    except ValueError:
        kind = "sequence-to-sequence" if seq2seq else "causal language"
        raise NoLanguageModelError(
            f"{path}: Transformers has no {kind} model for model_type "
            f"{settings['model_type']!r}"
        ) from None


def _check_model_type(model_type: Any, path: Path) -> None:
    """Refuse a ``model_type`` Transformers does not know, naming the close ones and where to
    see them all."""
    from transformers import CONFIG_MAPPING, __version__

    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING:
        return  # known, or not a name: Transformers says what is wrong with it
    known = list(CONFIG_MAPPING.keys())  # the lazy mapping has no len()
    raise ValueError(
        f"unknown model_type {model_type!r} in {path}{did_you_mean(model_type, known)} "
        f"(Transformers {__version__} knows {len(known)} model types; see "
        "transformers.CONFIG_MAPPING)"
    )


def is_language_model(model: Any) -> bool:
    """Whether ``model`` has a Hugging Face config with a vocabulary, so that ``token_sample``
    can make its batch.

    Example:
        >>> import torch
        >>> is_language_model(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int)


def token_sample(model: Any, batch: int, seq: int) -> dict[str, Any]:
    """Random ``input_ids`` and ``labels`` of shape (batch, seq): what a causal language model
    trains on (a sequence-to-sequence one reads labels as its targets, of the same length here).

    Example:
        >>> from types import SimpleNamespace
        >>> sample = token_sample(SimpleNamespace(config=SimpleNamespace(vocab_size=64)), 2, 8)
        >>> tuple(sample["input_ids"].shape), bool((sample["labels"] == sample["input_ids"]).all())
        ((2, 8), True)
    """
    import torch

    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    return {"input_ids": tokens, "labels": tokens.clone()}
