"""What a plan's blocks were when it was made, to tell a model it was not made for.

A plan names its blocks (``"model.layers.3"``); another model with blocks of those names, a
wider one or a deeper one, would take it silently, and its predictions (the peak that fits the
budget) would be another model's. ``chain_fingerprint`` records, from the model the profile
measured, each block's parameters (names, and shapes where they are floating point: a quantised
weight's packing differs between a base built on the meta device and a loaded one, so it counts
by dtype) and how many blocks each container of blocks held (``model.layers``: 32), and
``fingerprint_mismatch`` says how another model differs, or nothing. Class names are left out:
FSDP2 renames a block's class (``FSDPLlamaDecoderLayer``) and shards its parameters (their
global shapes unchanged), and a plan crosses that way from an estimate to the ranks.

Example:
    >>> import torch
    >>> chain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> blocks, containers = chain_fingerprint(chain, ["0", "1"])
    >>> blocks[0], containers
    ('bias=[4]; weight=[4, 4]', {'': 2})
    >>> wider = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    >>> print(fingerprint_mismatch(wider, ["0", "1"], blocks, containers))
    block '0': its bias was [4] when the plan was made, and is [8] here
"""

from __future__ import annotations

from torch import nn

__all__ = ["BLOCK_FINGERPRINTS", "CHAIN_LENGTHS", "chain_fingerprint", "fingerprint_mismatch"]

BLOCK_FINGERPRINTS = "block_fingerprints"
"""``Profile.notes`` key: per block, its parameters in words (``chain_fingerprint``)."""
CHAIN_LENGTHS = "chain_lengths"
"""``Profile.notes`` key: per module holding blocks, how many children it has."""


def chain_fingerprint(model: nn.Module, block_names: list[str]) -> tuple[list[str], dict[str, int]]:
    """Per block of ``block_names`` (qualified names in ``model``), its parameters in words;
    and per module holding blocks (by name, ``""`` for the model itself), how many children it
    has."""
    modules = dict(model.named_modules())
    blocks = [_parameters_in_words(modules[name]) for name in block_names]
    containers = {}
    for name in block_names:
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent in modules:
            containers[parent] = len(list(modules[parent].children()))
    return blocks, containers


def fingerprint_mismatch(
    model: nn.Module, block_names: list[str], blocks: list[str], containers: dict[str, int]
) -> str | None:
    """How ``model``'s blocks differ from the fingerprint a plan recorded (``blocks``,
    ``containers``), in words; None where they do not (or nothing was recorded)."""
    if not blocks:
        return None  # a plan made by hand, or read from an older plan's JSON
    now_blocks, now_containers = chain_fingerprint(model, block_names)
    for name, then, now in zip(block_names, blocks, now_blocks, strict=True):
        if then != now:
            return f"block {name!r}: {_first_difference(then, now)}"
    for parent, count in containers.items():
        if now_containers.get(parent, count) != count:
            where = repr(parent) if parent else "the model"
            return (f"{where} held {count} blocks when the plan was made, and holds "
                    f"{now_containers[parent]} here")
    return None


def _parameters_in_words(block: nn.Module) -> str:
    described = []
    for name, parameter in sorted(block.named_parameters()):
        size = (list(parameter.shape) if parameter.dtype.is_floating_point
                else str(parameter.dtype).removeprefix("torch."))
        described.append(f"{name}={size}")
    return "; ".join(described) if described else "no parameters"


def _first_difference(then: str, now: str) -> str:
    """The first parameter two blocks' words differ in, in words."""
    before = dict(item.split("=", 1) for item in then.split("; ") if "=" in item)
    after = dict(item.split("=", 1) for item in now.split("; ") if "=" in item)
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            return f"its {name} was there when the plan was made, and is not here"
        if name not in before:
            return f"its {name} is here, and was not there when the plan was made"
        if before[name] != after[name]:
            return (f"its {name} was {before[name]} when the plan was made, and is "
                    f"{after[name]} here")
    return f"its parameters were {then} when the plan was made, and are {now} here"

