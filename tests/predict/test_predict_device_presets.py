"""The cards people own (issue 26, item 4): every preset complete, the names
torch.cuda.get_device_name() prints, ambiguous short names, did-you-mean only within a product
line, and no bf16 estimate on a card without bf16 hardware."""

from __future__ import annotations

import pickle

import pytest
import torch

from gradckpt.errors import UsageError
from gradckpt.predict import devices
from gradckpt.predict.devices import (
    ALIASES,
    AMBIGUOUS,
    DEVICES,
    FAMILIES,
    HOST_LINKS,
    DeviceSpec,
    device_spec,
    family_of,
    format_device,
    host_link_bytes_per_second,
)
from gradckpt.predict.estimate import estimate
from gradckpt.toy_models import GPTConfig, TinyGPT

# The cards the issue names, each by the preset(s) it is.
ISSUE_CARDS = {
    "RTX 3090": ["rtx3090-24gb"], "RTX 4090": ["rtx4090-24gb"], "RTX 5090": ["rtx5090-32gb"],
    "A6000": ["a6000-48gb"], "RTX 6000 Ada": ["rtx6000ada-48gb"], "A10G": ["a10g-24gb"],
    "L4": ["l4-24gb"], "L40S": ["l40s-48gb"], "T4": ["t4-16gb"],
    "V100": ["v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb"],
    "A100 40/80": ["a100-40gb", "a100-80gb"], "H100 PCIe/SXM": ["h100-pcie-80gb", "h100-80gb"],
    "H200": ["h200-141gb"], "B200": ["b200-180gb"],
}


def test_every_card_of_the_issue_has_a_preset() -> None:
    assert {name for names in ISSUE_CARDS.values() for name in names} == set(DEVICES)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_a_preset_has_every_figure_a_source_a_host_link_and_a_family(name: str) -> None:
    spec = DEVICES[name]
    assert spec.memory_bytes > 0 and spec.memory_bandwidth_bytes_per_second > 0
    assert spec.flops_per_second[torch.float32] > 0 and spec.flops_per_second[torch.float16] > 0
    assert spec.compute_capability is not None
    assert len(spec.source) > 100 and "cuda-gpus" in spec.source
    both_ways_gb, link_source = HOST_LINKS[name]
    assert both_ways_gb in (32, 64, 128) and f"{both_ways_gb} GB/s" in link_source
    assert host_link_bytes_per_second(name) == both_ways_gb / 2 * 1e9 * 0.8
    assert [family.name for family in FAMILIES if name in family.presets] == [
        family_of(name).name]
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_bf16_exactly_where_the_tensor_cores_have_it() -> None:
    # bf16 tensor cores came with Ampere (compute capability 8.0).
    for spec in DEVICES.values():
        has_bf16 = spec.compute_capability >= (8, 0)
        assert (torch.bfloat16 in spec.flops_per_second) == has_bf16, spec.name
        assert (spec.unsupported_dtypes == ()) == has_bf16, spec.name
        if not has_bf16:
            assert "no bf16" in spec.source


def test_host_links_name_only_presets() -> None:
    assert set(HOST_LINKS) == set(DEVICES)


# --------------------------------------------------------------------------------------------
# Names: what torch.cuda.get_device_name() prints, short names, ambiguous ones
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("printed", "expected"),
    [
        ("NVIDIA GeForce RTX 3090", "rtx3090-24gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
        ("NVIDIA GeForce RTX 5090", "rtx5090-32gb"),
        ("NVIDIA RTX A6000", "a6000-48gb"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx6000ada-48gb"),
        ("NVIDIA A10G", "a10g-24gb"),
        ("NVIDIA L4", "l4-24gb"),
        ("NVIDIA L40S", "l40s-48gb"),
        ("Tesla T4", "t4-16gb"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"),
        ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
        ("NVIDIA H200", "h200-141gb"),
        ("NVIDIA B200", "b200-180gb"),
    ],
)
def test_what_torch_cuda_get_device_name_prints(printed: str, expected: str) -> None:
    assert device_spec(printed) is DEVICES[expected]


@pytest.mark.parametrize(
    ("short", "expected"),
    [
        ("3090", "rtx3090-24gb"), ("4090", "rtx4090-24gb"), ("5090", "rtx5090-32gb"),
        ("A6000", "a6000-48gb"), ("rtx a6000", "a6000-48gb"), ("6000 Ada", "rtx6000ada-48gb"),
        ("a10g", "a10g-24gb"), ("L40S", "l40s-48gb"), ("T4", "t4-16gb"), ("B200", "b200-180gb"),
        # documented defaults: a bare name means the SXM board, the A100 its 80GB part
        ("h100", "h100-80gb"), ("H200", "h200-141gb"), ("a100", "a100-80gb"),
    ],
)
def test_short_names(short: str, expected: str) -> None:
    assert device_spec(short) is DEVICES[expected]


def test_aliases_stay_in_their_cards_family() -> None:
    for alias, name in ALIASES.items():
        assert family_of(alias) is family_of(name), (alias, name)


@pytest.mark.parametrize("given", ["V100", "Tesla V100", "v100 sxm2", "V100-PCIE"])
def test_an_ambiguous_name_lists_the_choices(given: str) -> None:
    with pytest.raises(UsageError, match=f"device {given!r} could be any of") as raised:
        device_spec(given)
    choices = AMBIGUOUS[devices._normalize(given)]
    assert all(f"{name!r} ({DEVICES[name].description})" in str(raised.value) for name in choices)
    assert str(raised.value).endswith("; name one")


def test_ambiguous_names_are_neither_presets_nor_aliases() -> None:
    for short, choices in AMBIGUOUS.items():
        assert short not in DEVICES and short not in ALIASES
        assert devices._normalize(short) == short
        assert len(choices) > 1 and all(name in DEVICES for name in choices)


# --------------------------------------------------------------------------------------------
# Did you mean: only within the product line
# --------------------------------------------------------------------------------------------


def _hint(given: str) -> str:
    with pytest.raises(UsageError) as raised:
        device_spec(given)
    return str(raised.value).split(" known devices: ")[0]


def _suggested(given: str) -> set[str]:
    hint = _hint(given)
    return {name for name in DEVICES if repr(name) in hint}


@pytest.mark.parametrize(
    ("given", "family"),
    [
        ("a6000ada", "rtx-workstation"),
        ("A5000", "rtx-workstation"),
        ("rtx 6000", "rtx-workstation"),
        ("h300", "hopper"),
        ("NVIDIA H100 NVL", "hopper"),
        ("NVIDIA A100-PCIE-40GB", "ampere-datacenter"),
        ("NVIDIA A10", "ampere-datacenter"),
        ("Tesla V100S-PCIE-32GB", "tesla"),
        ("NVIDIA L40", "ada-datacenter"),
        ("RTX 4080", "geforce"),
        ("rtx4900", "geforce"),
        ("b200-192gb", "blackwell"),
    ],
)
def test_a_typo_within_a_family_suggests_only_that_family(given: str, family: str) -> None:
    (line,) = [line for line in FAMILIES if line.name == family]
    suggested = _suggested(given)
    assert suggested and suggested <= set(line.presets), (given, suggested)


def test_a6000_is_never_an_a100() -> None:
    assert device_spec("A6000").name == "a6000-48gb"
    for given in ("a6000ada", "a6000-24gb", "RTX A6000 Ada", "a60000", "A6000 48G"):
        assert not {"a100-80gb", "a100-40gb"} & _suggested(given), given


def test_h300_suggests_the_hopper_cards() -> None:
    assert _hint("h300") == "unknown device 'h300'; did you mean 'h200-141gb' or 'h100-80gb'?"


def test_a_family_with_nothing_close_lists_its_presets() -> None:
    assert _hint("A30") == (
        "unknown device 'A30'; no preset is close to it in the NVIDIA A100 / A10G line, whose "
        "presets are 'a100-80gb', 'a100-40gb' or 'a10g-24gb';"
    )


@pytest.mark.parametrize("given", ["tpu-v5e", "mi300x", "gaudi2", "m2-max", "xyzzy"])
def test_a_name_of_no_family_lists_all_names_and_suggests_none(given: str) -> None:
    assert family_of(devices._normalize(given)) is None
    with pytest.raises(UsageError) as raised:
        device_spec(given)
    message = str(raised.value)
    assert message.startswith(f"unknown device {given!r}; known devices: ")
    assert "did you mean" not in message
    assert all(name in message for name in DEVICES)


def test_this_is_still_suggested_for_a_typo() -> None:
    assert _hint("thsi") == "unknown device 'thsi'; did you mean 'this'?"


# --------------------------------------------------------------------------------------------
# No bf16 on Volta and Turing
# --------------------------------------------------------------------------------------------


def test_format_device_shows_fp16_where_there_is_no_bf16() -> None:
    assert format_device(DEVICES["v100-16gb"]) == (
        "v100-16gb (NVIDIA Tesla V100 SXM2 16GB: 16.00 GiB, 125 TFLOP/s fp16 (no bf16), "
        "15.7 TFLOP/s fp32, 0.9 TB/s)"
    )


def test_check_dtypes() -> None:
    t4 = DEVICES["t4-16gb"]
    t4.check_dtypes([torch.float16, torch.float32, torch.int64, None])
    DEVICES["a10g-24gb"].check_dtypes([torch.bfloat16])
    with pytest.raises(UsageError, match=r"^t4-16gb \(NVIDIA T4 16GB\) has no bfloat16 hardware "
                                         r"\(compute capability 7\.5; .*--dtype fp16"):
        t4.check_dtypes([torch.float32, torch.bfloat16])


def test_unsupported_dtypes_are_validated() -> None:
    rates = {torch.float32: 1e12, torch.bfloat16: 2e12}
    with pytest.raises(UsageError, match="unsupported_dtypes must be a tuple of torch dtypes"):
        DeviceSpec("x", "x", 2**30, rates, 1e9, "test", unsupported_dtypes=(torch.bfloat16,))
    with pytest.raises(UsageError, match="unsupported_dtypes must be a tuple"):
        DeviceSpec("x", "x", 2**30, rates, 1e9, "test", unsupported_dtypes=[torch.float16])


def _tiny() -> tuple[torch.nn.Module, dict]:
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    idx = torch.randint(0, 512, (2, 16), device="meta")
    return model, {"idx": idx, "targets": idx}


@pytest.mark.parametrize("device", ["t4-16gb", "Tesla V100-SXM2-16GB", "v100-pcie-32gb"])
@pytest.mark.parametrize("how", ["dtype", "autocast", "model"])
def test_a_bf16_estimate_on_a_card_without_bf16_is_refused(device: str, how: str) -> None:
    model, sample = _tiny()
    kwargs = {}
    if how == "model":
        model.to(torch.bfloat16)
    else:
        kwargs[how] = torch.bfloat16
    with pytest.raises(UsageError, match="has no bfloat16 hardware .* Estimate it in float16"):
        estimate(model, sample, device=device, **kwargs)


def test_an_fp16_estimate_on_a_t4_runs_at_its_fp16_rate() -> None:
    model, sample = _tiny()
    predicted = estimate(model, sample, device="Tesla T4", dtype=torch.float16)
    assert predicted.notes["estimated_for"] == "t4-16gb"
    on_fp32 = estimate(model, sample, device="Tesla T4")
    assert 0 < predicted.step_seconds < on_fp32.step_seconds
