"""Hugging Face causal language models: the loss in chunks of tokens when the plan says so.

A causal language model's forward projects every position onto the vocabulary (``lm_head``),
soft-caps the logits where the family does (Gemma 2's ``final_logit_softcapping``) and, given
``labels``, takes Transformers' ``ForCausalLMLoss`` of them. ``chunked_causal_lm_loss`` (a
registered ecosystem hook, so on whenever gradckpt measures a model or a plan is applied)
wraps the forward of each such model inside ``model``:

- in a training step (the model in ``train()``, gradients on) with ``labels``, it asks the
  engine how many chunks the plan chose for the model's output head
  (``planned_head_chunks``, which also tells ``profile`` that this head can be chunked);
- with more than one, it runs the model's own forward with the head answering an empty
  ``(batch, seq, 0)`` tensor (whatever the forward does to the logits costs nothing then),
  takes the hidden states the head was given and computes the loss with
  ``gradckpt.linear_cross_entropy``: the label shift (or the ``shift_labels`` given),
  ``ignore_index``, the mean over counted tokens or the Trainer's ``num_items_in_batch``,
  the soft-capping, and the head module itself (tied embeddings, a bias, LoRA on it);
- otherwise, and always in evaluation, ``generate()`` and steps without labels, it is the
  model's own forward, untouched.

In a chunked step ``out.loss`` is the loss and ``out.logits`` an empty tensor of shape
``(batch, seq, 0)``: the whole logits never exist. A loop that reads them plans with
``output_head="plain"``. A model that changes its logits in a way this does not repeat (a
scale, say) is caught before any plan uses it: ``profile`` compares the chunked loss with the
model's own on the sample and offers no chunked head when they differ. ``estimate`` cannot
compare values; with a plan applied, a chunked step whose forward did more to the (empty)
logits its head returned than views and casts raises, before any gradient, where the family
has no entry below that explains it (``_logits_changed``).

A family whose loss or logits differ from that has its entry in ``_LOSSES``, one table read
alike by ``profile`` and by ``estimate`` (whose fake tensors have no values to compare):

- the targets its own loss takes, for the head's input it captured. BART's decoder and the
  other encoder-decoder families' decoders as causal LMs (Marian, mBART, Pegasus, Whisper,
  TrOCR...), CPM-Ant, XLNet and XLM score the logits against the labels as they are, unshifted
  (``CrossEntropyLoss()(logits.view(-1, vocab), labels.view(-1))``: -100 ignored, the mean,
  ``num_items_in_batch`` not used). ProphetNet predicts ``config.ngram`` streams of tokens: its
  head reads ``(batch, ngram, seq, hidden)`` and each stream is scored against the labels as
  given, unshifted (``ProphetNetForCausalLM._compute_loss``);
- when the chunked loss computes it at all: a family that scales its logits (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``), cuts them
  (Inkling's ``unpadded_vocab_size``) or smooths its labels (ProphetNet's ``eps``) by a config
  value other than the neutral one is not wrapped and keeps its own loss: no chunked head is
  offered, by ``profile`` or ``estimate``; nor is GIT, which scores the text's logits alone,
  after the image's tokens its head also reads;
- the config field of its soft-capping where it is not ``final_logit_softcapping``
  (RecurrentGemma's ``logits_soft_cap``, xLSTM's ``output_logit_soft_cap``).
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..ecosystem_hooks import Occasion, register_ecosystem_hook
from ..engine import linear_cross_entropy, planned_head_chunks, vocabulary_size

__all__ = ["chunked_causal_lm_loss", "output_head"]


def output_head(model: nn.Module) -> nn.Module | None:
    """The output head of a Transformers causal language model (``get_output_embeddings()``),
    None for any other model.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
        >>> output_head(transformers.GPT2LMHeadModel(config))
        Linear(in_features=16, out_features=64, bias=False)
    """
    if not _is_causal_lm(model):
        return None
    head = model.get_output_embeddings()
    return head if isinstance(head, nn.Module) else None


def chunked_causal_lm_loss(model: nn.Module, occasion: Occasion) -> Callable[[], None] | None:
    """Wrap the forward of every causal language model in ``model`` as the module says;
    return what unwraps them (None: there are none)."""
    wrapped = []
    for module in model.modules():
        if output_head(module) is None or "forward" in vars(module):
            continue  # not a causal language model, or wrapped already (by another hold)
        if not _loss(module).computable(module):
            continue  # a loss linear_cross_entropy does not compute: the model's own
        # With a plan applied, a step whose logits the forward changed raises (see
        # _logits_changed); while measuring, profile compares the losses instead.
        module.forward = _chunking_forward(
            module, check_logits=occasion.plan_applied and not occasion.fake_tensors)
        wrapped.append(module)
    if not wrapped:
        return None

    def restore() -> None:
        for module in wrapped:
            vars(module).pop("forward", None)

    return restore


def _is_causal_lm(module: nn.Module) -> bool:
    """A Transformers causal language model: its class, or one it derives from (a user's
    subclass), is one of Transformers' causal language models."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in names and cls.__module__.startswith("transformers.")
               for cls in type(module).__mro__)


def _chunking_forward(module: nn.Module, check_logits: bool = False) -> Callable[..., Any]:
    # The module holds this function: holding the module back only weakly keeps the two out
    # of a reference cycle, so the model is freed when its last user lets go, not at some later
    # garbage collection (under DDP, in the middle of whatever runs then).
    owner = weakref.ref(module)
    # The class's function, called with the module: a bound method made here would hold the
    # module, and one made per call is rebuilt by Dynamo as ``module.forward`` -- this wrapper
    # again, recursing without end under torch.compile.
    forward_of_class = type(module).forward
    signature = inspect.signature(forward_of_class.__get__(module))

    @functools.wraps(forward_of_class)
    def forward(*args: Any, **kwargs: Any) -> Any:
        module = owner()
        assert module is not None  # called through the module, which holds this function
        labels = _argument(signature, args, kwargs, "labels")
        if labels is None or not module.training or not torch.is_grad_enabled():
            return forward_of_class(module, *args, **kwargs)
        # Asked at each call: PEFT may have wrapped the planned head since (LoRA on lm_head);
        # the wrapper then computes each chunk's logits.
        head = module.get_output_embeddings()
        chunks = planned_head_chunks(head)
        base = getattr(head, "base_layer", None)
        if chunks == 1 and isinstance(base, nn.Module):
            chunks = planned_head_chunks(base)
        if chunks == 1:
            return forward_of_class(module, *args, **kwargs)
        original = functools.partial(forward_of_class, module)
        return _chunked_step(module, head, original, signature, args, kwargs, chunks,
                             check_logits)

    return forward


def _chunked_step(
    module: nn.Module, head: nn.Module, original: Callable[..., Any],
    signature: inspect.Signature, args: tuple, kwargs: dict, chunks: int,
    check_logits: bool = False,
) -> Any:
    bound = signature.bind(*args, **kwargs)
    labels = bound.arguments["labels"]
    bound.arguments["labels"] = None  # the model computes no loss: this does
    extra = bound.arguments.get("kwargs") or {}
    captured: list[torch.Tensor] = []
    returned: list[torch.Tensor] = []

    def capture(hidden: torch.Tensor, *rest: Any, **options: Any) -> torch.Tensor:
        captured.append(hidden)
        logits = hidden.new_empty((*hidden.shape[:-1], 0))
        if check_logits:  # what the forward does to them is recorded by autograd (no bytes)
            logits.requires_grad_(hidden.requires_grad)
        returned.append(logits)
        return logits

    head.forward = capture  # the head's hooks still run around it
    try:
        output = original(*bound.args, **bound.kwargs)
    finally:
        vars(head).pop("forward", None)
    if len(captured) != 1:
        raise RuntimeError(
            f"{type(module).__name__}'s forward called its output head {len(captured)} times; "
            "gradckpt cannot compute its loss in chunks: plan with output_head='plain'"
        )
    family = _loss(module)
    if check_logits and family is _FOR_CAUSAL_LM_LOSS and _softcap(module) is None:
        changed = _logits_changed(output, returned[0])
        if changed is not None:
            raise RuntimeError(
                f"{type(module).__name__}'s forward changes the logits its output head returns "
                f"({changed}) before its loss: the loss gradckpt computes in chunks would not "
                "be the model's own. Plan with output_head='plain' (enable(..., "
                "output_head='plain'), GradckptCallback(..., output_head='plain')), or with "
                "gradckpt.profile, which compares the two losses on a real sample")
    shift_labels = extra.get("shift_labels")
    if family.targets is not None:  # the family's own loss: its targets, nothing shifted
        loss = linear_cross_entropy(
            captured[0], head, family.targets(module, captured[0], labels), chunks=chunks)
    else:
        loss = linear_cross_entropy(
            captured[0], head, shift_labels if shift_labels is not None else labels,
            chunks=chunks, ignore_index=extra.get("ignore_index", -100),
            shift=shift_labels is None, softcap=_softcap(module, family.softcap),
            num_items=extra.get("num_items_in_batch"),
        )
    if isinstance(output, tuple):
        return (loss, *output)
    fields = {name: value for name, value in output.items() if name != "loss"}
    return type(output)(loss=loss, **fields)


# What a forward may do to the logits its head returned and still have Transformers'
# ForCausalLMLoss score them as the chunked loss does: views, copies and casts.
_VIEWS_AND_CASTS = frozenset({
    "AliasBackward", "AsStridedBackward", "CloneBackward", "ExpandBackward", "PermuteBackward",
    "ReshapeAliasBackward", "SelectBackward", "SliceBackward", "SqueezeBackward",
    "ToCopyBackward", "TransposeBackward", "UnsafeViewBackward", "UnsqueezeBackward",
    "ViewBackward",
})


def _logits_changed(output: Any, returned: torch.Tensor) -> str | None:
    """What the forward did to the (empty) logits its head ``returned`` before putting them in
    ``output``, beyond views and casts (the autograd node, e.g. ``MulBackward0``: a scale);
    None where nothing else.

    Example:
        >>> import torch
        >>> logits = torch.empty(2, 3, 0, requires_grad=True)
        >>> _logits_changed({"logits": logits.float().view(2, 3, 0)}, logits) is None
        True
        >>> _logits_changed({"logits": logits * 0.5}, logits)
        'MulBackward0'
    """
    logits = output[0] if isinstance(output, tuple) else output.get("logits")
    if not isinstance(logits, torch.Tensor) or logits is returned or logits._base is returned:
        return None
    node = logits.grad_fn
    while node is not None:
        name = type(node).__name__
        if name == "AccumulateGrad":
            return None if node.variable is returned else "another tensor"
        if name.rstrip("0123456789") not in _VIEWS_AND_CASTS:
            return name
        inputs = [following for following, _ in node.next_functions if following is not None]
        if len(inputs) != 1:
            return name
        node = inputs[0]
    return "another tensor"


def _argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    names = list(signature.parameters)
    if name in names and names.index(name) < len(args):
        return args[names.index(name)]
    return None


def _ngram_targets(module: nn.Module, hidden: torch.Tensor, labels: torch.Tensor
                   ) -> torch.Tensor:
    """ProphetNet's targets (``ProphetNetForCausalLM._compute_loss``): its head reads
    ``(batch, ngram, seq, hidden)``, and every stream is scored against the labels as given,
    unshifted, -100 ignored (with ``disable_ngram_loss``, the first stream alone); the mean
    over the tokens counted, whatever ``num_items_in_batch`` the Trainer passes.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> model = SimpleNamespace(disable_ngram_loss=True)
        >>> _ngram_targets(model, torch.zeros(1, 2, 3, 8), torch.tensor([[5, 6, -100]]))
        tensor([[[   5,    6, -100],
                 [-100, -100, -100]]])
    """
    targets = labels.unsqueeze(1).expand(hidden.shape[:-1]).clone()
    if module.disable_ngram_loss:
        targets[:, 1:] = -100
    return targets


def _labels_as_given(module: nn.Module, hidden: torch.Tensor, labels: torch.Tensor
                     ) -> torch.Tensor:
    """The targets of a loss that scores the logits against the labels as they are, unshifted:
    ``CrossEntropyLoss()(logits.view(-1, vocab), labels.view(-1))`` (BART's ``ForCausalLM``)."""
    return labels


def _config_is(field: str, neutral: float | None) -> Callable[[nn.Module], bool]:
    """Computable where the model's config leaves ``field`` at ``neutral`` (or unset)."""
    return lambda module: getattr(module.config, field, None) in (None, neutral)


def _keeps_its_vocabulary(module: nn.Module) -> bool:
    """Inkling cuts its logits to ``unpadded_vocab_size`` where that is below the head's size."""
    kept = getattr(module.config, "unpadded_vocab_size", None)
    return kept is None or kept >= vocabulary_size(module.get_output_embeddings())


def _always(module: nn.Module) -> bool:
    return True


class _Loss(NamedTuple):
    """How a causal language model's loss is computed from its head's input: ``targets``, the
    targets ``linear_cross_entropy`` scores (None: Transformers' ``ForCausalLMLoss``, the
    labels shifted, ``ignore_index``, ``num_items_in_batch``); whether it can be for a given
    model (``computable``; one that scales its logits, say, it cannot); the config field of the
    final logit soft-capping."""

    targets: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    computable: Callable[[nn.Module], bool] = _always
    softcap: str = "final_logit_softcapping"


_FOR_CAUSAL_LM_LOSS = _Loss()
_UNSHIFTED = _Loss(_labels_as_given)

# By the Transformers class that defines the loss; read alike by profile and estimate. Found by
# reading each causal LM's forward in Transformers 5.25 and checked on a tiny model of each:
# the chunked loss equals the model's own (tests/integrations/test_integrations_hf_head_losses.py).
_LOSSES = {
    **dict.fromkeys([
        "BartForCausalLM", "BigBirdPegasusForCausalLM", "BlenderbotForCausalLM",
        "BlenderbotSmallForCausalLM", "CpmAntForCausalLM", "MarianForCausalLM",
        "MBartForCausalLM", "MvpForCausalLM", "PegasusForCausalLM", "PLBartForCausalLM",
        "TrOCRForCausalLM", "WhisperForCausalLM", "XLNetLMHeadModel"], _UNSHIFTED),
    # With an adaptive softmax (config.asm) XLM's head is no linear layer.
    "XLMWithLMHeadModel": _Loss(_labels_as_given, lambda module: not module.config.asm),
    "ProphetNetForCausalLM": _Loss(_ngram_targets, _config_is("eps", 0.0)),
    **dict.fromkeys(["CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM",
                     "CohereCompassForCausalLM"], _Loss(computable=_config_is("logit_scale", 1))),
    **dict.fromkeys(["GraniteForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeForCausalLM",
                     "GraniteMoeSWAForCausalLM", "GraniteMoeHybridForCausalLM",
                     "GraniteMoeSharedForCausalLM", "HyperCLOVAXForCausalLM"],
                    _Loss(computable=_config_is("logits_scaling", 1))),
    "FalconH1ForCausalLM": _Loss(computable=_config_is("lm_head_multiplier", 1)),
    "InklingForCausalLM": _Loss(computable=_keeps_its_vocabulary),
    # Scores only the text's logits, after the image's tokens the head also reads.
    "GitForCausalLM": _Loss(computable=lambda module: False),
    "RecurrentGemmaForCausalLM": _Loss(softcap="logits_soft_cap"),
    "xLSTMForCausalLM": _Loss(softcap="output_logit_soft_cap"),
}


def _loss(module: nn.Module) -> _Loss:
    """The family's loss (``_LOSSES``); ``ForCausalLMLoss`` on the head's logits where it has
    no entry."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in _LOSSES:
            return _LOSSES[cls.__name__]
    return _FOR_CAUSAL_LM_LOSS


def _softcap(module: nn.Module, field: str = "final_logit_softcapping") -> float | None:
    config = getattr(module, "config", None)
    cap = getattr(config, field, None)
    text = getattr(config, "get_text_config", None)
    if cap is None and callable(text):
        cap = getattr(text(), field, None)
    return cap


register_ecosystem_hook(chunked_causal_lm_loss)
