"""Hugging Face models under a gradckpt plan, used the way fine-tuning scripts use them (issue 14).

Models built from configs (``gradckpt.integrations.hf_families``), ``labels`` in the batch,
the output held through backward. Checked: ``gradckpt.enable`` at a budget fits and gives the plain
model's gradients; Transformers' flags say what is happening; ``eval()`` + ``generate()`` runs as
without gradckpt; Transformers' own switches have one behaviour; PEFT before or after
``enable``; and the one-time warnings for the classic silent failures.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from engine_models import CHUNKED_HEAD_TOLERANCE
from torch import nn

import gradckpt
from gradckpt.errors import forget_warnings
from gradckpt.integrations import hf_families
from gradckpt.side_by_side import measure_users_step

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

ALLOWANCE = 0.03  # measured over budget, and prediction against measured
FAMILIES = hf_families.families("gpt2,llama,qwen2,bert,t5,vit")


@pytest.fixture(autouse=True)
def _fresh_warnings():
    forget_warnings()
    yield
    forget_warnings()


def _checkpointing_flag(model: nn.Module) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the 4.x name is deprecated in 5.x
        old_name = model.is_gradient_checkpointing
    assert old_name == model.is_activation_checkpointing
    return model.is_activation_checkpointing


def _transformers_layers_on(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing]


def _hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def users_step(model: nn.Module, sample: dict) -> tuple[int, list]:
    """The peak of the loop's second step as users write it, and the gradients it left."""
    measured = measure_users_step(model, sample)
    return measured.peak_bytes, measured.gradients


def _identical(first: list, second: list, plan: gradckpt.Plan | None = None) -> bool:
    """Bit for bit; within float rounding where ``plan`` computes the loss in chunks."""
    if plan is not None and plan.head_chunks > 1:
        return all((a is None and b is None) or (a is not None and b is not None and
                                                torch.allclose(a, b, **CHUNKED_HEAD_TOLERANCE))
                   for a, b in zip(first, second, strict=True))
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(first, second, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES, ids=lambda case: case.name)
def test_enable_fits_the_budget_with_the_plain_gradients_and_truthful_flags(case) -> None:
    sample = case.sample()
    plain_peak, plain_grads = users_step(case.fresh(), sample)
    model = case.fresh()
    assert not _checkpointing_flag(model)
    plan = gradckpt.enable(model, sample, budget="60%")
    assert plan.segments, "a 60% budget must recompute something"
    assert _checkpointing_flag(model)
    assert not _transformers_layers_on(model)  # recomputation is gradckpt's alone
    peak, grads = users_step(model, sample)
    assert peak <= plan.budget_bytes * (1 + ALLOWANCE), (peak, plan.budget_bytes)
    assert peak < plain_peak
    assert _identical(grads, plain_grads, plan)
    if case.name == "t5":  # both stacks are in the chain (which ones 60% recomputes depends
        names = set(plan.block_names)  # on the profile's timings: not asserted)
        assert any(n.startswith("encoder.") for n in names)
        assert any(n.startswith("decoder.") for n in names)
    gradckpt.disable(model)
    assert not _checkpointing_flag(model)


def test_a_plan_that_recomputes_nothing_leaves_the_flags_false() -> None:
    model = FAMILIES[1].fresh()
    plan = gradckpt.enable(model, hf_families.causal_batch(), budget="100%")
    assert not plan.segments
    assert not _checkpointing_flag(model)
    gradckpt.disable(model)


@pytest.mark.parametrize("build", [hf_families.family(name).build
                                   for name in ("gpt2", "llama", "t5")],
                         ids=["gpt2", "llama", "t5"])
def test_generate_in_eval_runs_as_without_gradckpt_and_train_brings_the_plan_back(build):
    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    model = build()
    seq2seq = model.config.is_encoder_decoder
    sample = hf_families.seq2seq_batch() if seq2seq else hf_families.causal_batch()
    plan = gradckpt.enable(model.train(), sample, budget="50%")
    assert plan.segments
    prompt = sample["input_ids"][:, :12]
    for each in (plain, model):
        each.eval()
    assert model.config.use_cache is True  # as the config says, outside training
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    ours, theirs = model.generate(prompt, **kwargs), plain.generate(prompt, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert ours.past_key_values is not None  # the cache was used
    model.train()
    plain.train()
    assert _checkpointing_flag(model)
    plain_peak, plain_grads = users_step(plain, sample)
    peak, grads = users_step(model, sample)
    assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
    assert _identical(grads, plain_grads, plan)
    gradckpt.disable(model)


def test_a_later_transformers_enable_keeps_the_plan_and_warns_once() -> None:
    sample = hf_families.causal_batch()
    _, plain_grads = users_step(FAMILIES[1].fresh(), sample)
    model = FAMILIES[1].fresh()
    plan = gradckpt.enable(model, sample, budget="55%")
    with pytest.warns(gradckpt.GradckptWarning, match="was not carried out") as caught:
        model.gradient_checkpointing_enable()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={})
    assert len(caught) == 1
    assert not _transformers_layers_on(model)  # never both mechanisms on one layer
    peak, grads = users_step(model, sample)
    assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
    assert _identical(grads, plain_grads, plan)
    gradckpt.disable(model)


def test_a_transformers_disable_removes_the_plan() -> None:
    model = FAMILIES[1].fresh()
    hooks = _hook_counts(model)
    gradckpt.enable(model, hf_families.causal_batch(), budget="55%")
    assert _hook_counts(model) != hooks
    model.activation_checkpointing_disable()
    assert _hook_counts(model) == hooks
    assert not _checkpointing_flag(model)
    assert "activation_checkpointing_enable" not in model.__dict__  # the shadows are gone


def test_enable_on_a_model_with_transformers_checkpointing_on_replaces_it_until_disable():
    sample = hf_families.causal_batch()
    _, plain_grads = users_step(FAMILIES[1].fresh(), sample)
    model = FAMILIES[1].fresh()
    model.activation_checkpointing_enable()
    layers = _transformers_layers_on(model)
    assert len(layers) == 4
    with pytest.warns(gradckpt.GradckptWarning, match="turns it off"):
        plan = gradckpt.enable(model, sample, budget="55%")
    assert not _transformers_layers_on(model)
    assert _checkpointing_flag(model)
    peak, grads = users_step(model, sample)
    assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
    assert _identical(grads, plain_grads, plan)
    gradckpt.disable(model)
    assert _transformers_layers_on(model) == layers  # Transformers' own, as before


# --- PEFT ----------------------------------------------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0,
                             init_lora_weights=False)  # random B: adapters change the output
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def _lora_grads(model: nn.Module) -> list:
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("order", ["peft-then-enable", "enable-then-peft"])
def test_peft_before_or_after_enable_gives_the_plain_peft_gradients(order) -> None:
    sample = hf_families.causal_batch()
    plain = _lora(FAMILIES[1].fresh())
    plain_peak, _ = users_step(plain, sample)
    plain_grads = _lora_grads(plain)
    assert all(g is not None and g.abs().sum() > 0 for g in plain_grads)
    if order == "peft-then-enable":
        model = _lora(FAMILIES[1].fresh())
        plan = gradckpt.enable(model, sample, budget="55%")
    else:
        base = FAMILIES[1].fresh()
        plan = gradckpt.enable(base, sample, budget="55%")
        model = _lora(base)
    assert plan.segments
    # No enable_input_require_grads(): the engine does not need its inputs to require grad.
    peak, _ = users_step(model, sample)
    assert _identical(_lora_grads(model), plain_grads, plan)
    assert peak < plain_peak
    if order == "peft-then-enable":
        assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
    gradckpt.disable(model)  # a wrapper of the planned model: removes the plan too
    assert not _checkpointing_flag(model.base_model.model)


def test_merge_and_unload_gives_a_plain_model() -> None:
    sample = hf_families.causal_batch()
    model = _lora(FAMILIES[1].fresh())
    gradckpt.enable(model, sample, budget="55%")
    users_step(model, sample)
    merged = model.merge_and_unload()
    gradckpt.disable(merged)  # the plan was applied to the PEFT model around it
    fresh = FAMILIES[1].fresh()
    assert list(merged.state_dict()) == list(fresh.state_dict())
    assert _hook_counts(merged) == _hook_counts(fresh)
    assert not _checkpointing_flag(merged)
    assert not any("lora" in name for name, _ in merged.named_modules())


def test_a_bf16_frozen_base_with_fp32_adapters() -> None:
    sample = hf_families.causal_batch()

    def build() -> nn.Module:
        base = FAMILIES[1].fresh().to(torch.bfloat16)
        model = _lora(base)  # PEFT keeps the adapters in fp32 (autocast_adapter_dtype)
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
        return model

    plain = build()
    users_step(plain, sample)
    model = build()
    plan = gradckpt.enable(model, sample, budget="60%")
    assert plan.segments
    peak, _ = users_step(model, sample)
    assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
    if plan.head_chunks == 1:
        assert _identical(_lora_grads(model), _lora_grads(plain))
    else:  # bf16 logits rounded per chunk: measured 3e-4 to 6.2e-3 of each gradient's
        # largest value, within two bf16 ulps (2 x 2**-7)
        for got, expected in zip(_lora_grads(model), _lora_grads(plain), strict=True):
            assert (got - expected).abs().max() <= 2 * 2**-7 * expected.abs().max()
    gradckpt.disable(model)


def test_a_peft_model_whose_base_has_no_chain_is_refused_and_left_as_it_was() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    model = peft.get_peft_model(Head(), peft.LoraConfig(r=2, target_modules=["proj"]))
    hooks = _hook_counts(model)
    with pytest.raises(gradckpt.UsageError, match="blocks="):
        gradckpt.enable(model, torch.randn(4, 8), budget="50%")
    assert _hook_counts(model) == hooks


# --- diagnostics ---------------------------------------------------------------------------


class _SelfCheckpointing(nn.Module):
    """A block that runs torch.utils.checkpoint on its own MLP, as some model code does."""

    def __init__(self, width: int = 32, *, reentrant: bool = False, preserve: bool = True):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.5),
                                 nn.Linear(4 * width, width))
        self.reentrant, self.preserve = reentrant, preserve

    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(
            self.mlp, x, use_reentrant=self.reentrant, preserve_rng_state=self.preserve)


def _stack(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(_SelfCheckpointing(**kwargs) for _ in range(3))).train()


def _profile_warnings(model: nn.Module, sample: torch.Tensor, fails: bool = False) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fails:
            with pytest.raises(gradckpt.UsageError, match="does not require grad"):
                gradckpt.profile(model, sample, repeats=1)
        else:
            gradckpt.profile(model, sample, repeats=1)
    return [str(w.message) for w in caught if issubclass(w.category, gradckpt.GradckptWarning)]


def test_torch_checkpoint_inside_a_block_warns_of_double_checkpointing() -> None:
    messages = _profile_warnings(_stack(), torch.randn(4, 32, requires_grad=True))
    assert len(messages) == 1
    assert "'0', '1', '2' calls torch.utils.checkpoint itself" in messages[0]


def test_reentrant_checkpointing_of_frozen_inputs_warns_that_no_gradient_flows() -> None:
    # A frozen input: every block's parameters get no gradient, and the loss has none at all.
    # The step fails, and the warning says why.
    model = _stack(reentrant=True)
    messages = _profile_warnings(model, torch.randn(4, 32), fails=True)
    assert any("no input that requires grad" in m for m in messages), messages


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_rng_not_preserved_around_dropout_warns(reentrant) -> None:
    model = _stack(reentrant=reentrant, preserve=False)
    messages = _profile_warnings(model, torch.randn(4, 32, requires_grad=True))
    assert any("preserve_rng_state=False" in m for m in messages), messages


def test_gradckpt_checkpoint_without_rng_replay_around_dropout_warns_once() -> None:
    dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(gradckpt.GradckptWarning, match="draws random numbers") as caught:
        for _ in range(2):
            gradckpt.checkpoint(dropout, x, preserve_rng_state=False).sum().backward()
    assert len(caught) == 1
    forget_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replayed, or no randomness: nothing to say
        gradckpt.checkpoint(dropout, x).sum().backward()
        gradckpt.checkpoint(dropout.eval(), x, preserve_rng_state=False).sum().backward()


def test_qlora_a_4bit_bitsandbytes_base_with_lora_adapters(tmp_path, request) -> None:
    """QLoRA as recipes set it up (``prepare_model_for_kbit_training``, then LoRA), on
    bitsandbytes' CPU backend: fits the budget, predicted, the plain QLoRA gradients."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    hf_families.hf_model("llama").save_pretrained(tmp_path)
    # Loading a quantized model fills torch's cached list of factory functions while
    # torch.linspace and others are patched, so that later `with torch.device("meta")` blocks
    # make those on the CPU (torch 2.13, transformers 5.25); start that cache afresh after.
    request.addfinalizer(torch.utils._device._device_constructors.cache_clear)

    def build() -> nn.Module:
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, device_map="cpu",
            quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.float32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prepared = peft.prepare_model_for_kbit_training(
                quantized, use_gradient_checkpointing=False)
        return _lora(prepared).train()

    sample = hf_families.causal_batch()
    plain = build()
    assert type(plain.base_model.model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    plain_peak, _ = users_step(plain, sample)
    model = build()
    plan = gradckpt.enable(model, sample, budget="60%")
    assert plan.segments
    peak, _ = users_step(model, sample)
    assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
    assert abs(plan.predicted_peak_bytes - peak) <= ALLOWANCE * peak
    assert peak < plain_peak
    assert _identical(_lora_grads(model), _lora_grads(plain), plan)
    gradckpt.disable(model)


def test_mixed_precision_as_accelerate_applies_it_is_planned_as_it_runs() -> None:
    """Accelerate (and the Trainer's ``bf16=True``) wraps the model's forward in
    ``torch.autocast``: the blocks' matmuls save bf16 tensors. Profiling re-runs each block
    under the autocast of its call in the step, so plans are predicted as they run (before,
    a 50% plan of this model was predicted 7.3% under its measured peak)."""

    def build() -> nn.Module:
        model = FAMILIES[1].fresh()
        model.forward = types.MethodType(
            torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward), model)
        return model

    sample = hf_families.causal_batch()
    _, plain_grads = users_step(build(), sample)
    model = build()
    measured = gradckpt.profile(model, sample, repeats=1)
    for share in (0.7, 0.5):
        plan = gradckpt.solve(measured, int(share * measured.peak_bytes))
        gradckpt.apply(model, plan)
        peak, grads = users_step(model, sample)
        gradckpt.disable(model)
        assert plan.segments
        assert peak <= plan.budget_bytes * (1 + ALLOWANCE)
        assert abs(plan.predicted_peak_bytes - peak) <= ALLOWANCE * peak, (share, plan, peak)
        assert _identical(grads, plain_grads, plan)
