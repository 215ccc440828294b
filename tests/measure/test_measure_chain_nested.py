"""Models whose layers sit in stages: the chain is every layer of every stage, in run order
(``measure/chain.py``, rule 2), and a segment never spans what a stage runs between its
layers and the next stage's (patch merging, patch embeddings, a norm).

PoolFormer keeps its layers in a list of lists (``encoder.block[i][j]``) beside a list of
per-stage patch embeddings; Swin and SegFormer keep them in a list of stage modules, each
holding a list of layers (``layers[i].blocks``, ``stages[i].blocks``) beside its patch
merging or patch embeddings and norm. Each is built from a tiny config (2 stages of 2 layers,
random weights, nothing downloaded), planned with ``enable`` and AdamW, and trained three
steps as a loop does beside an identical model without a plan: parameters after and the
gradients of one more step bit for bit equal, the measured peak of steps 2-3 within the
budget + 3%. Swin runs under PEFT LoRA too.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import adamw, assert_trains_as_plain, trained_as_a_loop, with_lora
from torch import nn

import gradckpt
from gradckpt.measure import find_blocks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

STEPS = 3
OVER_BUDGET = 1.03
IMAGE = 32
LABELS = 3


def seeded(model_class: type, config: object, lora: bool = False) -> nn.Module:
    """The model, seeded, in training mode; with ``lora``, frozen under PEFT LoRA adapters on
    every linear layer (seeded too: the same A matrices in both runs)."""
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).train()
    if lora:
        torch.manual_seed(1)
        model = with_lora(model)
    return model


def poolformer() -> nn.Module:
    return seeded(transformers.PoolFormerForImageClassification, transformers.PoolFormerConfig(
        num_encoder_blocks=2, depths=[2, 2], hidden_sizes=[16, 32], patch_sizes=[7, 3],
        strides=[4, 2], padding=[2, 1], num_labels=LABELS))


def swin(lora: bool = False) -> nn.Module:
    return seeded(transformers.SwinForImageClassification, transformers.SwinConfig(
        image_size=IMAGE, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
        window_size=4, attention_probs_dropout_prob=0.1, num_labels=LABELS), lora)


def segformer() -> nn.Module:
    return seeded(transformers.SegformerForImageClassification, transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=LABELS))


# name: (builder, the chain: every layer of every stage, stage after stage)
MODELS = {
    "poolformer": (poolformer, [f"poolformer.encoder.block.{stage}.{layer}"
                                for stage in range(2) for layer in range(2)]),
    "swin": (swin, [f"swin.encoder.layers.{stage}.blocks.{layer}"
                    for stage in range(2) for layer in range(2)]),
    "swin_lora": (lambda: swin(lora=True),
                  [f"base_model.model.swin.encoder.layers.{stage}.blocks.{layer}"
                   for stage in range(2) for layer in range(2)]),
    "segformer": (segformer, [f"segformer.stages.{stage}.blocks.{layer}"
                              for stage in range(2) for layer in range(2)]),
}


def image_batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=generator),
            "labels": torch.randint(0, LABELS, (2,), generator=generator)}


def train(model: nn.Module, optimizer: torch.optim.Optimizer
          ) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    return trained_as_a_loop(model, optimizer, image_batch, STEPS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_chain_is_every_layer_of_every_stage(name: str) -> None:
    build, expected = MODELS[name]
    model = build()
    assert [block_name for block_name, _ in find_blocks(model)] == expected
    assert [block_name for block_name, _ in find_blocks(model, image_batch(0))] == expected


@pytest.mark.parametrize("name", sorted(MODELS))
def test_enable_plans_each_layer_and_trains_as_plain(name: str) -> None:
    build, expected = MODELS[name]
    model = build()
    plain = train(model, adamw(model))
    model = build()
    optimizer = adamw(model)
    profile = gradckpt.profile(model, image_batch(0), optimizer=optimizer, repeats=1)
    # What a stage runs after its layers (patch merging, patch embeddings, a norm) runs
    # between the last layer of one stage and the first of the next: a break in the chain.
    assert profile.chain_breaks == [2], profile.chain_breaks
    try:
        plan = gradckpt.enable(model, image_batch(0), budget="60%", optimizer=optimizer,
                               output_head="plain")
    except gradckpt.BudgetError as error:
        plan = gradckpt.solve(error.profile, error.minimum_bytes, output_head="plain")
        gradckpt.apply(model, plan)
    assert list(plan.block_names) == expected
    assert plan.segments, plan
    for segment in plan.segments:  # no segment spans the stages' boundary
        assert not segment.start < 2 <= segment.end, plan.segments
    planned = train(model, optimizer)
    gradckpt.disable(model)
    assert_trains_as_plain(plan, plain, planned, STEPS, OVER_BUDGET)


# --------------------------------------------------------------------------------------------
# The rule on toy models
# --------------------------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x))


class Stage(nn.Module):
    """Layers, then a downsampling to the next stage's width (small beside the layers)."""

    def __init__(self, width: int, out: int | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(width) for _ in range(3)])
        self.down = nn.Linear(width, out, bias=False) if out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.down(x) if self.down is not None else x


class Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([Stage(8, 16), Stage(16, None)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.head(x).mean()


class ListsOfLists(nn.Module):
    """Like PoolFormer: per-stage embeddings beside a list of lists of layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 16)])
        self.block = nn.ModuleList([nn.ModuleList([Layer(8), Layer(8)]),
                                    nn.ModuleList([Layer(16), Layer(16), Layer(16)])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for embed, layers in zip(self.embed, self.block, strict=True):
            x = embed(x)
            for layer in layers:
                x = layer(x)
        return x.mean()


class FeedForwards(nn.Module):
    """Like MobileBERT's layer: attention, then a list of feed-forward layers, then a residual
    from the layer's input; the list holds less than half of the layer."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attention = nn.Linear(width, 4 * width)
        self.back = nn.Linear(4 * width, width)
        self.ffn = nn.ModuleList([Layer(width) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.back(torch.relu(self.attention(x)))
        for layer in self.ffn:
            hidden = layer(hidden)
        return x + hidden


class Residual(nn.Module):
    """A residual block whose body is a list of layers: the block is the layer."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(Layer(width), Layer(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def test_a_list_of_stages_gives_the_layers_of_each_stage() -> None:
    names = [name for name, _ in find_blocks(Staged())]
    assert names == [f"stages.{stage}.layers.{layer}" for stage in range(2)
                     for layer in range(3)]


def test_a_list_of_lists_gives_their_layers_and_leaves_the_per_stage_lists_out() -> None:
    model = ListsOfLists()
    expected = ["block.0.0", "block.0.1", "block.1.0", "block.1.1", "block.1.2"]
    assert [name for name, _ in find_blocks(model)] == expected
    assert [name for name, _ in find_blocks(model, torch.ones(2, 8))] == expected


def test_a_list_holding_less_than_half_of_each_layer_is_part_of_it() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    model.layers = nn.ModuleList([FeedForwards(8), FeedForwards(16)])  # not alike
    assert [name for name, _ in find_blocks(model)] == ["layers.0", "layers.1"]


def test_blocks_all_alike_are_the_layers_and_their_lists_parts_of_them() -> None:
    # Residual blocks of one width: each block is a layer of the model, its body a part of
    # it (planned per body, every residual sum would be a chain break: 48% of the plain peak
    # at least instead of 31% for six such blocks of convolutions).
    model = nn.Sequential(nn.Linear(8, 8))
    model.blocks = nn.ModuleList([Residual(), Residual(), Residual()])
    assert [name for name, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("build", [Staged, ListsOfLists], ids=["stages", "lists_of_lists"])
def test_toys_plan_no_segment_across_a_stage_boundary_and_train_as_plain(build) -> None:
    torch.manual_seed(0)
    model = build()
    sample = torch.randn(4, 8)
    profile = gradckpt.profile(model, sample, loss_fn=lambda out: out, repeats=1)
    boundary = len(list(model.stages[0].layers) if build is Staged else model.block[0])
    assert profile.chain_breaks == [boundary]
    for budget in ("40%", "70%"):
        try:
            plan = gradckpt.solve(profile, budget)
        except gradckpt.BudgetError as error:
            plan = gradckpt.solve(profile, error.minimum_bytes)
        for segment in plan.segments:
            assert not segment.start < boundary <= segment.end, plan.segments
        torch.manual_seed(0)
        plain = build()
        gradckpt.apply(model, plan)
        try:
            model.zero_grad(set_to_none=True)
            model(sample).backward()
        finally:
            gradckpt.disable(model)
        plain(sample).backward()
        for (name, got), expected in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(got.grad, expected.grad), (budget, name)
