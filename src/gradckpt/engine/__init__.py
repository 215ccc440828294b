"""The checkpoint engine: run a region so that what it saves for backward gets a fate.

``checkpoint(fn, *args, **kwargs)`` runs ``fn`` once, normally, but every tensor that autograd
would save for the backward pass is handed to us instead (``saved_tensors_hooks``). We keep only a
small "slot" per saved tensor; when backward asks for one, we run ``fn`` again on the same inputs
(under the RNG, autocast, default device and dtype and global settings of the forward pass:
``ambient.py``) and hand out the tensors this recomputation saves. A policy (``fates.py``)
can mark operations whose outputs are kept, or offloaded to CPU memory, instead of recomputed;
``fate_per_op.py`` is where each saved tensor gets its fate.

Invariants (docs/engine.md, "Guarantees"; tests cite them by number):

1. Gradients, outputs and parameter updates equal the plain model's, bit for bit where the ops
   are deterministic, dropout included: RNG state is replayed for the CPU and every device, and
   so is every other state the region's operations depend on (default device and dtype, fake
   mode, deterministic algorithms, precision and kernel settings).
2. Recomputation has no side effect a user can see: module buffers (BatchNorm running
   statistics) and the tensors modules keep as attributes (a recurrent layer's last state)
   end the step as if each block ran forward once. Module hooks do run again.
3. Without grad (``no_grad``, ``inference_mode``) the engine does nothing at all.
4. Frozen inputs work: a region whose inputs do not require grad still gives its parameters
   their gradients.
5. Keyword arguments, non-tensor outputs, nested checkpoints, ``torch.autograd.grad``,
   ``backward(retain_graph=True)`` twice and autocast behave as without checkpointing.
6. Recomputation stops as soon as the tensors backward needs exist, and frees them after use.
7. A mismatch between forward and recomputation is a ``CheckpointError``, never a wrong grad:
   so is a parameter, buffer or input changed in place before backward. A kept or offloaded
   output changed in place after the region is noticed (version counter) and recomputed.

How nesting and lifetimes work (the rules that region.py implements):

R1. A saved tensor belongs to the innermost active checkpoint only (its hooks are on top).
R2. A checkpoint saves its own inputs through a no-op autograd node. At top level that simply
    keeps them; inside another checkpoint they become that parent's saved tensors, so the parent
    drops them and recomputing the parent brings them back. Recomputing a tensor therefore
    recomputes every checkpoint around it, outermost first.
R3. Recomputation starts as if no checkpoint were active; checkpoints met while recomputing are
    respected (so a nested schedule recomputes the inner segment again, with bounded memory).
R4. Recomputed tensors belong to one backward pass (its graph task id). Each is handed out once
    and dropped; whatever that backward never asked for is dropped when it ends.
R5. Recomputation raises ``_RecomputationComplete`` the moment the last slot is filled, which
    skips the rest of the region (invariant 6).
R6. The graph recomputation builds holds what it saves only while recomputation runs: a
    reference the region leaves behind (``self.state = h``, a list, a cache) keeps that
    graph's nodes, not the block's recomputed activations or the region itself.
"""

# Internal interface for gradckpt's own stages (not the user API): what apply installs plans
# with and what measuring shares with the engine, so that it records a block's call and tells
# tensors apart exactly as the engine does. Later stages import these from here, never the
# engine's underscore names, so that the engine's insides can change without them.
from .ambient import AutocastSnapshot, RngSnapshot
from .chunked_head import (
    AUTO,
    HeadChunking,
    chunk_head,
    default_head_chunks,
    head_chunk_calls,
    head_chunks_forced,
    heads_called,
    linear_cross_entropy,
    planned_head_chunks,
    vocabulary_size,
)
from .debug import debug_mode
from .fate_per_op import dispatch_seconds_per_operation
from .fates import (
    MATMUL_AND_ATTENTION_NAMES,
    OFFLOAD_OPS,
    SAVE_OPS,
    Fate,
    Policy,
    PolicyLike,
    asks_policy,
    is_matmul_or_attention,
    keeps_operation,
    offload_matmuls,
    operations_kept_by,
    save_matmuls,
    save_ops_policy_name,
)
from .module import (
    checkpoint_module,
    is_checkpointed,
    refuse_checkpointed_modules,
    uncheckpoint_module,
)
from .region import checkpoint
from .segments import SegmentsHandle, checkpoint_segments, continues_chain
from .suspension import plans_suspended
from .tensors import detached_like, first_tensor, storage_key

__all__ = [
    # the user API (re-exported by gradckpt)
    "checkpoint",
    "checkpoint_module",
    "uncheckpoint_module",
    "is_checkpointed",
    "debug_mode",
    "Fate",
    "save_matmuls",
    "offload_matmuls",
    "linear_cross_entropy",
    # internal interface for gradckpt's own stages
    "AutocastSnapshot",
    "RngSnapshot",
    "checkpoint_segments",
    "refuse_checkpointed_modules",
    "SegmentsHandle",
    "continues_chain",
    "plans_suspended",
    "detached_like",
    "first_tensor",
    "storage_key",
    "Policy",
    "PolicyLike",
    "is_matmul_or_attention",
    "asks_policy",
    "SAVE_OPS",
    "OFFLOAD_OPS",
    "MATMUL_AND_ATTENTION_NAMES",
    "save_ops_policy_name",
    "operations_kept_by",
    "keeps_operation",
    "dispatch_seconds_per_operation",
    "AUTO",
    "HeadChunking",
    "chunk_head",
    "default_head_chunks",
    "head_chunk_calls",
    "head_chunks_forced",
    "heads_called",
    "planned_head_chunks",
    "vocabulary_size",
]
