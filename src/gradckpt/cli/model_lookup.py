"""What MODEL on the ``gradckpt plan`` command line names: a Hugging Face config.json (or a
folder holding one), a built-in name, a known config (``llama-3-8b``: hyper-parameters only) or
``package.module:factory``.

For ``--estimate`` (``on_meta=True``) configs are built on the meta device and trained on meta
tensors: parameters and batches with shapes and no memory, so a model far larger than this
machine plans here. Built-ins and factories are built as they always are (small, or the user's
own code, which may need real tensors); ``estimate`` runs them on fake tensors all the same.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from gradckpt.integrations import hf

from .builtin_models import BUILTIN_MODELS, PlanTarget
from .errors import CommandLineError, did_you_mean, one_line
from .known_configs import KNOWN_CONFIGS

__all__ = ["build_known_model", "check_measurable", "check_model_name", "resolve_model"]


_FACTORY_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def resolve_model(spec: str, batch: int, seq: int, *, on_meta: bool = False) -> PlanTarget:
    """The model MODEL names: a config.json or a folder with one, a built-in, a known config,
    or a factory. ``on_meta``: configs built on the meta device, with a meta batch.

    Example:
        >>> target = resolve_model("mlp-chain", batch=2, seq=3)
        >>> target.description, tuple(target.sample.shape)
        ('mlp_chain(16, 256)', (2, 3, 256))
        >>> target = resolve_model("gpt2-xl", batch=1, seq=64, on_meta=True)
        >>> target.sample["input_ids"].device.type, len(target.model.transformer.h)
        ('meta', 48)
    """
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"folder {spec} holds no config.json")
    if path.is_file():
        return _from_config_json(path, batch, seq, on_meta)
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec][1](batch, seq)
    if spec in KNOWN_CONFIGS:
        return _from_known_config(spec, batch, seq, on_meta)
    if _FACTORY_PATTERN.fullmatch(spec):
        return _from_factory(spec, batch, seq)
    _refuse_unknown_model(spec)


def check_model_name(spec: str) -> None:
    """Refuse a MODEL that names nothing, with the close names, before any slow work (building
    or profiling anything); ``resolve_model`` refuses it the same way.

    Example:
        >>> check_model_name("tinygpt")
        >>> check_model_name("tinygtp")
        Traceback (most recent call last):
        ...
        gradckpt.cli.errors.CommandLineError: unknown model 'tinygtp'; did you mean 'tinygpt'? ...
    """
    named = spec in BUILTIN_MODELS or spec in KNOWN_CONFIGS or _FACTORY_PATTERN.fullmatch(spec)
    if not (named or Path(spec).exists()):
        _refuse_unknown_model(spec)


def _refuse_unknown_model(spec: str) -> NoReturn:
    if spec.endswith(".json") or os.sep in spec:
        raise FileNotFoundError(f"no such file: {spec}")
    hint = did_you_mean(spec, [*BUILTIN_MODELS, *KNOWN_CONFIGS])
    if hint:  # "llama3-8b", "Mistral-7B": most likely a known config's name, misspelt
        raise CommandLineError(
            f"unknown model {spec!r}{hint} (see 'gradckpt plan --list': "
            f"built-ins {', '.join(BUILTIN_MODELS)}; known configs {', '.join(KNOWN_CONFIGS)})"
        )
    raise CommandLineError(
        f"unknown model {spec!r}: give a Hugging Face config.json (or a folder holding one), "
        f"a built-in name ({', '.join(BUILTIN_MODELS)}; see 'gradckpt plan --list') or "
        "package.module:factory"
    )


def _from_config_json(path: Path, batch: int, seq: int, on_meta: bool) -> PlanTarget:
    import torch

    settings = _read_settings(path)
    try:  # an unknown model_type is refused there, naming the close ones (exit status 1)
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = hf.model_from_config_json(path)
    except hf.NoLanguageModelError as error:
        raise ValueError(
            f"{error}; plan it with package.module:factory (a function returning the model and "
            "a sample)"
        ) from None
    sample = _meta_token_sample(batch, seq) if on_meta else hf.token_sample(model, batch, seq)
    return PlanTarget(
        model, sample, f"{type(model).__name__} from {path}",
        config_dtype=_config_dtype(settings),
    )


def _read_settings(path: Path) -> Any:
    """What a config.json holds; None when it is no JSON (``hf.model_from_config_json`` says
    where it is wrong)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _from_known_config(name: str, batch: int, seq: int, on_meta: bool) -> PlanTarget:
    known = KNOWN_CONFIGS[name]
    model = build_known_model(name, on_meta=on_meta)
    sample = _meta_token_sample(batch, seq) if on_meta else hf.token_sample(model, batch, seq)
    description = f"{type(model).__name__} {name} ({known.source}'s config, no weights)"
    return PlanTarget(model, sample, description, config_dtype=known.dtype)


def build_known_model(name: str, *, on_meta: bool) -> Any:
    """The causal language model of a known config: random weights, or on the meta device.

    Example:
        >>> model = build_known_model("llama-3-8b", on_meta=True)  # shapes only: no memory
        >>> sum(p.numel() for p in model.parameters()), model.config.use_cache
        (8030261248, False)
    """
    import torch

    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"{name} is a Hugging Face Transformers config: pip install 'gradckpt[hf]'"
        ) from None
    config = transformers.AutoConfig.for_model(**KNOWN_CONFIGS[name].settings)
    config.use_cache = False  # training: the key/value cache only costs memory
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return transformers.AutoModelForCausalLM.from_config(config)


def _meta_token_sample(batch: int, seq: int) -> dict[str, Any]:
    """``input_ids`` and ``labels`` of shape (batch, seq) as meta tensors: shapes, no memory
    (``estimate`` needs no values: it plans for batches without padding)."""
    import torch

    return {
        "input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta"),
        "labels": torch.zeros(batch, seq, dtype=torch.long, device="meta"),
    }


def _config_dtype(settings: Any) -> str | None:
    """The dtype a config.json names (``dtype`` in Transformers 5, ``torch_dtype`` before),
    when it is a floating one; else None."""
    if not isinstance(settings, dict):
        return None
    name = settings.get("dtype") or settings.get("torch_dtype")
    return name if name in ("float32", "bfloat16", "float16") else None


def _from_factory(spec: str, batch: int, seq: int) -> PlanTarget:
    from torch import nn

    module_name, function_name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: factories next to the user
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"cannot import {module_name!r} for {spec}: {error}") from None
    factory = module
    for attribute in function_name.split("."):
        factory = getattr(factory, attribute, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no function {function_name!r} (from {spec})")
    parameters = _parameter_names(factory)
    keywords = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in parameters}
    try:
        result = factory(**keywords)
    except Exception as error:
        raise RuntimeError(
            f"factory {spec} raised {type(error).__name__}: {one_line(error)}"
        ) from error
    model, sample = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"factory {spec} returned {type(model).__name__}; it must return an nn.Module or "
            "(module, sample)"
        )
    if sample is None:
        if not hf.is_language_model(model):
            raise ValueError(
                f"factory {spec} returned a {type(model).__name__} without a sample, and "
                "gradckpt cannot tell what it takes: return (model, sample), where the sample "
                "is a tensor, a tuple or a dict of the model's inputs"
            )
        sample = hf.token_sample(model, batch, seq)
    return PlanTarget(model, sample, f"{type(model).__name__} from {spec}")


def _parameter_names(function: Callable) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def check_measurable(name: str, device: Any) -> None:
    """Refuse to measure a known config whose parameters and gradients alone (fp32, as it is
    built for measuring) need more than ``device`` has, before allocating any of it: such a
    model is for ``--estimate``.

    Example:
        >>> check_measurable("llama-3-8b", "cpu")  # doctest: +SKIP
        Traceback (most recent call last):
        ...
        gradckpt.cli.errors.CommandLineError: llama-3-8b: measuring it here needs its ...
    """
    from gradckpt.budget import available_bytes, format_bytes
    from gradckpt.measure.tensors import tensor_bytes

    model = build_known_model(name, on_meta=True)  # shapes only, to count the bytes
    needed_bytes = 2 * sum(tensor_bytes(p) for p in model.parameters())
    room_bytes = available_bytes(device)
    if needed_bytes > room_bytes:
        raise CommandLineError(
            f"{name}: measuring it here needs its parameters and gradients, "
            f"{format_bytes(needed_bytes)} in fp32 before any activation, and {device} has "
            f"{format_bytes(room_bytes)}; predict its plan with --estimate instead (no memory, "
            f"no weights), e.g. gradckpt plan {name} --estimate --device h100-80gb --budget 70GiB"
        )
