"""Attention in ``estimate`` for a GPU: the kernel that GPU would pick, and what it saves.

PyTorch's choice on CUDA (sdp_utils.cpp) is mirrored by ``measure.attention.choose_kernel``;
the kernel's own ATen operation then runs on the fake tensors, so the bytes it saves for
backward come from its autograd formula. The cases below are the conditions that decide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradckpt
from gradckpt.predict.attention import TargetAttention, _Call, choose_kernel

H100, A100, L4 = (9, 0), (8, 0), (8, 9)


def heads_view(batch=2, heads=8, seq=128, dim=64, dtype=torch.bfloat16) -> torch.Tensor:
    """(batch, heads, seq, dim) as Transformers makes it: a view of (batch, seq, heads, dim)."""
    return torch.empty(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)


def contiguous(batch=2, heads=8, seq=128, dim=64, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(batch, heads, seq, dim, dtype=dtype)


@pytest.mark.parametrize(("call", "capability", "kernel"), [
    # Hopper prefers cuDNN for half precision in Transformers' layout...
    (lambda: _Call(heads_view(), heads_view(), heads_view()), H100, "cudnn"),
    # ...but cuDNN needs that layout: a contiguous (batch, heads, seq, dim) goes to flash.
    (lambda: _Call(contiguous(), contiguous(), contiguous()), H100, "flash"),
    # Ampere and Ada never try cuDNN first.
    (lambda: _Call(heads_view(), heads_view(), heads_view()), A100, "flash"),
    (lambda: _Call(heads_view(), heads_view(), heads_view(), dropout_p=0.1), L4, "flash"),
    # fp32: no flash, no cuDNN; the memory-efficient kernel takes it.
    (lambda: _Call(contiguous(dtype=torch.float32), contiguous(dtype=torch.float32),
                   contiguous(dtype=torch.float32)), H100, "efficient"),
    # A mask rules flash out (cuDNN takes one on Hopper).
    (lambda: _Call(contiguous(), contiguous(), contiguous(),
                   attn_mask=torch.ones(128, 128, dtype=torch.bool)), A100, "efficient"),
    (lambda: _Call(heads_view(), heads_view(), heads_view(),
                   attn_mask=torch.ones(128, 128, dtype=torch.bool)), H100, "cudnn"),
    # Grouped-query attention: flash and cuDNN take it with enable_gqa...
    (lambda: _Call(contiguous(), contiguous(heads=2), contiguous(heads=2), enable_gqa=True),
     A100, "flash"),
    # ...the memory-efficient kernel does not (fp32), nor anything without enable_gqa.
    (lambda: _Call(contiguous(dtype=torch.float32), contiguous(heads=2, dtype=torch.float32),
                   contiguous(heads=2, dtype=torch.float32), enable_gqa=True), A100, "math"),
    (lambda: _Call(contiguous(), contiguous(heads=2), contiguous(heads=2)), A100, "math"),
    # Head sizes: flash up to 256; training with 192 < d <= 224 not on sm86-89.
    (lambda: _Call(contiguous(dim=208), contiguous(dim=208), contiguous(dim=208)), A100,
     "flash"),
    (lambda: _Call(*(contiguous(dim=208).requires_grad_() for _ in range(3))), L4,
     "efficient"),
    (lambda: _Call(contiguous(dim=264), contiguous(dim=264), contiguous(dim=264)), A100,
     "efficient"),
    # fp32 head size not a multiple of 4: only the math path.
    (lambda: _Call(*(contiguous(dim=70, dtype=torch.float32) for _ in range(3))), A100,
     "math"),
    # Causal attention with more keys than queries: not flash.
    (lambda: _Call(contiguous(seq=64), contiguous(), contiguous(), is_causal=True), A100,
     "efficient"),
])
def test_the_kernel_is_chosen_as_pytorch_chooses_on_that_gpu(call, capability, kernel) -> None:
    assert choose_kernel(call(), capability) == kernel


def gpt2(attention_dropout: float):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=512,
        attn_pdrop=attention_dropout, resid_pdrop=0.1, embd_pdrop=0.1,
        bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config).train()


BATCH, SEQ, HEADS = 2, 512, 4


def gpt2_sample() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 512, (BATCH, SEQ), device="meta")
    return {"input_ids": ids, "labels": ids}


def saved_per_block(model, device: str, **kwargs) -> list[int]:
    predicted = gradckpt.estimate(model, gpt2_sample(), device=device, **kwargs)
    return [block.saved_bytes for block in predicted.blocks], predicted.notes["attention"]


def test_attention_dropout_costs_nothing_on_a_gpu_but_the_weights_on_this_cpu() -> None:
    # On a GPU the fused kernels apply dropout inside: no weights, no mask kept. This CPU's
    # only fused kernel takes no dropout, so it runs the math path and keeps both.
    with_dropout, note = saved_per_block(gpt2(0.1), "a100-80gb", dtype=torch.bfloat16)
    without_dropout, _ = saved_per_block(gpt2(0.0), "a100-80gb", dtype=torch.bfloat16)
    assert with_dropout == without_dropout
    assert note.startswith("FlashAttention-2: what PyTorch picks on a100-80gb")
    on_this_cpu, cpu_note = saved_per_block(gpt2(0.1), "this", dtype=torch.bfloat16)
    weights = BATCH * HEADS * SEQ * SEQ * 2  # one bf16 attention matrix per layer
    assert all(cpu - gpu >= weights for cpu, gpu in zip(on_this_cpu, with_dropout, strict=True))
    assert cpu_note.startswith("no fused attention kernel")


def test_the_fused_kernel_saves_its_output_and_one_log_sum_exp_per_query() -> None:
    # In fp32 an H100 runs the memory-efficient kernel: inputs (q, k, v), output, and a
    # float32 log-sum-exp per query and head, plus two 8-byte RNG seeds with dropout.
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q, k, v = (torch.empty(BATCH, HEADS, SEQ, 32, requires_grad=True) for _ in range(3))
        saved = []
        with (
            TargetAttention(H100) as target,
            torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t),
        ):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert target.kernels == {"efficient"}
    tensor = BATCH * HEADS * SEQ * 32 * 4
    assert sorted(saved) == sorted([tensor] * 4 + [BATCH * HEADS * SEQ * 4, 8, 8])


def test_torchs_function_is_restored_even_when_the_step_fails() -> None:
    original = F.scaled_dot_product_attention

    def broken_loss(output):
        raise RuntimeError("a loss that fails")

    with pytest.raises(gradckpt.UsageError, match="a loss that fails") as raised:
        gradckpt.estimate(gpt2(0.0), gpt2_sample(), loss_fn=broken_loss, device="h100")
    assert isinstance(raised.value.__cause__, RuntimeError)  # the model's own, chained
    assert F.scaled_dot_product_attention is original


def test_a_plan_from_a_gpu_estimate_recomputes_with_the_same_kernel() -> None:
    # estimate measures each block checkpointed too: its recomputation, inside backward, must
    # pick the kernel the forward picked (the engine refuses a recomputation that saves
    # different tensors), so every fate is costed with the target's kernel.
    predicted = gradckpt.estimate(gpt2(0.1), gpt2_sample(), device="h100", dtype=torch.bfloat16)
    block = predicted.blocks[0]
    assert block.checkpointed_backward_peak_bytes > 0
    assert "cuDNN attention" in predicted.notes["attention"]


def test_a_device_given_by_numbers_can_name_its_compute_capability() -> None:
    numbers = {"memory": "48GiB", "bf16_tflops": 180, "fp32_tflops": 90,
               "bandwidth_gbps": 960}
    assert gradckpt.predict.devices.device_spec(numbers).compute_capability is None  # sm80's rules
    ada = gradckpt.predict.devices.device_spec({**numbers, "compute_capability": "8.9"})
    assert ada.compute_capability == (8, 9)
    with pytest.raises(gradckpt.UsageError, match="compute_capability"):
        gradckpt.predict.devices.device_spec({**numbers, "compute_capability": "Ada"})
