"""Does gradckpt train every architecture of the installed Transformers as the plain model does?

The question (issue 28, item 2): users fine-tune whatever was released last month, not the
families the tests build. For every model type of Transformers' causal-LM mapping
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; ``--mappings`` names others: the masked-LM, seq-to-seq
and image-classification mappings, as far as they build), this builds the model from a TINY
config (hidden 64, 2 layers, 4 heads, vocabulary 256, attention dropout 0.1 where the config
has it; image models: 128x128 images, patches of 8, each stage's depth 2 and its width cut to
128; random weights, nothing downloaded) and a batch with ``labels`` as a fine-tuning script's
collator makes it (an encoder-decoder's ``decoder_input_ids`` from its labels), and runs:

1. the plain step twice from the same seed: does the plain model repeat itself (loss and
   gradients equal)?
2. ``gradckpt.enable(model, batch, budget="60%", optimizer="adamw")``, or the least feasible
   budget (``BudgetError.minimum_bytes``) where 60% cannot be met; then the step users write,
   with a real AdamW, measured side by side with the plain one (``gradckpt.side_by_side.
   compare_plans``: the loop's second step on the package's meter, MemTracker on CPU): its
   gradients equal to the plain model's (bit for bit; within float rounding where the plan
   computes the loss in chunks), its measured peak within the plan's budget + 3%, and against
   the predicted peak;
3. Transformers' own ``model.gradient_checkpointing_enable()`` beside it: supported? equal
   gradients? its peak against the plain one.

Each architecture starts from a fresh, seeded state, with a time limit (``--limit``, 60 s of the
process's CPU time, so that a loaded machine does not turn slow rows into failures):
past it, or on any exception, it is listed with the reason. An architecture whose tiny config
or model cannot be built, or whose plain step fails, is "outside gradckpt": it is listed but not
counted. The closing line is ``N/M architectures that train plainly pass``: M those whose plain
step trains, N those of them that pass (gradients and budget).

    .venv/bin/python bench/architectures.py                    # every causal LM: ~30 min
    .venv/bin/python bench/architectures.py --only llama,gpt2  # a subset
    .venv/bin/python bench/architectures.py --mappings masked-lm,seq2seq,image-classification \
        --json results.json                                    # the other mappings: ~25 min
    .venv/bin/python bench/architectures.py --all-mappings     # all four

Run without ``--only`` the table is written to ``docs/results/architectures_cpu.txt`` (the
causal-LM mapping alone) or ``architectures_all_cpu.txt`` (any other choice of mappings). Memory
only, no timing: the machine may be busy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _common
import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

import gradckpt
from gradckpt.integrations.hf import turn_caches_off
from gradckpt.side_by_side import UsersStep, compare_gradients, compare_plans

OVER_BUDGET = 0.03  # what the measured peak may exceed the budget by
BUDGET = "60%"
BATCH, SEQ, IMAGE = 2, 128, 128
VOCAB = 256
ROOT = Path(__file__).resolve().parents[1]

# The mappings swept, by the name --all-mappings gives them, and the batch each trains on.
MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

# ---------------------------------------------------------------------------------------------
# Tiny configs
# ---------------------------------------------------------------------------------------------

# Config fields set where a config has them (and is bigger), by what they size.
WIDTH, LAYERS = 64, 2
SIZES: dict[str, int] = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim",
                     "model_dim", "word_embed_proj_dim", "embedding_size"], WIDTH),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "d_ff", "n_inner", "ffn_hidden_size",
                     "encoder_ffn_dim", "decoder_ffn_dim", "dim_feedforward", "hidden_dim",
                     "inner_hidden_size", "filter_size"], 2 * WIDTH),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size",
                     "expert_intermediate_size", "moe_ffn_hidden_size"], WIDTH),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers",
                     "num_decoder_layers", "encoder_layers", "decoder_layers"], LAYERS),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "n_heads",
                     "encoder_attention_heads", "decoder_attention_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                     "num_key_value_groups"], 2),
    **dict.fromkeys(["head_dim", "d_kv", "attention_head_size", "kv_channels"], 16),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"],
                    4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"], 2),
    **dict.fromkeys(["vocab_size", "text_vocab_size", "unpadded_vocab_size", "src_vocab_size",
                     "tgt_vocab_size", "entity_vocab_size", "pronunciation_vocab_size",
                     "shape_vocab_size"], VOCAB),
    **dict.fromkeys(["emb_dim", "d_inner", "d_latents", "entity_emb_size",
                     "pronunciation_embed_dim", "shape_embed_dim"], WIDTH),
    **dict.fromkeys(["num_latents"], 32),
    **dict.fromkeys(["num_self_attends_per_block"], LAYERS),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                     "seq_length"], 2 * SEQ),
    **dict.fromkeys(["rotary_dim", "qk_rope_head_dim", "qk_nope_head_dim"], 8),
    **dict.fromkeys(["v_head_dim", "kv_lora_rank"], 16),
    **dict.fromkeys(["q_lora_rank"], 32),
    **dict.fromkeys(["n_group", "topk_group"], 1),
    # Mamba2 mixers (Bamba, Falcon-H1, GraniteMoeHybrid) at their defaults, 128 heads over
    # chunks of 256 tokens, made the step 200 times a tiny Llama's (3.5 s on one thread) and
    # profiling it ran past the time limit; chunks of half the sequence keep the scan's
    # passing of state between chunks. The state as Zamba2's default.
    **dict.fromkeys(["mamba_n_heads"], 4),
    **dict.fromkeys(["mamba_d_ssm"], 2 * WIDTH),
    **dict.fromkeys(["mamba_d_state"], 64),
    **dict.fromkeys(["mamba_chunk_size"], SEQ // 2),
    **dict.fromkeys(["image_size"], IMAGE),
    **dict.fromkeys(["patch_size"], 8),
}
# Image models' per-stage lists (a ConvNeXt's or a Swin's four stages): each stage keeps at
# most LAYERS blocks and two heads, and the widths shrink by one power of two to at most
# STAGE_WIDTH (ResNet's 256..2048 to 16..128), so that ratios and divisibility hold; a
# Swin's or a FocalNet's embed_dim (its first stage's width, doubled at each stage) to
# STAGE_EMBED.
STAGE_DEPTHS = ["depths", "depth", "num_block_repeats", "n_attn_blocks", "stage_num_blocks"]
STAGE_HEADS = ["num_heads", "num_attention_heads"]
STAGE_WIDTHS = ["hidden_sizes", "embed_dims", "embed_dim"]
STAGE_WIDTH = 128
STAGE_EMBED = 16
# Set to 0.1 where the config has them: recomputation must replay the dropout masks.
DROPOUTS = ["attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout"]
TOKEN_IDS = ["pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
             "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id"]
FIRST_ID = 8  # ids below this are left to the configs' special tokens

# Where the generic shrinking breaks a config: fields kept at their defaults, by model type
# (sizes tied to fields it does not shrink), and values set over it.
KEEP = {
    "levit": ["patch_size"],  # the stride of its four stem convolutions, 16 by construction
}
OVERRIDES: dict[str, dict[str, Any]] = {
    # Transformers' CvT picks stage i's drop-path rate by i among its depth[i] rates
    # (modeling_cvt.py:422): the third stage needs three blocks
    "cvt": {"depth": [1, 2, 3]},
    "bit": {"num_groups": 4},  # group norms over the shrunk bottlenecks' 4 channels
    # convolutional nets sized by multipliers (EfficientNet-B7's to B0's) or by lists the
    # generic rules do not know: the stages' channels, each stage's input the last's output
    "efficientnet": {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
    "mobilenet_v1": {"depth_multiplier": 0.25},
    "mobilenet_v2": {"depth_multiplier": 0.25},
    "mobilevitv2": {"width_multiplier": 0.5},
    "hgnet_v2": {"stem_channels": [3, 16, 16], "stage_in_channels": [16, 32, 64, 128],
                 "stage_mid_channels": [16, 16, 32, 64], "stage_out_channels": [32, 64, 128, 256],
                 "hidden_sizes": [32, 64, 128, 256]},
    "textnet": {"stem_out_channels": 16, "hidden_sizes": [16, 16, 32, 64, 128]},
    # axial position embeddings: their widths sum to the hidden size, their shape multiplies
    # to the sequence's length
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 16],
                 # its layers reseed the RNG from torch.seed() (nondeterministic) for their
                 # dropout and draw their hashing rotations after: with dropout off and a
                 # hash seed the plain step repeats itself
                 "hash_seed": 0, "hidden_dropout_prob": 0.0,
                 "lsh_attention_probs_dropout_prob": 0.0,
                 "local_attention_probs_dropout_prob": 0.0},
    "perceiver": {"max_position_embeddings": SEQ},  # its masked LM decodes that many tokens
    "esm": {"pad_token_id": 1},  # positions count from the padding id, None by default
    "esmc": {"num_key_value_heads": SIZES["num_attention_heads"]},  # no grouped-query attention
}


LAYER_COUNTS = ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
                "encoder_layers", "decoder_layers"]


def shrink(fields: dict[str, Any], dropout: bool = True) -> dict[str, Any]:
    """The overrides that make the config whose fields (``to_dict()``) are ``fields`` tiny,
    nested configs (``text_config``, ...) included. Per-layer lists (``layer_types``) get
    ``LAYERS`` entries, keeping each kind of layer they have (a hybrid stays hybrid); lists of
    layer indices (``cross_attention_layers``) keep those below ``LAYERS``, or the last layer.
    A stack in sections (``_sections``: Dory's input, recurrent and output layers) keeps a layer
    in each, so it may get more than ``LAYERS``."""
    count = next((k for k in LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    layers = fields[count] if count else None
    sections = _sections(fields, layers)
    wanted = max(LAYERS, sum(fields[name] > 0 for name in sections))
    changes: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, dict) and "model_type" in value:
            changes[name] = value | shrink(value, dropout)
        elif name == "embed_dim" and isinstance(fields.get("depths"), list) and \
                isinstance(value, int) and value > STAGE_EMBED:
            changes[name] = STAGE_EMBED  # the first stage's width, doubled at each stage
        elif name in SIZES and isinstance(value, int) and not isinstance(value, bool):
            if value > SIZES[name]:
                changes[name] = SIZES[name]
        elif name in ("head_dim", "num_key_value_heads", "vocab_size") and value is None:
            changes[name] = SIZES[name]  # derived where None, but not by every model
        elif name in DROPOUTS and isinstance(value, float) and dropout:
            changes[name] = 0.1
        elif name in TOKEN_IDS and isinstance(value, int) and value >= FIRST_ID:
            changes[name] = FIRST_ID - 1 - TOKEN_IDS.index(name) % FIRST_ID
        elif name == "use_cache":
            changes[name] = False
        elif name == "image_size" and isinstance(value, list) and max(value) > IMAGE:
            changes[name] = [IMAGE] * len(value)
        elif _is_stage_list(name, value, layers):
            changes[name] = _per_stage(name, value)
        elif isinstance(value, list) and value and layers and layers > wanted:
            changes[name] = _per_layer(name, value, layers, wanted)
    if sections and layers > wanted:
        changes |= {name: min(fields[name], 1) for name in sections} | {count: wanted}
    if "kv_lora_rank" in fields:  # multi-head latent attention: as many key/value heads, and
        # the head_dim of its rotary part
        changes |= {"num_key_value_heads": SIZES["num_attention_heads"],
                    "head_dim": SIZES["qk_rope_head_dim"]}
    return {name: value for name, value in changes.items() if value is not None}


def _is_stage_list(name: str, value: Any, layers: int | None) -> bool:
    """Whether ``value`` is an image model's per-stage list of integers (a config without a
    layer count: its layers are counted per stage)."""
    return (layers is None and name in (*STAGE_DEPTHS, *STAGE_HEADS, *STAGE_WIDTHS)
            and isinstance(value, list) and bool(value)
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))


def _per_stage(name: str, values: list[int]) -> list[int]:
    """A per-stage list (``_is_stage_list``) shrunk: depths to LAYERS, heads to 2, widths by
    the power of two that brings the widest to STAGE_WIDTH or less (where every width
    divides by it)."""
    if name in STAGE_DEPTHS:
        return [min(v, LAYERS) for v in values]
    if name in STAGE_HEADS:
        return [min(v, 2) for v in values]
    factor = 1
    while max(values) // factor > STAGE_WIDTH and all(v % (2 * factor) == 0 for v in values):
        factor *= 2
    return [v // factor for v in values]


def _sections(fields: dict[str, Any], layers: int | None) -> list[str]:
    """The counts that cut a stack of ``layers`` layers into sections: two or more
    ``*_layers`` fields adding up to it (Dory: ``n_input_layers``, ``n_recurrent_layers``,
    looped over, and ``n_output_layers``)."""
    counts = [name for name, value in fields.items()
              if name.endswith("_layers") and name not in LAYER_COUNTS
              and isinstance(value, int) and not isinstance(value, bool)]
    return counts if len(counts) >= 2 and sum(fields[n] for n in counts) == layers else []


def _per_layer(name: str, values: list[Any], layers: int, wanted: int = LAYERS
               ) -> list[Any] | None:
    """``values`` for ``wanted`` layers where it is a per-layer list or a list of layer indices
    of a config of ``layers`` layers; None where it is neither."""
    integers = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    indices = integers and all(0 <= v < layers for v in values)
    if indices and len(values) < layers and values == sorted(set(values)):
        kept = [v for v in values if v < wanted]
        return kept or [wanted - 1]
    if len(values) != layers:
        return None
    if "heads" in name and integers:
        return [SIZES["num_attention_heads"]] * wanted
    if all(isinstance(v, str) for v in values):
        kinds = list(dict.fromkeys(values))
        return (kinds + values[:wanted])[:wanted] if len(kinds) <= wanted else values[:wanted]
    return values[:wanted]


def own_fields(config: Any) -> dict[str, Any]:
    """``config.to_dict()``; where that reports the layer count otherwise than the config holds
    it (Dory's doubles its counts, and lists each layer's MLP in ``layer_types`` as a layer of
    its own), the config's own values of the fields that differ: its constructor takes them."""
    fields = config.to_dict()
    count = next((k for k in LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    if count is None or getattr(config, count, None) == fields[count]:
        return fields
    return fields | {name: own for name, value in fields.items()
                     if isinstance(value, (int, list)) and not isinstance(value, bool)
                     and isinstance(own := getattr(config, name, value), type(value))
                     and own != value}


def tiny_config(model_type: str, model_class: type, dropout: bool = True) -> Any:
    """Transformers' config of ``model_type`` at its defaults, shrunk (``shrink``); the part
    of it ``model_class`` takes where that is a nested config (a text model's of a
    multimodal config)."""
    config_class = configuration_auto.CONFIG_MAPPING[model_type]
    defaults = own_fields(config_class())
    changes = shrink(defaults, dropout)
    for name in KEEP.get(model_type, []):
        changes.pop(name, None)
    changes |= OVERRIDES.get(model_type, {})
    config = config_class(**changes)
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        nested = [value for name in config.to_dict()
                  if isinstance(value := getattr(config, name, None), wanted)]
        config = nested[0] if nested else config
    config._attn_implementation = "eager"
    return config


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def vocabulary(config: Any) -> int:
    """The smallest vocabulary among the config's (nested ones too): the ids drawn fit all."""
    found = []
    for owner in [config, *(getattr(config, k) for k in dir(config)
                            if k.endswith("_config") and hasattr(getattr(config, k, None),
                                                                  "to_dict"))]:
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > FIRST_ID:
            found.append(size)
    return min(found) if found else VOCAB


def make_batch(kind: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The batch ``kind``'s models train on, with ``labels``, as a fine-tuning script's data
    collator makes it for ``model``."""
    config, generator = model.config, torch.Generator().manual_seed(1)
    takes = inspect.signature(model.forward).parameters
    vocab = vocabulary(config)
    ids = torch.randint(FIRST_ID, vocab, (BATCH, SEQ), generator=generator)
    if kind == "image-classification":
        labels = torch.randint(0, config.num_labels, (BATCH,), generator=generator)
        if "pixel_values" not in takes:  # ImageGPT: pixels as ids of colour clusters
            return {"input_ids": ids, "labels": labels}
        return {**pixels(config, "spatial_shapes" in takes, generator), "labels": labels}
    if kind == "masked-lm":
        labels = torch.full_like(ids, -100)
        labels[:, ::7] = ids[:, ::7]
        return {"input_ids": ids, "labels": labels}
    if kind == "causal-lm" or not getattr(config, "is_encoder_decoder", False):
        # speech-to-text decoders in the seq-to-seq mapping train on text as causal LMs
        return {"input_ids": ids, "labels": ids.clone()}
    labels = torch.randint(FIRST_ID, vocab, (BATCH, SEQ // 2), generator=generator)
    batch = {"input_ids": ids, "labels": labels}
    if hasattr(model, "prepare_decoder_input_ids_from_labels"):
        # as DataCollatorForSeq2Seq does (FSMT shifts its input_ids instead of its labels)
        batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
    return batch


def pixels(config: Any, patches: bool, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random images at the vision config's size, as ``pixel_values``; with ``patches``
    (SigLIP 2) cut into flattened patches, with their mask and grid."""
    vision = getattr(config, "vision_config", None) or config
    channels = getattr(vision, "num_channels", 3)
    size = getattr(vision, "image_size", IMAGE)
    size = size if isinstance(size, int) else IMAGE
    images = torch.randn(BATCH, channels, size, size, generator=generator)
    if not patches:
        return {"pixel_values": images}
    patch = vision.patch_size
    grid = size // patch
    flat = images.reshape(BATCH, channels, grid, patch, grid, patch).permute(0, 2, 4, 3, 5, 1)
    return {"pixel_values": flat.reshape(BATCH, grid * grid, patch * patch * channels),
            "pixel_attention_mask": torch.ones(BATCH, grid * grid, dtype=torch.long),
            "spatial_shapes": torch.tensor([[grid, grid]] * BATCH)}


# ---------------------------------------------------------------------------------------------
# One architecture
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One architecture's row."""

    model_type: str
    mapping: str
    model_class: str
    status: str  # "pass", "fail", "outside" (does not train plainly here), "timeout"
    reason: str = ""
    parameters: int = 0
    plain_reproducible: bool | None = None
    plain_peak: int | None = None
    budget: int | None = None
    budget_ratio: float | None = None  # budget / plain peak
    least_budget: bool = False  # 60% was infeasible: the least feasible budget instead
    measured_peak: int | None = None
    predicted_peak: int | None = None
    gradients: str = ""  # "equal", "rounding 3e-07", "differ: ...", ""
    hf: str = ""  # Transformers' own checkpointing: "equal", "unsupported", ...
    hf_peak: int | None = None
    seconds: float = 0.0
    phase: str = ""  # the step running (or last run)

    @property
    def trains_plainly(self) -> bool:
        """Whether the plain step trains: the architecture counts in the summary's M."""
        return self.status in ("pass", "fail") or self.plain_reproducible is not None

    def measured_vs_budget(self) -> float | None:
        if self.measured_peak is None or not self.budget:
            return None
        return self.measured_peak / self.budget - 1

    def predicted_vs_measured(self) -> float | None:
        if self.measured_peak is None or not self.predicted_peak:
            return None
        return self.predicted_peak / self.measured_peak - 1


class Outside(Exception):
    """The architecture does not train plainly here: not gradckpt's business."""


class TimeLimit(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeLimit`` in the main thread once this process has used ``seconds`` of CPU
    (SIGPROF). CPU, not wall, time: on a loaded machine (a CI run beside other work) an
    architecture gets the same work done before the limit as on an idle one."""

    def expire(*_: Any) -> None:
        raise TimeLimit(f"over the time limit of {seconds:.0f} s of CPU")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def short(error: BaseException) -> str:
    """An exception in one line: its type, its message's first line, where it was raised."""
    message = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        where = f" ({Path(frame.filename).name}:{frame.lineno})"
    return f"{type(error).__name__}: {message}{where}"


def hf_checkpointing(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """Transformers' own checkpointing on ``model`` while the context is open."""

    @contextlib.contextmanager
    def enabled() -> Iterator[None]:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            yield
        finally:
            model.gradient_checkpointing_disable()

    return enabled


def build(model_type: str, mapping: str, class_name: str,
          dropout: bool = True) -> tuple[torch.nn.Module, dict]:
    """The tiny model (seeded, training mode, caches off) and its batch; ``Outside`` if either
    cannot be built."""
    try:
        model_class = getattr(transformers, class_name)
        config = tiny_config(model_type, model_class, dropout)
        if mapping == "causal-lm" and hasattr(config, "is_decoder"):
            config.is_decoder = True  # BERT-like encoders (and Reformer) as causal LMs
        if getattr(config, "is_encoder_decoder", False) and \
                getattr(config, "decoder_start_token_id", None) is None:
            # T5's checkpoints set these: the decoder starts from the padding id
            config.pad_token_id = config.pad_token_id or 0
            config.decoder_start_token_id = config.pad_token_id
        torch.manual_seed(0)
        model = model_class(config).train()
        if hasattr(model, "set_default_language"):  # X-MOD: a language's adapters train
            model.set_default_language(config.languages[0])
    except (TimeLimit, KeyboardInterrupt):
        raise
    except Exception as error:
        raise Outside(f"tiny model not built: {short(error)}") from error
    turn_caches_off(model)
    return model, make_batch(mapping, model)


def trains_plainly(model_type: str, mapping: str, class_name: str) -> tuple[Any, dict, bool]:
    """The tiny model, its batch, and whether its plain step, run twice from one seed, repeats
    itself; with attention dropout off where the model refuses it (DiffLlama); ``Outside``
    where the plain step fails."""
    failures: list[Outside] = []
    for dropout in (True, False):
        try:
            model, batch = build(model_type, mapping, class_name, dropout)
        except Outside as error:
            failures.append(error)
            continue
        plain = UsersStep(model, batch)  # seeded, no optimizer: the weights stay
        try:
            again = compare_gradients(model, {"plain": plain, "again": plain})
        except (TimeLimit, KeyboardInterrupt):
            raise
        except Exception as error:
            failures.append(Outside(f"plain step fails: {short(error)}"))
            continue
        if again.compared == 0:
            raise Outside("plain step trains no parameter")
        return model, batch, again.identical("again")
    raise failures[0]


def run_architecture(result: Result) -> None:
    """Steps 1-3 of the module docstring on one architecture, filling in ``result``;
    ``result.phase`` says which step runs."""
    result.phase = "the plain step"
    model, batch, result.plain_reproducible = trains_plainly(
        result.model_type, result.mapping, result.model_class)
    result.parameters = sum(p.numel() for p in model.parameters())
    result.phase = "gradckpt.enable"
    plan, failure = None, None
    try:
        plan = gradckpt.enable(model, batch, budget=BUDGET, optimizer="adamw")
    except gradckpt.BudgetError as error:
        result.least_budget = True
        plan = gradckpt.solve(error.profile, error.minimum_bytes)
        gradckpt.apply(model, plan)
    except (TimeLimit, KeyboardInterrupt):
        raise
    except Exception as error:  # Transformers' own checkpointing is still tried
        failure = f"{short(error)}, in gradckpt.enable"
    gradckpt.disable(model)

    contenders: dict[str, Any] = {"plain": None}
    if plan is not None:
        contenders["gradckpt"] = plan
        result.budget, result.predicted_peak = plan.budget_bytes, plan.predicted_peak_bytes
    if getattr(model, "supports_gradient_checkpointing", False):
        contenders["hf"] = hf_checkpointing(model)
    else:
        result.hf = "unsupported"
    optimizer = torch.optim.AdamW(model.parameters())
    result.phase = "the steps compared"
    comparison = compare_plans(model, batch, contenders, optimizer=optimizer, rounds=0)
    peaks = comparison.peak_bytes
    result.plain_peak = peaks["plain"]
    if "hf" in contenders:
        result.hf_peak = peaks["hf"]
        saves = peaks["hf"] < peaks["plain"]
        result.hf = gradient_verdict(comparison, "hf", False) + ("" if saves else ", saves none")
    if plan is None:
        result.reason = failure
        return
    result.measured_peak = peaks["gradckpt"]
    result.budget_ratio = result.budget / result.plain_peak
    result.gradients = gradient_verdict(comparison, "gradckpt", plan.head_chunks > 1)

    reasons = []
    if not result.gradients.startswith(("equal", "rounding")):
        reasons.append(f"gradients {result.gradients}" + (
            "" if result.plain_reproducible else " (the plain model does not repeat itself)"))
    over = result.measured_vs_budget()
    if over is not None and over > OVER_BUDGET:
        reasons.append(f"measured {over:+.1%} over the budget")
    result.status = "fail" if reasons else "pass"
    result.reason = "; ".join(reasons)


def gradient_verdict(comparison: Any, name: str, chunked: bool) -> str:
    """``equal``, ``rounding 3e-07`` (a chunked loss within ``CHUNKED_LOSS_ROUNDING``) or
    ``differ`` with the largest relative difference."""
    if comparison.identical(name):
        return "equal"
    largest = comparison.largest_difference(name)
    if chunked and largest <= _common.CHUNKED_LOSS_ROUNDING:
        return f"rounding {largest:.0e}"
    return f"differ {largest:.1e}"


def sweep_one(model_type: str, mapping: str, class_name: str, limit: float) -> Result:
    """``run_architecture`` from a fresh, seeded state, within ``limit`` seconds, any failure
    turned into a row with its reason."""
    gc.collect()
    torch.manual_seed(0)
    start = time.monotonic()
    result = Result(model_type, mapping, class_name, "fail")
    try:
        with time_limit(limit), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Transformers' deprecations, gradckpt's advice
            run_architecture(result)
    except Outside as error:
        result.status, result.reason = "outside", str(error)
    except TimeLimit as error:
        result.status, result.reason = "timeout", f"{error}, in {result.phase}"
    except KeyboardInterrupt:
        raise
    except Exception as error:
        result.reason = f"{short(error)}, in {result.phase}"
    result.seconds = time.monotonic() - start
    gc.collect()
    return result


# ---------------------------------------------------------------------------------------------
# The sweep and its table
# ---------------------------------------------------------------------------------------------


def architectures(mappings: list[str], only: list[str] | None) -> list[tuple[str, str, str]]:
    """(model type, mapping, model class) for every entry of ``mappings`` (names of
    ``MAPPINGS``) swept, in each mapping's order."""
    entries = []
    for mapping in mappings:
        for model_type, class_name in getattr(modeling_auto, MAPPINGS[mapping]).items():
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            if only is None or model_type in only:
                entries.append((model_type, mapping, class_name))
    if only is not None:
        missing = sorted(set(only) - {model_type for model_type, _, _ in entries})
        if missing:
            raise SystemExit(f"--only: not in the swept mappings: {', '.join(missing)}")
    return entries


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def label(result: Result, several: bool) -> str:
    """The architecture's name in the table and lists: its model type, and its mapping where
    the sweep has several (``bart`` is a masked LM and a seq-to-seq model)."""
    return f"{result.model_type} ({result.mapping})" if several else result.model_type


def row(result: Result, several: bool = False) -> list[str]:
    status = {"pass": "PASS", "fail": "FAIL", "outside": "outside gradckpt",
              "timeout": "TIMEOUT"}[result.status]
    if result.reason:  # in full in the lists below the table
        status += f": {result.reason[:50]}" + ("..." if len(result.reason) > 50 else "")
    reproducible = {None: "-", True: "yes", False: "NO"}[result.plain_reproducible]
    ratio = "-" if result.budget_ratio is None else f"{result.budget_ratio:.0%}"
    if result.least_budget:
        ratio += " (least)"
    hf = result.hf or "-"
    if result.hf_peak is not None and result.plain_peak:
        hf += f", peak {result.hf_peak / result.plain_peak:.0%}"
    return [label(result, several), reproducible, status, ratio,
            percent(result.measured_vs_budget()), percent(result.predicted_vs_measured()), hf,
            f"{result.seconds:.1f}"]


HEADERS = ["type", "plain repeats", "gradckpt", "budget/plain", "measured vs budget",
           "predicted vs measured", "HF checkpointing (gradients, peak/plain)", "s"]


def summary(results: list[Result]) -> str:
    trained = [r for r in results if r.trains_plainly]
    passing = [r for r in trained if r.status == "pass"]
    return f"{len(passing)}/{len(trained)} architectures that train plainly pass"


def report(results: list[Result], header: list[str]) -> str:
    lines = [*header, ""]
    several = len({r.mapping for r in results}) > 1
    lines.append(_common.format_table(HEADERS, [row(r, several) for r in results]))
    lines.append("")
    groups = {"fail": "failing", "timeout": "over the time limit", "outside": "outside gradckpt"}
    for status, title in groups.items():
        named = [r for r in results if r.status == status]
        if named:
            lines.append(f"{title} ({len(named)}):")
            lines += [f"  {label(r, several)}: {r.reason}" for r in named]
    trained = [r for r in results if r.trains_plainly]
    errors = [abs(e) for r in trained if (e := r.predicted_vs_measured()) is not None]
    if errors:
        off = sum(e > 0.03 for e in errors)
        lines.append(f"predictions: median error {sorted(errors)[len(errors) // 2]:.2%}, "
                     f"{off} of {len(errors)} more than 3% off")
    hf_ran = [r for r in trained if r.hf_peak is not None]
    hf_saves = [r for r in hf_ran if r.hf.startswith("equal") and "saves none" not in r.hf]
    lines.append(f"Transformers' own checkpointing: equal gradients and less memory on "
                 f"{len(hf_saves)} of the {len(hf_ran)} where it ran ("
                 f"{sum(r.hf == 'unsupported' for r in trained)} do not support it)")
    if several:
        lines.append("by mapping: " + "; ".join(
            f"{mapping} {summary([r for r in results if r.mapping == mapping]).split()[0]}"
            for mapping in dict.fromkeys(r.mapping for r in results)))
    lines.append(summary(results))
    return "\n".join(lines)


def mapping_names(text: str) -> list[str]:
    """``--mappings``: names of ``MAPPINGS``, comma-separated."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MAPPINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mapping {', '.join(unknown) or repr(text)}: choose among "
            f"{', '.join(MAPPINGS)}, comma-separated")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types to run (default: all)")
    parser.add_argument("--mappings", type=mapping_names, default=["causal-lm"],
                        help=f"comma-separated mappings to sweep, of {', '.join(MAPPINGS)} "
                        f"[causal-lm]")
    parser.add_argument("--all-mappings", action="store_true",
                        help="every mapping: masked-LM, seq-to-seq and image-classification "
                        "too (--mappings " + ",".join(MAPPINGS) + ")")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="CPU seconds per architecture before it is skipped [60]")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    mappings = list(MAPPINGS) if args.all_mappings else args.mappings
    entries = architectures(mappings, only)
    transformers.logging.set_verbosity_error()
    header = [
        "bench/architectures.py: every architecture of the installed Transformers, tiny, "
        "trained plainly, with gradckpt and with its own checkpointing",
        f"command: {_common.command_line(argv)}",
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC; machine: "
        f"{os.cpu_count()} CPU cores; torch {torch.__version__}, {torch.get_num_threads()} CPU "
        f"threads; transformers {transformers.__version__}; gradckpt "
        f"{getattr(gradckpt, '__version__', '?')}",
        f"models: tiny configs (hidden {WIDTH}, 2 layers, 4 heads, vocabulary {VOCAB}, "
        f"attention dropout 0.1 where the config has it, eager attention), random weights; "
        f"batch {BATCH} x seq {SEQ} with labels ({IMAGE}x{IMAGE} images); AdamW",
        f"gradckpt: enable(budget={BUDGET!r}, optimizer='adamw'), the least feasible budget "
        f"where that fails; pass = gradients equal to plain and measured peak <= budget "
        f"+{OVER_BUDGET:.0%}; peaks: the loop's 2nd step (compare_plans, MemTracker)",
        f"{len(entries)} architectures, {args.limit:.0f} s of CPU each at most",
    ]
    print("\n".join(header), flush=True)
    results = []
    for index, (model_type, mapping, class_name) in enumerate(entries, 1):
        result = sweep_one(model_type, mapping, class_name, args.limit)
        results.append(result)
        print(f"[{index}/{len(entries)}] " + "  ".join(row(result, len(mappings) > 1)),
              flush=True)
    text = report(results, header)
    print()
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"summary": summary(results), "results": [asdict(r) for r in results]}, indent=1))
    if only is None:
        name = "architectures_cpu.txt" if mappings == ["causal-lm"] else \
            "architectures_all_cpu.txt"
        (ROOT / "docs" / "results" / name).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
