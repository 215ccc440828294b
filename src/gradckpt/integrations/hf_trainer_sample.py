"""The batch ``GradckptCallback`` plans for: the Trainer's first batch, drawn without moving
any random state, on the model's device, padded to the longest the run will see.

Example:
    >>> import torch
    >>> padded({"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[5, 6]])}, 4, 0)
    {'input_ids': tensor([[5, 6, 0, 0]]), 'labels': tensor([[   5,    6, -100, -100]])}
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import UsageError

__all__ = ["collator_of", "first_batch", "on_device", "pad_token_id_for", "padded"]

# The value each padded position gets, by batch key; any other integer tensor gets 0.
_LABEL_PAD_ID = -100  # what Transformers' losses ignore
_TOKEN_KEYS = ("input_ids", "decoder_input_ids")


def first_batch(train_dataloader: Any) -> Any:
    """The data loader's first batch, every random state it advances put back as it was."""
    with _random_states_preserved(train_dataloader):
        iterator = iter(train_dataloader)
        try:
            return next(iterator)
        except StopIteration:
            raise UsageError(
                "GradckptCallback: the training data loader gave no batch to profile the model "
                "on; pass one: GradckptCallback(sample={...})"
            ) from None
        finally:
            close = getattr(iterator, "close", None)  # Accelerate's loaders are generators
            if close is not None:
                close()


@contextlib.contextmanager
def _random_states_preserved(train_dataloader: Any) -> Iterator[None]:
    # Drawing a batch draws from torch's generator (the sampler's seed, the workers' base
    # seed) and possibly from a generator of the data loader's own; without restoring them the
    # run would shuffle and drop out differently from the same run without the callback.
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    generators = _generators_in(train_dataloader)
    generator_states = [generator.get_state() for generator in generators]
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        for generator, generator_state in zip(generators, generator_states, strict=True):
            generator.set_state(generator_state)


def _generators_in(train_dataloader: Any) -> list[torch.Generator]:
    """The ``torch.Generator``s a data loader, its samplers and Accelerate's wrapper hold."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    pending = [train_dataloader]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Generator):
            found[id(item)] = item
            continue
        for name in ("generator", "synchronized_generator", "sampler", "batch_sampler",
                     "base_dataloader"):
            try:
                value = getattr(item, name, None)
            except Exception:  # an attribute computed by a wrapper; not a generator anyway
                continue
            if value is not None:
                pending.append(value)
    return list(found.values())


def collator_of(train_dataloader: Any) -> Any:
    """The user's collator, unwrapped from the Trainer's ``RemoveColumnsCollator``."""
    collator = getattr(train_dataloader, "collate_fn", None)
    while getattr(collator, "data_collator", None) is not None:
        collator = collator.data_collator
    return collator


def pad_token_id_for(collator: Any, processing_class: Any, model: nn.Module) -> int:
    tokenizer = getattr(collator, "tokenizer", None)
    if tokenizer is None:
        tokenizer = processing_class
    for source in (tokenizer, getattr(model, "config", None)):
        pad_token_id = getattr(source, "pad_token_id", None)
        if isinstance(pad_token_id, int) and not isinstance(pad_token_id, bool):
            return pad_token_id
    return 0


def on_device(sample: Any, device: torch.device) -> Any:
    if isinstance(sample, torch.Tensor):
        return sample.to(device)
    if isinstance(sample, Mapping):  # a BatchEncoding is a Mapping, not a dict
        return {key: on_device(value, device) for key, value in sample.items()}
    if isinstance(sample, (tuple, list)):
        return type(sample)(on_device(value, device) for value in sample)
    return sample


def padded(sample: Any, max_length: int, pad_token_id: int) -> Any:
    if isinstance(sample, Mapping):
        return {
            key: _padded_tensor(value, max_length, _pad_value(key, pad_token_id))
            for key, value in sample.items()
        }
    if isinstance(sample, (tuple, list)):
        return type(sample)(_padded_tensor(value, max_length, 0) for value in sample)
    return _padded_tensor(sample, max_length, 0)


def _pad_value(key: str, pad_token_id: int) -> int:
    if key == "labels":
        return _LABEL_PAD_ID
    if key in _TOKEN_KEYS:
        return pad_token_id
    return 0


def _padded_tensor(value: Any, max_length: int, pad_value: int) -> Any:
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != 2
        or value.dtype.is_floating_point
        or value.dtype.is_complex
        or value.dtype == torch.bool
        or value.shape[1] >= max_length
    ):
        return value
    padding = value.new_full((value.shape[0], max_length - value.shape[1]), pad_value)
    return torch.cat([value, padding], dim=1)
