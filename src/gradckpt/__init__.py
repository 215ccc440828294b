"""gradckpt: gradient checkpointing for PyTorch that fits a memory budget.

The engine (``checkpoint``, ``checkpoint_module``) decides, for each tensor a region would save
for backward, whether to keep it, recompute it or offload it. See README.md and docs/ for the
pipeline.
"""

from . import integrations  # noqa: F401  (registers the ecosystem hooks)
from .apply import apply, disable, get_plan
from .enable import enable
from .engine import (
    Fate,
    checkpoint,
    checkpoint_module,
    debug_mode,
    is_checkpointed,
    linear_cross_entropy,
    offload_matmuls,
    save_matmuls,
    uncheckpoint_module,
)
from .errors import BudgetError, CheckpointError, GradckptError, GradckptWarning, UsageError
from .measure import find_blocks, peak_memory, profile
from .plan import Plan
from .predict import estimate
from .profile_types import BlockProfile, Profile
from .solvers import solve

__version__ = "0.1.0"

__all__ = [
    "BlockProfile",
    "BudgetError",
    "CheckpointError",
    "Fate",
    "GradckptError",
    "GradckptWarning",
    "Plan",
    "Profile",
    "UsageError",
    "__version__",
    "apply",
    "checkpoint",
    "checkpoint_module",
    "debug_mode",
    "disable",
    "enable",
    "estimate",
    "find_blocks",
    "get_plan",
    "is_checkpointed",
    "linear_cross_entropy",
    "offload_matmuls",
    "peak_memory",
    "profile",
    "save_matmuls",
    "solve",
    "uncheckpoint_module",
]
