"""Predicting: model + sample + target device -> ``Profile``, without real compute.

``estimate`` runs measuring's own code (``gradckpt.measure.profile``) on fake tensors, so the
bytes come out as ``profile`` would measure them, for a model this machine could never hold.
What prediction adds lives here:

- ``estimate.py``: ``gradckpt.estimate``, the one entry (``world_size`` included);
- ``clock.py``: the modeled clock, a roofline per operation on the target device;
- ``attention.py``: the attention kernel PyTorch would pick on the target GPU;
- ``per_rank.py``: one rank's profile when FSDP2 shards the model over ``world_size`` ranks;
- ``devices/``: the device catalogue (presets, this machine, numbers a user gives).

Example:
    >>> import torch, gradckpt
    >>> from gradckpt.toy_models import GPTConfig, TinyGPT
    >>> with torch.device("meta"):
    ...     model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> idx = torch.randint(0, 512, (2, 16), device="meta")
    >>> gradckpt.estimate(model, {"idx": idx, "targets": idx}, device="h100").device
    'cuda'
"""

from .estimate import estimate

__all__ = ["estimate"]
