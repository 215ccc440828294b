"""``gradckpt.peak_memory()`` (issue 22 item 3): the public measure of a block's peak, the same
meter as ``profile`` (MemTracker on CPU, the caching allocator on CUDA)."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradckpt
from gradckpt.errors import GradckptWarning, forget_warnings
from gradckpt.measure import measure_peak_bytes

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def test_the_peak_equals_the_meters() -> None:
    model = torch.nn.Linear(256, 256)
    x = torch.randn(32, 256)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    expected = measure_peak_bytes(step, model, x)
    with gradckpt.peak_memory(model, x) as peak:
        assert peak.device == torch.device("cpu")
        step()
    assert peak.bytes == expected
    assert peak.start_bytes == 4 * (256 * 256 + 256 + 32 * 256)  # weights, bias, batch
    assert peak.added_bytes == peak.bytes - peak.start_bytes


def test_bytes_reads_the_peak_so_far_and_is_final_after_the_block() -> None:
    model = torch.nn.Linear(64, 64)
    with gradckpt.peak_memory(model) as peak:
        big = torch.zeros(1024, 1024)
        so_far = peak.bytes
        del big
    assert so_far >= 4 * 1024 * 1024
    after = peak.bytes
    torch.zeros(2048, 2048)
    assert peak.bytes == after >= so_far
    assert "PeakMemory(device='cpu'" in repr(peak)


def test_final_even_when_the_block_raises() -> None:
    model = torch.nn.Linear(64, 64)
    with pytest.raises(RuntimeError, match="out of memory"), gradckpt.peak_memory(model) as peak:
        kept = torch.zeros(512, 512)
        raise RuntimeError("out of memory")
    assert peak.bytes >= 4 * 512 * 512
    del kept


def test_nothing_tracked_on_cpu_warns_once() -> None:
    forget_warnings()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gradckpt.peak_memory(device="cpu") as peak:
                torch.zeros(256, 256)
            with gradckpt.peak_memory(device="cpu"):
                pass
        relevant = [w for w in caught if issubclass(w.category, GradckptWarning)]
        assert len(relevant) == 1
        assert "gradckpt.peak_memory(model, optimizer, batch)" in str(relevant[0].message)
        assert relevant[0].filename == __file__
        assert peak.bytes == 4 * 256 * 256  # what was created inside is still counted
    finally:
        forget_warnings()


def test_the_device_defaults_to_the_tracked_objects() -> None:
    with gradckpt.peak_memory(torch.zeros(3)) as peak:
        pass
    assert peak.device == torch.device("cpu")
    with pytest.raises(ValueError, match="cpu and cuda"), gradckpt.peak_memory(device="meta"):
        pass


@pytest.mark.cuda
def test_on_cuda_everything_on_the_device_counts() -> None:
    device = torch.device("cuda")
    model = torch.nn.Linear(1024, 1024, device=device)
    with gradckpt.peak_memory() as peak:  # nothing tracked: the allocator sees it all
        model(torch.randn(64, 1024, device=device)).sum().backward()
    assert peak.device.type == "cuda"
    assert peak.start_bytes >= 4 * 1024 * 1024
    assert peak.bytes >= peak.start_bytes + 4 * 1024 * 1024  # the weight's gradient


def test_a_hugging_face_output_holding_a_cache_is_tracked_through_it() -> None:
    """A loop's ``out`` passed as it is: a Transformers output whose cache (no tensor, no
    module) holds each layer's keys and values; MemTracker alone refuses it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, use_cache=True)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))
    out = model(input_ids=ids, labels=ids)
    cache = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    assert len(cache) == 4
    with gradckpt.peak_memory(model, ids) as without_out:
        pass
    with gradckpt.peak_memory(model, ids, out) as with_out:
        pass
    logits = out.logits.untyped_storage().nbytes()
    held = sum(t.untyped_storage().nbytes() for t in cache) + logits + 4  # and the loss
    assert with_out.start_bytes - without_out.start_bytes == held
