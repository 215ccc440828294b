"""Integrations map plans onto ecosystems (Hugging Face Transformers: ``hf``).

The core imports none of them: each reaches into one outside library, which stays optional.
What the core must have done to a model of their kind reaches it through the ecosystem hooks they
register (``gradckpt.ecosystem_hooks``); ``gradckpt`` imports this package to register them.
"""

# Each registers its ecosystem hook: caches off while gradckpt works; a causal LM's loss in
# chunks when the plan says so; bitsandbytes 4-bit and 8-bit layers counted and run as they train.
from . import hf, hf_head, quantized, quantized_8bit  # noqa: F401
