"""What MODEL on the ``gradckpt plan`` command line names: a Hugging Face config.json (or a
folder holding one), a built-in name, or ``package.module:factory``."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from gradckpt.integrations import hf

from .builtin_models import BUILTIN_MODELS, PlanTarget
from .errors import CommandLineError, one_line

__all__ = ["resolve_model"]


_FACTORY_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def resolve_model(spec: str, batch: int, seq: int) -> PlanTarget:
    """The model MODEL names: a config.json or a folder with one, a built-in, or a factory.

    Example:
        >>> target = resolve_model("mlp-chain", batch=2, seq=3)
        >>> target.description, tuple(target.sample.shape)
        ('mlp_chain(16, 256)', (2, 3, 256))
    """
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"folder {spec} holds no config.json")
    if path.is_file():
        return _from_config_json(path, batch, seq)
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec][1](batch, seq)
    if _FACTORY_PATTERN.fullmatch(spec):
        return _from_factory(spec, batch, seq)
    if spec.endswith(".json") or os.sep in spec:
        raise FileNotFoundError(f"no such file: {spec}")
    raise CommandLineError(
        f"unknown model {spec!r}: give a Hugging Face config.json (or a folder holding one), "
        f"a built-in name ({', '.join(BUILTIN_MODELS)}; see 'gradckpt plan --list') or "
        "package.module:factory"
    )


def _from_config_json(path: Path, batch: int, seq: int) -> PlanTarget:
    try:
        model = hf.model_from_config_json(path)
    except hf.NoLanguageModelError as error:
        raise ValueError(
            f"{error}; plan it with package.module:factory (a function returning the model and "
            "a sample)"
        ) from None
    sample = hf.token_sample(model, batch, seq)
    return PlanTarget(model, sample, f"{type(model).__name__} from {path}")


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
