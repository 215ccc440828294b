"""Target devices for ``estimate`` (gradckpt.predict.devices): presets, names, numbers, "this"."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import warnings

import pytest
import torch

from gradckpt.errors import GradckptWarning, UsageError, forget_warnings
from gradckpt.predict import devices
from gradckpt.predict.devices import (
    ALIASES,
    DEVICES,
    DeviceSpec,
    device_spec,
    format_device,
    this_machine,
)

GIB = 2**30

# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_preset_is_sane(name: str) -> None:
    spec = DEVICES[name]
    assert spec.name == name == name.lower()
    assert spec.kind == "cuda"
    assert spec.memory_bytes > 0 and spec.memory_bytes % GIB == 0  # vendor GB are binary
    assert spec.memory_bandwidth_bytes_per_second > 0
    rates = dict(spec.flops_per_second)
    int8 = rates.pop(torch.int8, None)  # INT8 tensor cores from Turing on: not the V100
    assert (int8 is None) == (spec.compute_capability < (7, 5))
    if spec.unsupported_dtypes:  # Volta, Turing: fp16 tensor cores only, bf16 refused
        assert spec.unsupported_dtypes == (torch.bfloat16,)
        assert set(rates) == {torch.float32, torch.float16}
    else:
        assert set(rates) == {torch.float32, torch.bfloat16, torch.float16}
        assert rates[torch.float16] == rates[torch.bfloat16]
    assert all(rate > 0 for rate in rates.values())
    assert rates[torch.float16] >= rates[torch.float32]
    if int8 is not None:  # twice the FP16 (FP32-accumulate) rate; on GeForce four times
        ratio = 4 if "GeForce" in spec.description else 2
        assert int8 / rates[torch.float16] == pytest.approx(ratio, rel=0.02)
    assert "datasheet" in spec.source or "whitepaper" in spec.source


# The datasheet figures each preset cites (dense: half the "with sparsity" tensor figure), typed
# again here so that a typo in either place is caught: memory GiB, bf16 and fp32 TFLOP/s, GB/s.
DATASHEET = {
    "h100-80gb": (80, 1979 / 2, 67, 3350),
    "h100-pcie-80gb": (80, 1513 / 2, 51, 2000),
    "h200-141gb": (141, 1979 / 2, 67, 4800),
    "a100-80gb": (80, 312, 19.5, 2039),
    "a100-40gb": (40, 312, 19.5, 1555),
    "l4-24gb": (24, 242 / 2, 30.3, 300),
    "rtx4090-24gb": (24, 165.2, 82.6, 1008),
    "b200-180gb": (180, 4500 / 2, 80, 8000),
    "a10g-24gb": (24, 62.5, 31.2, 600),
    "l40s-48gb": (48, 362.05, 91.6, 864),
    "t4-16gb": (16, 65, 8.1, 320),  # fp16: no bf16
    "v100-16gb": (16, 125, 15.7, 900),
    "v100-32gb": (32, 125, 15.7, 900),
    "v100-pcie-16gb": (16, 112, 14, 900),
    "v100-pcie-32gb": (32, 112, 14, 900),
    "rtx3090-24gb": (24, 71, 35.6, 936),
    "rtx5090-32gb": (32, 209.5, 104.8, 1792),
    "a6000-48gb": (48, 154.8, 38.7, 768),
    "rtx6000ada-48gb": (48, 364.2, 91.1, 960),
}


# The dense INT8 tensor-core TOPS each preset cites (half the "with sparsity" figure where the
# vendor prints that), typed again; None: no INT8 tensor cores (Volta), timed at fp32's figure.
INT8_DATASHEET = {
    "h100-80gb": 3958 / 2,
    "h100-pcie-80gb": 3026 / 2,
    "h200-141gb": 3958 / 2,
    "a100-80gb": 624,
    "a100-40gb": 624,
    "l4-24gb": 485 / 2,
    "rtx4090-24gb": 660.6,
    "b200-180gb": 9000 / 2,
    "a10g-24gb": 125,
    "l40s-48gb": 733,
    "t4-16gb": 130,
    "v100-16gb": None,
    "v100-32gb": None,
    "v100-pcie-16gb": None,
    "v100-pcie-32gb": None,
    "rtx3090-24gb": 284,
    "rtx5090-32gb": 838,
    "a6000-48gb": 309.7,
    "rtx6000ada-48gb": 1457 / 2,
}


def test_every_preset_is_checked_against_its_datasheet() -> None:
    assert set(DATASHEET) == set(DEVICES) == set(INT8_DATASHEET)


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_preset_figures_match_the_datasheet(name: str) -> None:
    memory_gib, tensor_tflops, fp32_tflops, bandwidth_gb = DATASHEET[name]
    spec = DEVICES[name]
    assert spec.memory_bytes == memory_gib * GIB
    assert spec.flops_per_second[torch.float16] == pytest.approx(tensor_tflops * 1e12)
    assert spec.flops_per_second[torch.float32] == pytest.approx(fp32_tflops * 1e12)
    assert spec.memory_bandwidth_bytes_per_second == pytest.approx(bandwidth_gb * 1e9)


@pytest.mark.parametrize("name", sorted(INT8_DATASHEET))
def test_preset_int8_figure_matches_the_datasheet(name: str) -> None:
    spec, tops = DEVICES[name], INT8_DATASHEET[name]
    if tops is None:
        assert torch.int8 not in spec.flops_per_second and "no INT8 figure" in spec.source
        # an int8 matmul timed at the FP32 figure, as any dtype without a figure of its own
        assert spec.seconds(1e12, 0, torch.int8) == spec.seconds(1e12, 0, torch.float32)
    else:
        assert spec.flops_per_second[torch.int8] == pytest.approx(tops * 1e12)
        assert "INT8" in spec.source
        assert spec.seconds(tops * 1e12, 0, torch.int8) == pytest.approx(1.0)


# NVIDIA's CUDA GPUs page (developer.nvidia.com/cuda-gpus), which each preset's source cites.
COMPUTE_CAPABILITY = {
    "h100-80gb": (9, 0),
    "h100-pcie-80gb": (9, 0),
    "h200-141gb": (9, 0),
    "a100-80gb": (8, 0),
    "a100-40gb": (8, 0),
    "l4-24gb": (8, 9),
    "rtx4090-24gb": (8, 9),
    "b200-180gb": (10, 0),
    "a10g-24gb": (8, 6),
    "l40s-48gb": (8, 9),
    "t4-16gb": (7, 5),
    "v100-16gb": (7, 0),
    "v100-32gb": (7, 0),
    "v100-pcie-16gb": (7, 0),
    "v100-pcie-32gb": (7, 0),
    "rtx3090-24gb": (8, 6),
    "rtx5090-32gb": (12, 0),
    "a6000-48gb": (8, 6),
    "rtx6000ada-48gb": (8, 9),
}


@pytest.mark.parametrize("name", sorted(COMPUTE_CAPABILITY))
def test_preset_compute_capability_matches_nvidias_list(name: str) -> None:
    assert set(COMPUTE_CAPABILITY) == set(DEVICES)
    assert DEVICES[name].compute_capability == COMPUTE_CAPABILITY[name]


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_preset_source_says_what_was_checked(name: str) -> None:
    # docs/devices.md: a figure is "checked" against a copy of the vendor's table, or marked
    # "unverified"; the source names which, and where the compute capability comes from.
    source = DEVICES[name].source
    assert "checked" in source or "unverified" in source
    assert "cuda-gpus" in source


def test_presets_cannot_be_edited_by_accident() -> None:
    with pytest.raises(TypeError):
        DEVICES["h100-80gb"].flops_per_second[torch.float32] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        DEVICES["h100-80gb"].memory_bytes = 1  # type: ignore[misc]


def test_specs_pickle_copy_and_hash() -> None:
    spec = DEVICES["a100-40gb"]
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec
    assert {spec: 1}[DEVICES["a100-40gb"]] == 1


def test_format_device() -> None:
    assert format_device(DEVICES["h100-80gb"]) == (
        "h100-80gb (NVIDIA H100 SXM5 80GB: 80.00 GiB, 989.5 TFLOP/s bf16, 67 TFLOP/s fp32, "
        "3.35 TB/s)"
    )


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("h100-80gb", "h100-80gb"),
        ("H100-80GB", "h100-80gb"),
        ("  h100 80gb ", "h100-80gb"),
        ("H100", "h100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),  # torch.cuda.get_device_name()
        ("h100_pcie", "h100-pcie-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
        ("h200", "h200-141gb"),
        ("a100", "a100-80gb"),
        ("A100_40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("L4", "l4-24gb"),
        ("4090", "rtx4090-24gb"),
        ("RTX 4090", "rtx4090-24gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
    ],
)
def test_names_aliases_and_case(given: str, expected: str) -> None:
    assert device_spec(given) is DEVICES[expected]


def test_aliases_are_normalized_and_point_at_presets() -> None:
    for alias, target in ALIASES.items():
        assert devices._normalize(alias) == alias
        assert target in DEVICES
        assert alias not in DEVICES


def test_unknown_name_lists_the_known_ones_and_suggests_the_closest() -> None:
    with pytest.raises(UsageError) as raised:
        device_spec("h10")
    message = str(raised.value)
    assert "unknown device 'h10'" in message
    assert "did you mean 'h100-80gb'?" in message
    assert all(name in message for name in DEVICES)
    assert "'this'" in message


def test_unknown_name_without_a_close_match() -> None:
    with pytest.raises(UsageError, match="unknown device 'tpu-v5e'; known devices: a100-40gb"):
        device_spec("tpu-v5e")


def test_a_spec_passes_through_and_other_types_are_refused() -> None:
    spec = DEVICES["l4-24gb"]
    assert device_spec(spec) is spec
    with pytest.raises(UsageError, match="got int: 4090"):
        device_spec(4090)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# User-given numbers
# --------------------------------------------------------------------------------------------

VALID = {"memory": "24GiB", "bf16_tflops": 100, "fp32_tflops": 50, "bandwidth_gbps": 1000}


def test_user_numbers() -> None:
    spec = device_spec(VALID)
    assert spec.name == "custom"
    assert spec.kind == "cuda"
    assert spec.memory_bytes == 24 * GIB
    assert spec.flops_per_second == {
        torch.bfloat16: 100e12,
        torch.float16: 100e12,
        torch.float32: 50e12,
    }
    assert spec.memory_bandwidth_bytes_per_second == 1000e9
    assert spec.source == "given by the user"


def test_user_numbers_optional_keys() -> None:
    spec = device_spec(
        {
            **VALID,
            "memory": 48_000_000_000,
            "fp16_tflops": 200.5,
            "int8_tops": 309.7,
            "name": "My-A6000",
            "description": "RTX A6000",
            "kind": "cuda",
        }
    )
    assert (spec.name, spec.description, spec.memory_bytes) == ("my-a6000", "RTX A6000", 48e9)
    assert spec.flops_per_second[torch.float16] == 200.5e12
    assert spec.flops_per_second[torch.int8] == pytest.approx(309.7e12)
    assert torch.int8 not in device_spec(VALID).flops_per_second  # timed at fp32's figure
    assert device_spec({**VALID, "memory": "80GB"}).memory_bytes == 80 * 10**9
    assert device_spec({**VALID, "memory": "1.5 GiB"}).memory_bytes == 3 * 2**29


@pytest.mark.parametrize("key", ["memory", "bf16_tflops", "fp32_tflops", "bandwidth_gbps"])
def test_user_numbers_missing_key(key: str) -> None:
    numbers = {k: v for k, v in VALID.items() if k != key}
    with pytest.raises(UsageError, match=f"missing key '{key}'"):
        device_spec(numbers)


@pytest.mark.parametrize(
    "key", ["bf16_tflops", "fp32_tflops", "bandwidth_gbps", "fp16_tflops", "int8_tops"])
@pytest.mark.parametrize("value", [0, -1, -0.5, math.nan, math.inf, True, "100", None])
def test_user_numbers_bad_number(key: str, value: object) -> None:
    with pytest.raises(UsageError, match=f"'{key}' must be a positive number"):
        device_spec({**VALID, key: value})


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "auto", "60%", "24G", "lots", None])
def test_user_numbers_bad_memory(value: object) -> None:
    with pytest.raises(UsageError, match="'memory' must be bytes"):
        device_spec({**VALID, "memory": value})


def test_user_numbers_unknown_key_and_bad_text() -> None:
    with pytest.raises(UsageError, match="unknown key 'bandwidth'; accepted keys: memory"):
        device_spec({**VALID, "bandwidth": 1000})
    with pytest.raises(UsageError, match="'kind' must be 'cuda' or 'cpu'"):
        device_spec({**VALID, "kind": "tpu"})
    with pytest.raises(UsageError, match="'name' must be a non-empty str"):
        device_spec({**VALID, "name": ""})


def test_spec_validation() -> None:
    with pytest.raises(UsageError, match="includes torch.float32"):
        DeviceSpec("x", "x", GIB, {torch.bfloat16: 1e12}, 1e9, "test")
    with pytest.raises(UsageError, match="memory_bytes must be a positive int"):
        DeviceSpec("x", "x", 0, {torch.float32: 1e12}, 1e9, "test")
    with pytest.raises(UsageError, match=r"flops_per_second\[torch.float32\]"):
        DeviceSpec("x", "x", GIB, {torch.float32: -1.0}, 1e9, "test")
    with pytest.raises(UsageError, match="kind must be"):
        DeviceSpec("x", "x", GIB, {torch.float32: 1e12}, 1e9, "test", kind="tpu")


# --------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------


def test_seconds_is_the_roofline() -> None:
    spec = device_spec(VALID)  # 100 TFLOP/s bf16, 50 fp32, 1000 GB/s
    assert spec.seconds(100e12, 1e9, torch.bfloat16) == pytest.approx(1.0)  # compute-bound
    assert spec.seconds(1e12, 3000e9, torch.bfloat16) == pytest.approx(3.0)  # bandwidth-bound
    assert spec.seconds(100e12, 1e9, torch.float32) == pytest.approx(2.0)
    assert spec.seconds(0, 0, torch.float16) == 0.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64, torch.float8_e4m3fn])
def test_seconds_falls_back_to_float32(dtype: torch.dtype) -> None:
    spec = device_spec(VALID)
    assert spec.seconds(100e12, 0, dtype) == spec.seconds(100e12, 0, torch.float32)


# --------------------------------------------------------------------------------------------
# "this": measured once, cached
# --------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_cache(tmp_path, monkeypatch):
    """'this' means the CPU, cached under tmp_path."""
    monkeypatch.setenv("GRADCKPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return tmp_path / "this-device.json"


def _fake_measure(calls: list[int], fp32: float = 1e11):
    def measure(device):
        calls.append(1)
        return {
            "flops_per_second": {"float32": fp32, "bfloat16": 2 * fp32},
            "memory_bandwidth_bytes_per_second": 2e10,
            "measured_at": "2025-01-01T00:00:00+00:00",
            "method": "fake",
        }

    return measure


def _refuse(device):
    raise AssertionError("measured again instead of reading the cache")


def test_this_measures_plausible_numbers_and_caches_them(cpu_cache, monkeypatch) -> None:
    rng_state = torch.random.get_rng_state()
    spec = device_spec("this")
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # the user's RNG untouched

    assert (spec.name, spec.kind) == ("this", "cpu")
    assert spec.description.startswith("this machine's CPU: ")
    assert 0 < spec.memory_bytes <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rates = spec.flops_per_second
    assert set(rates) == {torch.float32, torch.bfloat16, torch.float16}
    assert 1e9 < rates[torch.float32] < 10e12
    assert all(0 < rate < 100e12 for rate in rates.values())
    assert 0.5e9 < spec.memory_bandwidth_bytes_per_second < 1e12
    assert str(cpu_cache) in spec.source

    cached = json.loads(cpu_cache.read_text())
    assert len(cached["entries"]) == 1
    monkeypatch.setattr(this_machine, "_measure", _refuse)
    assert device_spec("this") == spec
    assert device_spec(None) == spec


def test_refresh_measures_again(cpu_cache, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(this_machine, "_measure", _fake_measure(calls))
    first = device_spec("this")
    assert device_spec("This") == first
    assert len(calls) == 1
    monkeypatch.setattr(this_machine, "_measure", _fake_measure(calls, fp32=3e11))
    refreshed = device_spec("this", refresh=True)
    assert len(calls) == 2
    assert refreshed.flops_per_second[torch.float32] == 3e11
    monkeypatch.setattr(this_machine, "_measure", _refuse)
    assert device_spec("this") == refreshed  # the refreshed numbers replaced the old ones
    assert refreshed.flops_per_second.get(torch.float16) is None  # not measured: fp32 fallback


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"entries": 3}',
        "",
    ],
)
def test_a_corrupt_cache_is_measured_over(cpu_cache, monkeypatch, content: str) -> None:
    cpu_cache.write_text(content)
    calls: list[int] = []
    monkeypatch.setattr(this_machine, "_measure", _fake_measure(calls))
    spec = device_spec("this")
    assert len(calls) == 1 and spec.flops_per_second[torch.float32] == 1e11
    assert len(json.loads(cpu_cache.read_text())["entries"]) == 1


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: entry["flops_per_second"].update(float32=-1.0),
        lambda entry: entry["flops_per_second"].pop("float32"),
        lambda entry: entry["flops_per_second"].update(not_a_dtype=1.0),
        lambda entry: entry.update(memory_bandwidth_bytes_per_second="fast"),
        lambda entry: entry.pop("method"),
    ],
)
def test_a_damaged_entry_is_measured_over(cpu_cache, monkeypatch, damage) -> None:
    calls: list[int] = []
    monkeypatch.setattr(this_machine, "_measure", _fake_measure(calls))
    device_spec("this")
    content = json.loads(cpu_cache.read_text())
    (entry,) = content["entries"].values()
    damage(entry)
    cpu_cache.write_text(json.dumps(content))
    spec = device_spec("this")
    assert len(calls) == 2 and spec.flops_per_second[torch.float32] == 1e11


def test_another_thread_count_is_another_device(cpu_cache, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(this_machine, "_measure", _fake_measure(calls))
    device_spec("this")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    spec = device_spec("this")
    assert len(calls) == 2 and "97 threads" in spec.description
    assert len(json.loads(cpu_cache.read_text())["entries"]) == 2  # both kept


def test_cache_directory_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("GRADCKPT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert this_machine._cache_path() == tmp_path / "xdg" / "gradckpt" / "this-device.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "gradckpt" / "this-device.json"
    assert this_machine._cache_path() == expected


def test_an_unwritable_cache_warns_and_still_answers(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GRADCKPT_CACHE_DIR", str(blocker / "cache"))  # a dir under a file
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls: list[int] = []
    monkeypatch.setattr(this_machine, "_measure", _fake_measure(calls))
    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = device_spec("this")
    assert spec.flops_per_second[torch.float32] == 1e11
    assert [w.category for w in caught] == [GradckptWarning]
    assert "GRADCKPT_CACHE_DIR" in str(caught[0].message)
    forget_warnings()


@pytest.mark.cuda
def test_this_gpu_is_measured(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GRADCKPT_CACHE_DIR", str(tmp_path))
    spec = device_spec("this", refresh=True)
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert spec.kind == "cuda" and properties.name in spec.description
    assert spec.memory_bytes == properties.total_memory
    assert 1e12 < spec.flops_per_second[torch.float32] < 200e12
    assert spec.flops_per_second[torch.bfloat16] > spec.flops_per_second[torch.float32]
    assert 100e9 < spec.memory_bandwidth_bytes_per_second < 20e12
