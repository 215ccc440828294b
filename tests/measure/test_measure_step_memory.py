"""What the plain step's memory shows about the chain's backward (``measure/step_memory.py``,
read by ``profile``), on two architectures built tiny from their configs as
``bench/architectures.py`` builds them, predicted against the loop's second step with AdamW
(``compare_plans``), the gradients the plain model's bit for bit:

- RegNet (image classification): its stem's ReLU saves its output, the chain's input, which
  the first block saves too. Read with the head's leftovers when the chain's backward ends, it
  counted twice through the whole backward; and a block's measured backward held its incoming
  gradient to the end, where the step frees it after the block's first node (the first
  block's peak is at its input's gradient). Both over-counted: +14% on the plain step.
- MPNet (masked LM): the relative position bias is computed before the chain from bucket
  indices its embedding saves (2 x 128 x 128 int64). Their backward runs as the last block's
  ends, before the chain input's gradient arrives, so the head's leftovers read then missed
  them, though they were alive through every block's backward: with every layer
  checkpointed, 2.2% under the measured peak.
- The CNN family (``hf_families.cnn``: Conv2d, BatchNorm, ReLU stages, pooled): a block
  checkpointed alone keeping its ReLU's output (``save-ops:aten.relu``, an op-level choice)
  holds that output, the block's own, until its recomputation; the choice's kept bytes leave
  it to the next item, which has let it go by then. Once a block's measured backward stopped
  holding its incoming gradient (of the output's size, it had stood in for it), such plans
  came out one hidden state under (-13.6% at 70% of the plain peak in the families test).
"""

from __future__ import annotations

import pytest
import torch
from plan_peaks import predicted_and_measured

from gradckpt.integrations.hf_families import family
from gradckpt.plan import Segment

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 2, 128, 256
# The weight gradient of MPNet's position bias table (32 buckets x 4 heads, float32): made
# after the first block's backward, counted from its start (its bytes come after the last
# block's in the recording).
BIAS_TABLE_GRADIENT = 32 * 4 * 4


def tiny_mpnet() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MPNetForMaskedLM(config).train()
    ids = torch.randint(8, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def tiny_regnet() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.RegNetConfig(embedding_size=32, hidden_sizes=[8, 12, 32, 68],
                                       depths=[2, 2, 2, 2])
    torch.manual_seed(0)
    model = transformers.RegNetForImageClassification(config).train()
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(BATCH, 3, 128, 128, generator=generator)
    labels = torch.randint(0, config.num_labels, (BATCH,), generator=generator)
    return model, {"pixel_values": pixels, "labels": labels}


def test_regnet_chain_input_saved_before_the_chain_is_counted_once() -> None:
    model, batch = tiny_regnet()
    blocks = 8
    peaks = predicted_and_measured(model, batch, {
        "keep all": [], "every layer": [Segment(i, i) for i in range(blocks)],
        "first alone": [Segment(0, 0)], "two halves": [Segment(0, 3), Segment(4, 7)],
    })
    for label, (predicted, measured) in peaks.items():
        assert predicted == measured, f"RegNet, {label}: predicted {predicted}, measured " \
                                      f"{measured} ({predicted / measured - 1:+.2%})"


def test_mpnet_position_bias_indices_count_through_the_chains_backward() -> None:
    model, batch = tiny_mpnet()
    peaks = predicted_and_measured(model, batch, {
        "keep all": [], "every layer": [Segment(0, 0), Segment(1, 1)],
        "one segment": [Segment(0, 1)],
    })
    for label, (predicted, measured) in peaks.items():
        assert 0 <= predicted - measured <= BIAS_TABLE_GRADIENT, (
            f"MPNet, {label}: predicted {predicted}, measured {measured} "
            f"({predicted / measured - 1:+.2%})")


def test_cnn_block_keeping_its_output_holds_it_until_its_recomputation() -> None:
    """Stages 0-3 of the family's CNN (each ReLU's output saved by the next convolution, the
    last one's by nothing: the pooling saves no input), one alone under ``save-ops:aten.relu``
    where the next item retains the output and where nothing does, and with the block after
    it checkpointed too."""
    cnn = family("cnn")
    relu = "save-ops:aten.relu"
    peaks = predicted_and_measured(cnn.fresh(), cnn.sample(), {
        "keep all": [], "last keeps its ReLU": [Segment(3, 3, policy=relu)],
        "second keeps its ReLU": [Segment(1, 1, policy=relu)],
        "then the last checkpointed": [Segment(2, 2, policy=relu), Segment(3, 3)],
    }, loss_fn=cnn.loss_fn)
    for label, (predicted, measured) in peaks.items():
        assert predicted == measured, f"CNN, {label}: predicted {predicted}, measured " \
                                      f"{measured} ({predicted / measured - 1:+.2%})"
