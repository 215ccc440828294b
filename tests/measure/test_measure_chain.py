"""find_blocks finds the chain of blocks, in execution order; resolve_blocks checks a user's own.

Hugging Face models are built from tiny configs with random weights. Execution order is checked
by running them: forward pre-hooks on the returned blocks must fire in the returned order.
Where creation order and run order differ (CLIP), find_blocks needs a sample to run the model on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import tiny_bart, tiny_clip, tiny_llama, tiny_t5
from torch import nn

import gradckpt
from gradckpt.measure import find_blocks, resolve_blocks
from gradckpt.side_by_side import compare_plans
from gradckpt.toy_models import GPTConfig, TinyGPT, mlp_chain, small_cnn

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

VOCAB = 64


def tiny_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=2, n_positions=32, bos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertModel(config)


def run_llama_like(model: nn.Module) -> None:
    model(input_ids=torch.randint(3, VOCAB, (2, 8)))


def run_encoder_decoder(model: nn.Module) -> None:
    model(
        input_ids=torch.randint(3, VOCAB, (2, 8)),
        decoder_input_ids=torch.randint(3, VOCAB, (2, 5)),
    )


HF_MODELS = {
    # name: (builder, expected block names, how to run a forward pass)
    "llama": (lambda: tiny_llama(3, VOCAB), [f"model.layers.{i}" for i in range(3)],
              run_llama_like),
    "gpt2": (tiny_gpt2, [f"transformer.h.{i}" for i in range(3)], run_llama_like),
    "bert": (tiny_bert, [f"encoder.layer.{i}" for i in range(2)], run_llama_like),
    "t5": (
        lambda: tiny_t5(2, VOCAB),
        [f"encoder.block.{i}" for i in range(2)] + [f"decoder.block.{i}" for i in range(2)],
        run_encoder_decoder,
    ),
    "bart": (
        lambda: tiny_bart(2, VOCAB, decoder_layers=3),
        [f"model.encoder.layers.{i}" for i in range(2)]
        + [f"model.decoder.layers.{i}" for i in range(3)],
        run_encoder_decoder,
    ),
}


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_case(request: pytest.FixtureRequest) -> tuple[nn.Module, list[str], object]:
    torch.manual_seed(0)
    builder, expected, run = HF_MODELS[request.param]
    return builder().eval(), expected, run


# --------------------------------------------------------------------------------------------
# find_blocks
# --------------------------------------------------------------------------------------------


def test_hf_models_give_their_layers(hf_case) -> None:
    model, expected, _ = hf_case
    blocks = find_blocks(model)
    assert [name for name, _ in blocks] == expected
    modules = dict(model.named_modules())
    assert all(module is modules[name] for name, module in blocks)


def blocks_in_the_order_they_run(blocks: list[tuple[str, nn.Module]], run) -> list[str]:
    """The names of ``blocks`` in the order their forward pre-hooks fire while ``run()`` runs."""
    calls: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda _module, _args, name=name: calls.append(name))
        for name, module in blocks
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def names(blocks: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in blocks]


def test_hf_blocks_come_in_execution_order(hf_case) -> None:
    model, _, run = hf_case
    blocks = find_blocks(model)
    assert blocks_in_the_order_they_run(blocks, lambda: run(model)) == names(blocks)


CLIP_TEXT_LAYERS = [f"text_model.encoder.layers.{i}" for i in range(2)]
CLIP_VISION_LAYERS = [f"vision_model.encoder.layers.{i}" for i in range(2)]


def clip_sample() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(3, VOCAB, (2, 8)),
        "pixel_values": torch.randn(2, 3, 16, 16),
    }


def test_clip_without_a_sample_gives_its_towers_in_creation_order() -> None:
    # Rule 4: structure alone gives the order of creation, text tower first, although CLIP
    # runs its vision tower first; a sample is what fixes that (next test).
    assert names(find_blocks(tiny_clip(VOCAB))) == CLIP_TEXT_LAYERS + CLIP_VISION_LAYERS


def test_clip_towers_come_in_execution_order_with_a_sample() -> None:
    model = tiny_clip(VOCAB).eval()
    sample = clip_sample()
    blocks = find_blocks(model, sample=sample)
    assert names(blocks) == CLIP_VISION_LAYERS + CLIP_TEXT_LAYERS
    assert blocks_in_the_order_they_run(blocks, lambda: model(**sample)) == names(blocks)
    modules = dict(model.named_modules())
    assert all(module is modules[name] for name, module in blocks)


def test_tiny_gpt_order_is_unchanged_by_a_sample() -> None:
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16))
    idx = torch.randint(0, 512, (2, 16))
    expected = find_blocks(model)
    assert find_blocks(model, sample=idx) == expected
    assert find_blocks(model, sample=(idx,)) == expected
    assert find_blocks(model, sample={"idx": idx, "targets": idx}) == expected


class Counter(nn.Module):
    """Counts its calls in a buffer that it replaces (as some rotary embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return x


class StatefulChain(nn.Module):
    """Layers whose forward changes state even without grad: BatchNorm, dropout, a counter.

    With ``fail`` set, the forward pass raises after the first layer has run.
    """

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.counter = Counter()
        self.layers = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.5))
                for _ in range(depth)
            ]
        )
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.counter(x)
        for layer in self.layers:
            x = layer(x)
            if self.fail:
                raise RuntimeError("forward failed on purpose")
        return x


def snapshot(model: nn.Module) -> dict:
    """What a forward pass could change, to compare before and after."""
    return {
        "state": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "buffer_ids": [id(buffer) for buffer in model.buffers()],
        "grads": [parameter.grad for parameter in model.parameters()],
        "training": [module.training for module in model.modules()],
        "cpu_rng": torch.get_rng_state(),
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for name, tensor in before["state"].items():
        assert torch.equal(tensor, after["state"][name]), name
    assert before["buffer_ids"] == after["buffer_ids"]
    assert before["grads"] == after["grads"]
    assert before["training"] == after["training"]
    assert torch.equal(before["cpu_rng"], after["cpu_rng"])


def no_forward_hooks(model: nn.Module) -> bool:
    return all(
        not module._forward_pre_hooks and not module._forward_hooks for module in model.modules()
    )


def test_find_blocks_with_a_sample_leaves_the_model_and_rng_as_they_were() -> None:
    torch.manual_seed(0)
    model = StatefulChain().train()
    sample = torch.randn(4, 8)
    before = snapshot(model)
    assert names(find_blocks(model, sample=sample)) == ["layers.0", "layers.1", "layers.2"]
    assert_same_state(before, snapshot(model))
    assert no_forward_hooks(model)

    # Not a vacuous check: the same forward pass on its own does change all of it.
    with torch.no_grad():
        model(sample)
    after_a_plain_run = snapshot(model)
    running_mean = "layers.0.1.running_mean"
    assert not torch.equal(before["state"][running_mean], after_a_plain_run["state"][running_mean])
    assert model.counter.calls.item() == 1
    assert before["buffer_ids"] != after_a_plain_run["buffer_ids"]  # the counter replaced its own
    assert not torch.equal(before["cpu_rng"], after_a_plain_run["cpu_rng"])


@pytest.mark.cuda
def test_find_blocks_with_a_sample_puts_the_cuda_rng_back() -> None:
    model = StatefulChain().train().cuda()
    sample = torch.randn(4, 8, device="cuda")
    before = torch.cuda.get_rng_state()
    find_blocks(model, sample=sample)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    model(sample)  # dropout on the GPU draws from the CUDA generator
    assert not torch.equal(torch.cuda.get_rng_state(), before)


def test_find_blocks_with_a_sample_removes_its_hooks_and_keeps_the_users() -> None:
    model = StatefulChain().eval()
    user_hook = model.layers[1].register_forward_pre_hook(lambda _module, _args: None)
    find_blocks(model, sample=torch.randn(4, 8))
    assert list(model.layers[1]._forward_pre_hooks) == [user_hook.id]
    user_hook.remove()
    assert no_forward_hooks(model)


def test_a_forward_that_raises_leaves_no_hooks_and_no_state_behind() -> None:
    torch.manual_seed(0)
    model = StatefulChain().train()
    model.fail = True
    sample = torch.randn(4, 8)  # drawn before the snapshot of the RNG state
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="forward failed on purpose"):
        find_blocks(model, sample=sample)
    assert no_forward_hooks(model)
    assert_same_state(before, snapshot(model))


def test_a_sample_of_the_wrong_type_leaves_no_hooks_behind() -> None:
    model = StatefulChain()
    with pytest.raises(gradckpt.UsageError, match="sample must be a tensor"):
        find_blocks(model, sample=3)
    assert no_forward_hooks(model)


class SkipsItsLastLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))  # layers 2 and 3 never run


def test_blocks_that_do_not_run_on_the_sample_are_named() -> None:
    model = SkipsItsLastLayers()
    with pytest.raises(gradckpt.UsageError) as error:
        find_blocks(model, sample=torch.randn(2, 4))
    message = str(error.value)
    assert "blocks ['layers.2', 'layers.3'] did not run in the model's forward pass" in message
    assert "give a sample that runs them all" in message
    assert "blocks=[model.encoder, model.decoder]" in message  # how to pass blocks= yourself
    assert no_forward_hooks(model)


class RunsItsLayersBackwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = layer(x)
        return x


def test_a_sample_reorders_blocks_within_a_stack_too() -> None:
    model = RunsItsLayersBackwards()
    assert names(find_blocks(model)) == ["layers.0", "layers.1", "layers.2"]
    assert names(find_blocks(model, sample=torch.randn(2, 4))) == [
        "layers.2",
        "layers.1",
        "layers.0",
    ]


def test_find_blocks_is_exported_from_gradckpt() -> None:
    assert gradckpt.find_blocks is find_blocks
    assert "find_blocks" in gradckpt.__all__


def test_tiny_gpt() -> None:
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))
    blocks = find_blocks(model)
    assert [name for name, _ in blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert [module for _, module in blocks] == list(model.transformer.h)


def test_mlp_chain_is_a_chain_of_its_sequential_blocks() -> None:
    chain = mlp_chain(4, 16)
    assert find_blocks(chain) == list(chain.named_children())
    assert [name for name, _ in find_blocks(chain)] == ["0", "1", "2", "3"]


def test_small_cnn_blocks_include_the_head() -> None:
    # every child of a Sequential runs in turn, the head (pool, flatten, Linear) too
    cnn = small_cnn(depth=3)
    assert [name for name, _ in find_blocks(cnn)] == ["0", "1", "2", "3"]


def test_heterogeneous_top_level_sequential_is_a_chain_of_its_children() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert [name for name, _ in find_blocks(model)] == ["0", "1", "2"]


def test_sequential_wrapper_around_a_model_finds_the_stack_inside() -> None:
    # nn.Sequential(backbone, head): the backbone's layers are a far better chain than 2 blocks
    model = nn.Sequential(TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2)), nn.Softmax(-1))
    assert [name for name, _ in find_blocks(model)] == ["0.transformer.h.0", "0.transformer.h.1"]


def test_torch_transformer_gives_encoder_then_decoder_layers() -> None:
    model = nn.Transformer(
        d_model=16,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dim_feedforward=32,
        batch_first=True,
    )
    assert [name for name, _ in find_blocks(model)] == [
        "encoder.layers.0",
        "encoder.layers.1",
        "decoder.layers.0",
        "decoder.layers.1",
        "decoder.layers.2",
    ]


class MixtureOfExperts(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for expert in self.experts) / len(self.experts)


class MoELayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(width, width // 2) for _ in range(2)])
        self.moe = MixtureOfExperts(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(torch.cat([head(x) for head in self.heads], dim=-1))


class MoEModel(nn.Module):
    """A stack of layers, each holding stacks of its own (heads, experts)."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.layers = nn.ModuleList([MoELayer(width) for _ in range(depth)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return x


def test_stacks_inside_blocks_are_not_returned() -> None:
    assert [name for name, _ in find_blocks(MoEModel())] == ["layers.0", "layers.1", "layers.2"]


class Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class ResNetLike(nn.Module):
    """Four stages of the same block class; the early ones are narrow and hold few parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        for index, width in enumerate([4, 8, 16, 32], start=1):
            self.add_module(f"layer{index}", nn.Sequential(Stage(width), Stage(width)))
        self.up = nn.ModuleList([nn.Conv2d(w, 2 * w, 1) for w in (4, 8, 16)])
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage_index in range(1, 5):
            x = getattr(self, f"layer{stage_index}")(x)
            if stage_index < 4:
                x = self.up[stage_index - 1](x)
        return self.fc(x.mean(dim=(2, 3)))


def test_small_stacks_of_the_main_block_class_are_kept_other_small_stacks_dropped() -> None:
    # layer1 holds ~1/64 of layer4's parameters, but it is a stage like layer4: kept.
    # `up` (three 1x1 convs, run between the stages) is a small stack of another class: dropped.
    names = [name for name, _ in find_blocks(ResNetLike())]
    assert names == [f"layer{stage}.{block}" for stage in range(1, 5) for block in range(2)]


class CodebookDecoder(nn.Module):
    """Like MusicGen: per-codebook embeddings and heads beside the main stack of layers."""

    def __init__(self, width: int = 32, codebooks: int = 4) -> None:
        super().__init__()
        self.embed_tokens = nn.ModuleList([nn.Embedding(8, width) for _ in range(codebooks)])
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(width, 2, 4 * width, batch_first=True) for _ in range(3)]
        )
        self.heads = nn.ModuleList([nn.Linear(width, 8) for _ in range(codebooks)])


def test_side_by_side_lists_beside_the_main_stack_are_left_out() -> None:
    assert [name for name, _ in find_blocks(CodebookDecoder())] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]


def test_checkpointed_blocks_still_count_as_one_class() -> None:
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))
    gradckpt.checkpoint_module(model.transformer.h[1])
    try:
        names = [name for name, _ in find_blocks(model)]
    finally:
        gradckpt.uncheckpoint_module(model.transformer.h[1])
    assert names == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


@pytest.mark.parametrize(
    "model",
    [
        nn.Linear(4, 4),
        nn.Sequential(nn.Linear(4, 4)),
        nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}),
        nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]),
    ],
    ids=["linear", "sequential-of-one", "moduledict", "mixed-modulelist"],
)
def test_no_chain_is_a_usage_error_explaining_blocks(model: nn.Module) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        find_blocks(model)
    message = str(error.value)
    assert f"found no chain of blocks in {type(model).__name__}" in message
    assert "nn.ModuleList or nn.Sequential" in message  # what was searched
    assert "blocks=" in message and "blocks=[model.encoder, model.decoder]" in message
    assert "blocks=['encoder', 'decoder']" in message


def test_find_blocks_needs_a_module() -> None:
    with pytest.raises(gradckpt.UsageError, match="needs a torch.nn.Module, got str"):
        find_blocks("model.layers")


# --------------------------------------------------------------------------------------------
# Lists of several classes, stacks that do not run, lists run interleaved
# --------------------------------------------------------------------------------------------


class MixerLayer(nn.Module):
    """A residual layer: attention-like (mixes positions) where ``mixing``, else recurrent-like
    (a running sum over positions); a context (an image's states) added where given and
    ``cross``."""

    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inner = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        h = h.cumsum(dim=1) if self.kind == "recurrent" else h.softmax(dim=1) * h
        if context is not None:
            h = h + context.mean(dim=1, keepdim=True)
        return x + self.out(h)


class AttentionLayer(MixerLayer):
    def __init__(self, width: int) -> None:
        super().__init__(width, "attention")


class RecurrentLayer(MixerLayer):
    def __init__(self, width: int) -> None:
        super().__init__(width, "recurrent")


class CrossAttentionLayer(MixerLayer):
    def __init__(self, width: int) -> None:
        super().__init__(width, "attention")


class HybridModel(nn.Module):
    """Like Jamba, OLMo-hybrid or Mllama's text model: layers of several classes in one list,
    per-codebook heads of several classes beside it; cross-attention layers run only given
    an image's states (``context``)."""

    def __init__(self, kinds: str = "ARAR", width: int = 16) -> None:
        super().__init__()
        classes = {"A": AttentionLayer, "R": RecurrentLayer, "C": CrossAttentionLayer}
        self.embed = nn.Embedding(10, width)
        self.layers = nn.ModuleList([classes[kind](width) for kind in kinds])
        self.heads = nn.ModuleList([nn.Linear(width, 4), nn.Bilinear(width, width, 4)])

    def forward(self, idx: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            if isinstance(layer, CrossAttentionLayer):
                if context is None:
                    continue  # text only: the cross-attention layers are skipped
                x = layer(x, context)
            else:
                x = layer(x)
        return self.heads[0](x)


def tokens(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 10, (batch, length), generator=torch.Generator().manual_seed(0))


def trains_as_the_plain_model(model: nn.Module, sample: object, **enable_kwargs) -> list[str]:
    """Plan ``model`` with ``gradckpt.enable`` at 60% (or the least feasible budget), train one
    step with the plan and one without: gradients bit for bit equal (the loss computed whole,
    ``output_head="plain"``), the plan's measured peak within its budget + 3%. The plan's
    blocks."""
    try:
        plan = gradckpt.enable(model, sample, budget="60%", optimizer="none",
                               output_head="plain", **enable_kwargs)
    except gradckpt.BudgetError as error:
        plan = gradckpt.solve(error.profile, error.minimum_bytes)
    gradckpt.disable(model)
    result = compare_plans(model, sample, {"plain": None, "gradckpt": plan}, rounds=0)
    assert result.identical("gradckpt"), result.largest_difference("gradckpt")
    assert result.peak_bytes["gradckpt"] <= plan.budget_bytes * 1.03
    return list(plan.block_names)


def test_a_list_of_several_classes_that_is_the_main_stack_is_the_chain() -> None:
    # Rule 1: the layers are the chain, each whole, in their order; the heads (two classes,
    # side by side, a few parameters) are not.
    model = HybridModel("ARAR")
    expected = [f"layers.{i}" for i in range(4)]
    assert names(find_blocks(model)) == expected
    assert names(find_blocks(model, sample=tokens())) == expected
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, tokens()) == expected


class HybridMoELayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mixer = AttentionLayer(width)
        self.moe = MixtureOfExperts(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.mixer(x))


def test_stacks_inside_the_blocks_of_a_list_of_several_classes_are_part_of_them() -> None:
    # Rule 2: each layer's experts (a stack of one class) belong to it.
    model = HybridModel("AR")
    model.layers.append(HybridMoELayer(16))
    assert names(find_blocks(model)) == ["layers.0", "layers.1", "layers.2"]


def test_a_list_of_several_classes_smaller_than_a_stack_is_left_out() -> None:
    model = MoEModel(width=16, depth=3)
    model.adapters = nn.ModuleList([nn.Linear(16, 16), nn.Conv1d(16, 16, 1)])  # 2 classes, small
    assert names(find_blocks(model)) == ["layers.0", "layers.1", "layers.2"]


class OneLayerWithAnMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def test_a_sequential_of_several_classes_inside_a_model_is_no_chain() -> None:
    # An MLP's pipeline is not the model's chain of layers: only the model itself counts
    # (rule 5).
    with pytest.raises(gradckpt.UsageError, match="found no chain of blocks in OneLayerWithAnMLP"):
        find_blocks(OneLayerWithAnMLP())


def test_layers_of_a_class_that_does_not_run_on_the_sample_are_left_out() -> None:
    # Cross-attention layers skipped on text: without a sample they are in the chain; on a
    # text sample they are left out (they run only given an image's states); with the image's
    # states they run, in place.
    model = HybridModel("ACAC")
    assert names(find_blocks(model)) == [f"layers.{i}" for i in range(4)]
    assert names(find_blocks(model, sample=tokens())) == ["layers.0", "layers.2"]
    with_image = {"idx": tokens(), "context": torch.randn(2, 3, 16)}
    assert names(find_blocks(model, sample=with_image)) == [f"layers.{i}" for i in range(4)]
    measured = gradckpt.profile(model, tokens(), repeats=1)
    assert [block.name for block in measured.blocks] == ["layers.0", "layers.2"]
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, tokens()) == ["layers.0", "layers.2"]


class SkipsOneCrossAttentionLayer(HybridModel):
    def forward(self, idx: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for index, layer in enumerate(self.layers):
            if index != 3:
                x = layer(x, context) if isinstance(layer, CrossAttentionLayer) else layer(x)
        return x.sum(dim=-1)


def test_a_class_of_layers_that_runs_partly_is_named() -> None:
    model = SkipsOneCrossAttentionLayer("ACAC")
    sample = {"idx": tokens(), "context": torch.randn(2, 3, 16)}
    with pytest.raises(gradckpt.UsageError, match=r"blocks \['layers.3'\] did not run"):
        find_blocks(model, sample=sample)
    with pytest.raises(gradckpt.UsageError, match=r"blocks \[3\] did not run .*\(layers.3\)"):
        gradckpt.profile(model, sample, repeats=1)
    assert no_forward_hooks(model)


class Towers(nn.Module):
    """A multimodal model: a vision tower that runs only given pixels, then a language model."""

    def __init__(self, vision_width: int, width: int = 16) -> None:
        super().__init__()
        self.vision = nn.ModuleList(
            [nn.TransformerEncoderLayer(vision_width, 2, 2 * vision_width, dropout=0.0,
                                        batch_first=True) for _ in range(2)])
        self.project = nn.Linear(vision_width, width)
        self.embed = nn.Embedding(10, width)
        self.text = nn.ModuleList([AttentionLayer(width) for _ in range(3)])

    def forward(self, idx: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        if pixels is not None:
            for layer in self.vision:
                pixels = layer(pixels)
            x = torch.cat([self.project(pixels), x], dim=1)
        for layer in self.text:
            x = layer(x)
        return x.sum(dim=-1)


TEXT_LAYERS = ["text.0", "text.1", "text.2"]
VISION_LAYERS = ["vision.0", "vision.1"]


def test_a_tower_that_does_not_run_on_the_sample_is_left_out() -> None:
    model = Towers(vision_width=16)  # both towers chosen by structure (rule 3)
    assert names(find_blocks(model)) == VISION_LAYERS + TEXT_LAYERS
    assert names(find_blocks(model, sample=tokens())) == TEXT_LAYERS
    with_pixels = {"idx": tokens(), "pixels": torch.randn(2, 4, 16)}
    assert names(find_blocks(model, sample=with_pixels)) == VISION_LAYERS + TEXT_LAYERS
    measured = gradckpt.profile(model, tokens(), repeats=1)
    assert [block.name for block in measured.blocks] == TEXT_LAYERS
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, tokens()) == TEXT_LAYERS


def forward_calls(model: nn.Module, run: object) -> int:
    """How many times ``run()`` calls ``model``'s forward."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


def test_profile_takes_the_stack_that_runs_where_the_structures_does_not() -> None:
    # The vision tower holds ten times the language model's parameters: by structure it is
    # the chain alone. On text, profile() (and so enable and estimate) measures the language
    # model's layers, which find_blocks chooses among the stacks that ran: as if given them.
    model = Towers(vision_width=64)
    assert names(find_blocks(model)) == VISION_LAYERS
    assert names(find_blocks(model, sample=tokens())) == TEXT_LAYERS
    found = gradckpt.profile(model, tokens(), repeats=1)
    given = gradckpt.profile(model, tokens(), blocks="text", repeats=1)
    assert [block.name for block in found.blocks] == TEXT_LAYERS
    assert (found.peak_bytes, found.fixed_bytes) == (given.peak_bytes, given.fixed_bytes)
    assert [(b.input_bytes, b.output_bytes, b.saved_bytes) for b in found.blocks] == [
        (b.input_bytes, b.output_bytes, b.saved_bytes) for b in given.blocks]
    assert no_forward_hooks(model)
    predicted = gradckpt.estimate(model, tokens(), device="h100-80gb")
    assert [block.name for block in predicted.blocks] == TEXT_LAYERS
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, tokens()) == TEXT_LAYERS


def test_only_a_chain_that_does_not_run_costs_more_forward_passes() -> None:
    # Where the structure's chain runs (or a tower of it is left out), profile runs the
    # model as often as given the blocks; where none of it runs, two more forwards (the
    # recording step that shows it, and find_blocks's run) find the chain that does.
    runs = Towers(vision_width=16)  # both towers by structure: the vision one left out
    assert forward_calls(runs, lambda: gradckpt.profile(runs, tokens(), repeats=1)) == (
        forward_calls(runs, lambda: gradckpt.profile(runs, tokens(), blocks="text", repeats=1)))
    model = Towers(vision_width=64)
    assert forward_calls(model, lambda: gradckpt.profile(model, tokens(), repeats=1)) == (
        forward_calls(model, lambda: gradckpt.profile(model, tokens(), blocks="text",
                                                      repeats=1)) + 2)


def test_blocks_given_that_do_not_run_name_those_that_do() -> None:
    model = Towers(vision_width=64)
    with pytest.raises(gradckpt.UsageError) as error:
        gradckpt.profile(model, tokens(), blocks="vision", repeats=1)
    message = str(error.value)
    assert "blocks [0, 1] did not run in the model's forward pass on this sample" in message
    assert "(vision.0, vision.1)" in message and "pass blocks='text'" in message
    assert names(resolve_blocks(model, "text")) == TEXT_LAYERS
    assert no_forward_hooks(model)


def test_a_sample_on_which_no_stack_runs_is_an_error() -> None:
    model = Towers(vision_width=16)
    model.forward = lambda idx: model.embed(idx).sum(dim=-1)  # neither tower runs
    with pytest.raises(gradckpt.UsageError, match=r"blocks \['vision.0', 'vision.1', 'text.0'"):
        find_blocks(model, sample=tokens())
    with pytest.raises(gradckpt.UsageError, match=r"blocks \[0, 1, 2, 3, 4\] did not run"):
        gradckpt.profile(model, tokens(), repeats=1)


class ParallelLists(nn.Module):
    """Like XLM: attention and feed-forward layers (and their norms) in parallel lists, run
    interleaved in one loop, a residual and a norm between them; with ``chained``, each block
    takes the previous one's output instead."""

    def __init__(self, width: int = 16, depth: int = 3, chained: bool = False) -> None:
        super().__init__()
        self.chained = chained
        self.embed = nn.Embedding(10, width)
        self.attentions = nn.ModuleList([AttentionLayer(width) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(depth)])
        self.ffns = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
             for _ in range(depth)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for attention, norm, ffn in zip(self.attentions, self.norms, self.ffns, strict=True):
            x = ffn(attention(x)) if self.chained else norm(x + ffn(attention(x) * 0.5))
        return x.sum(dim=-1)


def test_lists_run_interleaved_that_are_no_chain_are_refused_before_planning() -> None:
    model = ParallelLists()
    # Structure alone cannot tell: the two lists, in creation order.
    assert names(find_blocks(model)) == [f"attentions.{i}" for i in range(3)] + [
        f"ffns.{i}" for i in range(3)]
    with pytest.raises(gradckpt.UsageError) as error:
        find_blocks(model, sample=tokens())
    message = str(error.value)
    assert "blocks of several lists, attentions, ffns, run interleaved" in message
    assert "'ffns.0' does not take the previous block's output" in message
    assert "blocks='ffns'" in message
    assert no_forward_hooks(model)
    before = snapshot(model)
    for run in (lambda: gradckpt.profile(model, tokens(), repeats=1),
                lambda: gradckpt.enable(model, tokens(), budget="60%", optimizer="none")):
        with pytest.raises(gradckpt.UsageError, match="run interleaved"):
            run()
        assert gradckpt.get_plan(model) is None
    assert_same_state(before, snapshot(model))
    # What the message offers: one of the lists, its blocks checkpointed one by one.
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, tokens(), blocks="ffns") == [
        f"ffns.{i}" for i in range(3)]


def test_lists_run_interleaved_that_are_a_chain_come_in_run_order() -> None:
    model = ParallelLists(chained=True)
    expected = [name for i in range(3) for name in (f"attentions.{i}", f"ffns.{i}")]
    assert names(find_blocks(model, sample=tokens())) == expected
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, tokens()) == expected


def tiny_mllama_text(layers: int = 4) -> nn.Module:
    """Mllama's language model: self-attention layers and, at ``cross_attention_layers``,
    cross-attention layers, of two classes in one ``model.layers``."""
    config = transformers.MllamaTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[1],
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        use_cache=False)
    torch.manual_seed(0)
    return transformers.MllamaForCausalLM(config).train()


def test_mllama_text_model_trains_over_its_self_attention_layers() -> None:
    model = tiny_mllama_text()
    layers = [f"model.layers.{i}" for i in range(4)]
    assert names(find_blocks(model)) == layers
    assert [type(module).__name__ for _, module in find_blocks(model)][:2] == [
        "MllamaSelfAttentionDecoderLayer", "MllamaCrossAttentionDecoderLayer"]
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    text_layers = [name for name in layers if name != "model.layers.1"]  # no image: skipped
    assert names(find_blocks(model, sample=sample)) == text_layers
    torch.manual_seed(0)
    assert trains_as_the_plain_model(model, sample) == text_layers


def test_xlm_parallel_lists_are_refused_with_what_was_found() -> None:
    config = transformers.XLMConfig(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=2,
                                    max_position_embeddings=64)
    model = transformers.XLMWithLMHeadModel(config).train()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(gradckpt.UsageError, match=r"blocks of several lists, "
                       r"transformer\.attentions, transformer\.ffns, run interleaved"):
        gradckpt.enable(model, {"input_ids": ids, "labels": ids}, budget="60%", optimizer="none")
    assert no_forward_hooks(model)


# --------------------------------------------------------------------------------------------
# resolve_blocks
# --------------------------------------------------------------------------------------------


@pytest.fixture
def gpt() -> TinyGPT:
    return TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))


def test_resolve_none_is_find_blocks(gpt: TinyGPT) -> None:
    assert resolve_blocks(gpt) == find_blocks(gpt)
    assert resolve_blocks(gpt, None) == find_blocks(gpt)


def test_resolve_modules_names_and_mixtures_in_the_order_given(gpt: TinyGPT) -> None:
    h = gpt.transformer.h
    assert resolve_blocks(gpt, [h[0], h[1]]) == [
        ("transformer.h.0", h[0]),
        ("transformer.h.1", h[1]),
    ]
    assert resolve_blocks(gpt, ("transformer.h.2", h[0])) == [
        ("transformer.h.2", h[2]),
        ("transformer.h.0", h[0]),
    ]
    assert resolve_blocks(gpt, iter([gpt.transformer.wte, "lm_head"])) == [
        ("transformer.wte", gpt.transformer.wte),
        ("lm_head", gpt.lm_head),
    ]


def test_resolve_a_modulelist_or_its_name_gives_its_children(gpt: TinyGPT) -> None:
    expected = find_blocks(gpt)
    assert resolve_blocks(gpt, gpt.transformer.h) == expected
    assert resolve_blocks(gpt, "transformer.h") == expected
    # a list assembled by the user from the model's own modules is fine too
    assert resolve_blocks(gpt, nn.ModuleList(list(gpt.transformer.h))) == expected


def test_resolve_a_shared_module_gets_its_first_name() -> None:
    model = nn.Module()
    model.first = nn.Linear(2, 2)
    model.again = model.first  # the same module under a second name
    model.other = nn.Linear(2, 2)
    assert resolve_blocks(model, ["again", "other"]) == [
        ("first", model.first),
        ("other", model.other),
    ]


def test_resolve_unknown_name_suggests_close_matches(gpt: TinyGPT) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        resolve_blocks(gpt, ["transformer.h.0", "transfomer.h.1"])
    message = str(error.value)
    assert "item 1, 'transfomer.h.1', is not a submodule of TinyGPT" in message
    assert "did you mean 'transformer.h.1'" in message


def test_resolve_unknown_name_without_close_match_lists_top_level_modules(gpt: TinyGPT) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        resolve_blocks(gpt, ["zzz"])
    assert "its top-level modules are 'transformer', 'lm_head'" in str(error.value)


def test_resolve_unknown_container_name(gpt: TinyGPT) -> None:
    with pytest.raises(gradckpt.UsageError, match=r"blocks='transformer\.hh' is not a submodule"):
        resolve_blocks(gpt, "transformer.hh")


def test_resolve_name_of_a_non_container_says_to_use_a_list(gpt: TinyGPT) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        resolve_blocks(gpt, "lm_head")
    assert "names a Linear, not an nn.ModuleList or nn.Sequential" in str(error.value)
    assert "blocks=['lm_head']" in str(error.value)


def test_resolve_module_outside_the_model_is_named(gpt: TinyGPT) -> None:
    stranger = copy.deepcopy(gpt.transformer.h[1])
    with pytest.raises(gradckpt.UsageError) as error:
        resolve_blocks(gpt, [gpt.transformer.h[0], stranger])
    message = str(error.value)
    assert "item 1, a Block, is not a submodule of TinyGPT" in message
    assert "a copy of a layer does not count" in message


def test_resolve_the_model_itself_is_refused(gpt: TinyGPT) -> None:
    with pytest.raises(gradckpt.UsageError, match="item 0 is the model itself"):
        resolve_blocks(gpt, [gpt])
    with pytest.raises(gradckpt.UsageError, match="item 0 is the model itself"):
        resolve_blocks(gpt, [""])


def test_resolve_duplicates_and_nesting_are_refused(gpt: TinyGPT) -> None:
    h = gpt.transformer.h
    with pytest.raises(gradckpt.UsageError, match="'transformer.h.0' is listed twice"):
        resolve_blocks(gpt, [h[0], "transformer.h.0"])
    with pytest.raises(
        gradckpt.UsageError, match="'transformer.h.0.mlp' lies inside 'transformer.h.0'"
    ):
        resolve_blocks(gpt, ["transformer.h.0.mlp", h[0]])


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        ([], "blocks= is empty"),
        (5, "blocks= must be None, a list of modules or qualified names, or an nn.ModuleList"),
        ({"a": 1}, "got dict"),
        ([3], "item 0 has type int; each block must be a submodule of the model"),
        (nn.Linear(2, 2), "blocks= got a single Linear; pass a list of blocks"),
    ],
    ids=["empty", "int", "dict", "int-item", "single-module"],
)
def test_resolve_bad_blocks(gpt: TinyGPT, blocks: object, expected: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        resolve_blocks(gpt, blocks)
    assert expected in str(error.value)


def test_resolve_blocks_needs_a_module() -> None:
    with pytest.raises(
        gradckpt.UsageError, match="resolve_blocks\\(\\) needs a torch.nn.Module, got list"
    ):
        resolve_blocks([nn.Linear(2, 2)], None)
