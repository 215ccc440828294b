"""parse_budget reads every documented form of a budget and refuses the rest with clear messages,
at once and with what was meant for the usual slips ("60", 0.6); check_budget checks the form
before anything runs.

"auto" is tested against fake /proc/meminfo and cgroup files and a fake CUDA device, so that the
arithmetic is checked exactly on any machine; one test reads the real machine's memory.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradckpt
from gradckpt import budget as budget_module
from gradckpt.budget import (
    available_bytes,
    check_budget,
    format_bytes,
    parse_budget,
    rounded_up_budget,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (1, 1),
        (6 * GIB, 6 * GIB),
        (6e9, 6_000_000_000),  # a float that is a whole number of bytes
        ("6GiB", 6 * GIB),
        ("6gib", 6 * GIB),
        ("6 GIB", 6 * GIB),
        ("  6GiB  ", 6 * GIB),
        ("512MiB", 512 * MIB),
        ("1.5 GiB", 3 * GIB // 2),
        ("1.1GiB", 1181116006),  # exact: int(1.1 * 2**30), no float rounding
        (".5 MiB", MIB // 2),
        ("64KiB", 64 * KIB),
        ("2TiB", 2 * TIB),
        ("1PiB", 2**50),
        ("6GB", 6 * 10**9),
        ("6gb", 6 * 10**9),
        ("500MB", 500 * 10**6),
        ("64kB", 64_000),
        ("3TB", 3 * 10**12),
        ("1PB", 10**15),
        ("1024B", 1024),
        ("1024 b", 1024),
        ("1.9B", 1),  # fractions of a byte are dropped
        ("1e3B", 1000),
        (1.0, 1),  # a float that is a whole number, 1 or more: bytes, like an int
        ("2e3 MiB", 2000 * MIB),
        ("+5GiB", 5 * GIB),
    ],
)
def test_sizes(budget: int | str, expected: int) -> None:
    result = parse_budget(budget)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("budget", "peak", "expected"),
    [
        ("60%", 1000, 600),
        ("100%", 1000, 1000),
        ("0.5%", 10_000, 50),
        ("33.3%", 1000, 333),
        ("60 %", 1000, 600),
        (" 50% ", 3, 1),  # rounded down: the budget must not promise more than the share
        ("60%", 6 * GIB, int(0.6 * 6 * GIB)),
    ],
)
def test_percentages_of_the_unconstrained_peak(budget: str, peak: int, expected: int) -> None:
    assert parse_budget(budget, unconstrained_peak_bytes=peak) == expected


def test_unconstrained_peak_is_ignored_by_other_forms() -> None:
    assert parse_budget("1KiB", unconstrained_peak_bytes=10) == 1024


def test_percentage_without_a_profile_says_what_it_needs() -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget("60%")
    message = str(error.value)
    assert "budget '60%' is a share of the step's peak memory without checkpointing" in message
    assert "profile" in message and "unconstrained_peak_bytes=profile.peak_bytes" in message
    assert "'6GiB'" in message


@pytest.mark.parametrize("budget", ["0%", "-5%", "100.5%", "150%", "0.0%"])
def test_percentage_outside_0_to_100_is_refused(budget: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget, unconstrained_peak_bytes=1000)
    assert f"budget {budget!r}: a percentage must be above 0% and at most 100%" in str(error.value)


@pytest.mark.parametrize("peak", [0, -1, 1.5, "1GiB", True])
def test_percentage_with_a_bad_peak_is_refused(peak: object) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget("50%", unconstrained_peak_bytes=peak)
    assert "unconstrained_peak_bytes must be a positive int" in str(error.value)
    assert repr(peak) in str(error.value)


def test_percentage_that_rounds_to_zero_bytes_is_refused() -> None:
    with pytest.raises(gradckpt.UsageError, match="budget '1%' is 0 bytes"):
        parse_budget("1%", unconstrained_peak_bytes=50)


@pytest.mark.parametrize(
    "budget",
    [
        "6 gigs",
        "",
        "   ",
        "GiB",
        "six GiB",
        "6 GiB 2",
        "6.5.1GiB",
        "inf",
        "nan",
        "1e",
        "60%%",
        "6iB",
    ],
)
def test_strings_not_understood_list_the_accepted_forms(budget: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget)
    assert str(error.value) == (
        f"budget {budget!r} not understood; use bytes (int), '6GiB', '512MiB', '6GB', '500MB', "
        "'60%' or 'auto'"
    )


@pytest.mark.parametrize(
    ("budget", "suggestions"),
    [
        ("6G", "write '6GiB' for 6 * 2**30 bytes or '6GB' for 6 * 10**9 bytes"),
        ("6g", "write '6GiB' for 6 * 2**30 bytes or '6GB' for 6 * 10**9 bytes"),
        ("1.5 M", "write '1.5MiB' for 1.5 * 2**20 bytes or '1.5MB' for 1.5 * 10**6 bytes"),
        ("64k", "write '64KiB' for 64 * 2**10 bytes or '64KB' for 64 * 10**3 bytes"),
        ("2T", "write '2TiB' for 2 * 2**40 bytes or '2TB' for 2 * 10**12 bytes"),
        ("1p", "write '1PiB' for 1 * 2**50 bytes or '1PB' for 1 * 10**15 bytes"),
    ],
)
def test_unit_without_b_is_ambiguous(budget: str, suggestions: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget)
    assert str(error.value) == f"budget {budget!r} is ambiguous: {suggestions}"


@pytest.mark.parametrize("budget", [0, "0", "0GiB", "0.0", 0.0])
def test_zero_budgets_are_refused(budget: int | str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget)
    assert f"budget {budget!r} is 0 bytes; a budget must be more than 0 bytes" in str(error.value)


@pytest.mark.parametrize("budget", [-1, -1.0, "-1", "-5GiB", "-0.5 MiB", "-6GB"])
def test_negative_budgets_are_refused_as_negative(budget: int | str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget)
    assert str(error.value).startswith(
        f"budget {budget!r} is negative; a budget is the step's peak memory, a positive size "
    )


@pytest.mark.parametrize("budget", [True, False])
def test_bools_are_refused(budget: bool) -> None:
    with pytest.raises(gradckpt.UsageError, match=f"budget {budget} is a bool, not a memory size"):
        parse_budget(budget)


@pytest.mark.parametrize("budget", [1.5, float("inf"), float("nan")])
def test_floats_that_are_not_whole_bytes_are_refused(budget: float) -> None:
    with pytest.raises(gradckpt.UsageError, match="is not a whole number of bytes"):
        parse_budget(budget)


@pytest.mark.parametrize(
    ("budget", "type_name"), [(None, "NoneType"), ([6], "list"), (b"6GiB", "bytes")]
)
def test_other_types_are_refused(budget: object, type_name: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget)
    assert f"budget must be an int or a str, got {type_name}" in str(error.value)
    assert "'6GiB'" in str(error.value) and "'auto'" in str(error.value)


@pytest.mark.parametrize(
    ("budget", "meant"),
    [
        ("60", "did you mean '60%' or '60GiB'? (for 60 bytes write '60B' or pass the int 60)"),
        (" 24 ", "did you mean '24%' or '24GiB'? (for 24 bytes write '24B' or pass the int 24)"),
        ("1", "did you mean '1%' or '1GiB'? (for 1 byte write '1B' or pass the int 1)"),
        ("1.5", "did you mean '1.5%' or '1.5GiB'?"),
        ("100", "'100%' or '100GiB'? (for 100 bytes write '100B' or pass the int 100)"),
        ("8000", "did you mean '8000MiB'? (for 8000 bytes write '8000B' or pass the int 8000)"),
        ("1e3", "did you mean '1e3MiB'? (for 1000 bytes write '1e3B' or pass the int 1000)"),
        ("6000000000", "write '6000000000B' (5.59 GiB) or pass the int 6000000000"),
        ("+60", "did you mean '+60%' or '+60GiB'? (for 60 bytes write '+60B' or pass the int 60)"),
    ],
)
def test_a_bare_number_in_a_string_is_refused_with_what_was_meant(budget: str,
                                                                 meant: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget, unconstrained_peak_bytes=GIB)
    assert str(error.value).startswith(f"budget {budget!r}: a bare number is bytes; "), error
    assert str(error.value).endswith(meant)


@pytest.mark.parametrize(
    ("budget", "percent"),
    [(0.6, "60%"), (0.05, "5%"), (0.333, "33.3%"), ("0.6", "60%"), (".75", "75%"),
     (0.999, "99.9%")],
)
def test_a_fraction_below_one_is_refused_as_the_share_it_surely_is(budget: float | str,
                                                                   percent: str) -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget(budget)
    written = budget.strip() if isinstance(budget, str) else repr(budget)
    assert str(error.value) == (f"budget {budget!r}: a bare number is bytes, and {written} is "
                                f"less than one; did you mean '{percent}'?")


def test_a_bare_number_is_refused_before_the_device_is_read(monkeypatch) -> None:
    def no_device(device=None):
        raise AssertionError("read the device for a budget that is refused anyway")

    monkeypatch.setattr(budget_module, "available_bytes", no_device)
    with pytest.raises(gradckpt.UsageError, match="a bare number is bytes"):
        parse_budget("60", device="cpu")


def test_usage_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        parse_budget("lots")


# --------------------------------------------------------------------------------------------
# "auto"
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc/meminfo")
def test_auto_on_this_machine_is_positive_and_below_total_memory() -> None:
    with open("/proc/meminfo") as file:
        total_kib = int(next(line for line in file if line.startswith("MemTotal")).split()[1])
    budget = parse_budget("auto", device="cpu")
    assert 0 < budget <= total_kib * 1024
    assert parse_budget(" AUTO ", device=torch.device("cpu")) > 0


@pytest.fixture
def fake_linux(tmp_path, monkeypatch):
    """Point /proc/meminfo and /sys/fs/cgroup at files under tmp_path; returns a writer."""
    cgroup = tmp_path / "cgroup"
    (cgroup / "memory").mkdir(parents=True)
    monkeypatch.setattr(budget_module, "_PROC_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(budget_module, "_CGROUP_ROOT", str(cgroup))

    def write(relative_path: str, text: str) -> None:
        path = tmp_path / relative_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    return write


MEMINFO = "MemTotal:       24683568 kB\nMemFree:        1000000 kB\nMemAvailable:   2000000 kB\n"


def test_auto_on_cpu_is_90_percent_of_memavailable(fake_linux) -> None:
    fake_linux("meminfo", MEMINFO)
    assert parse_budget("auto", device="cpu") == int(0.9 * 2_000_000 * 1024)


def test_auto_on_cpu_is_capped_by_a_cgroup_v2_limit(fake_linux) -> None:
    fake_linux("meminfo", MEMINFO)
    fake_linux("cgroup/memory.max", f"{1 * GIB}\n")
    fake_linux("cgroup/memory.current", f"{600 * MIB}\n")
    fake_linux("cgroup/memory.stat", f"anon 1234\ninactive_file {100 * MIB}\nactive_file 7\n")
    # room = limit - usage + reclaimable page cache
    assert available_bytes("cpu") == int(0.9 * (1 * GIB - 600 * MIB + 100 * MIB))


def test_auto_on_cpu_ignores_a_cgroup_v2_without_limit(fake_linux) -> None:
    fake_linux("meminfo", MEMINFO)
    fake_linux("cgroup/memory.max", "max\n")
    fake_linux("cgroup/memory.current", f"{600 * MIB}\n")
    assert available_bytes("cpu") == int(0.9 * 2_000_000 * 1024)


def test_auto_on_cpu_is_capped_by_a_cgroup_v1_limit(fake_linux) -> None:
    fake_linux("meminfo", MEMINFO)
    fake_linux("cgroup/memory/memory.limit_in_bytes", f"{512 * MIB}\n")
    fake_linux("cgroup/memory/memory.usage_in_bytes", f"{500 * MIB}\n")
    fake_linux("cgroup/memory/memory.stat", f"inactive_file 1\ntotal_inactive_file {8 * MIB}\n")
    assert available_bytes("cpu") == int(0.9 * 20 * MIB)


def test_auto_on_cpu_ignores_the_huge_cgroup_v1_no_limit_value(fake_linux) -> None:
    fake_linux("meminfo", MEMINFO)
    fake_linux("cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    fake_linux("cgroup/memory/memory.usage_in_bytes", f"{500 * MIB}\n")
    assert available_bytes("cpu") == int(0.9 * 2_000_000 * 1024)


def test_auto_on_cpu_never_goes_negative_over_the_cgroup_limit(fake_linux) -> None:
    fake_linux("meminfo", MEMINFO)
    fake_linux("cgroup/memory.max", f"{1 * GIB}\n")
    fake_linux("cgroup/memory.current", f"{2 * GIB}\n")
    assert available_bytes("cpu") == 0


def test_auto_on_cpu_without_proc_meminfo_uses_sysconf(fake_linux, monkeypatch) -> None:
    values = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(budget_module.os, "sysconf", lambda name: values[name])
    assert available_bytes("cpu") == int(0.9 * 1000 * 4096)


def test_auto_on_cpu_with_no_way_to_tell_is_a_usage_error(fake_linux, monkeypatch) -> None:
    def no_sysconf(name: str) -> int:
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(budget_module.os, "sysconf", no_sysconf)
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget("auto", device="cpu")
    assert "cannot tell how much memory this machine has free" in str(error.value)
    assert "give the budget in bytes" in str(error.value)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device with 10 GiB free; this process holds 2 GiB in tensors, 3 GiB cached."""
    calls: list[object] = []

    def mem_get_info(device):
        calls.append(device)
        return 10 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)
    return calls


def test_auto_on_cuda_counts_held_tensors_plus_90_percent_of_what_can_still_be_had(
    fake_cuda,
) -> None:
    # held 2 GiB + 0.9 * (free 10 GiB + cached but unused 1 GiB)
    expected = 2 * GIB + int(0.9 * 11 * GIB)
    assert parse_budget("auto", device="cuda:1") == expected
    assert fake_cuda == [torch.device("cuda:1")]


def test_auto_without_device_uses_cuda_when_there_is_one(fake_cuda) -> None:
    assert parse_budget("auto") == 2 * GIB + int(0.9 * 11 * GIB)
    assert fake_cuda == [torch.device("cuda")]


def test_auto_without_device_and_without_cuda_uses_the_cpu(fake_linux, monkeypatch) -> None:
    fake_linux("meminfo", MEMINFO)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_budget("auto") == int(0.9 * 2_000_000 * 1024)


def test_auto_on_cuda_without_cuda_is_a_usage_error(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget("auto", device="cuda")
    assert "budget 'auto' on cuda: torch sees no CUDA device" in str(error.value)


def test_auto_on_other_devices_is_a_usage_error() -> None:
    with pytest.raises(gradckpt.UsageError) as error:
        parse_budget("auto", device="meta")
    assert "budget 'auto' supports cuda and cpu devices, not 'meta'" in str(error.value)


def test_auto_for_another_device_is_the_bytes_it_has(monkeypatch) -> None:
    def no_device(device=None):
        raise AssertionError("an estimate's 'auto' read this machine's memory")

    monkeypatch.setattr(budget_module, "available_bytes", no_device)
    assert parse_budget("auto", device_bytes=22 * GIB) == 22 * GIB
    assert parse_budget(" Auto ", device="cuda", device_bytes=78 * GIB) == 78 * GIB
    assert parse_budget("6GiB", device_bytes=22 * GIB) == 6 * GIB  # only "auto" reads it


@pytest.mark.parametrize("device_bytes", [0, -1, 1.5, True, "22GiB"])
def test_auto_for_another_device_needs_a_positive_int(device_bytes: object) -> None:
    with pytest.raises(gradckpt.UsageError):
        parse_budget("auto", device_bytes=device_bytes)


# --------------------------------------------------------------------------------------------
# check_budget: the form alone, before anything runs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget", ["auto", " AUTO ", "60%", "0.5%", "100%", "6GiB", "500MB", "1024B", 2**30, 6e9]
)
def test_check_budget_accepts_every_form_without_a_profile_or_a_device(budget, monkeypatch
                                                                       ) -> None:
    def no_device(device=None):
        raise AssertionError("check_budget read a device")

    monkeypatch.setattr(budget_module, "available_bytes", no_device)
    assert check_budget(budget) is None


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("60", "a bare number is bytes; did you mean '60%' or '60GiB'?"),
        (0.6, "did you mean '60%'?"),
        ("150%", "a percentage must be above 0% and at most 100%"),
        ("6G", "is ambiguous"),
        ("6 gigs", "not understood"),
        ("-1GiB", "is negative"),
        (0, "is 0 bytes"),
        (None, "budget must be an int or a str"),
        (True, "is a bool"),
    ],
)
def test_check_budget_refuses_what_parse_budget_would(budget, message) -> None:
    with pytest.raises(gradckpt.UsageError, match=re.escape(message)):
        check_budget(budget)


@pytest.mark.parametrize("budget", ["60", 0.6, "6G", "150%"])
def test_enable_refuses_a_malformed_budget_before_running_the_model(budget) -> None:
    from gradckpt.toy_models import mlp_chain

    model = mlp_chain(4, 8)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    started = time.perf_counter()
    with pytest.raises(gradckpt.UsageError):
        gradckpt.enable(model, torch.randn(16, 8), budget=budget, optimizer="none")
    assert time.perf_counter() - started < 0.5
    assert calls == [] and gradckpt.get_plan(model) is None  # never run, nothing installed
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_refusals_come_at_once() -> None:
    started = time.perf_counter()
    for budget in ("60", 0.6, "6G", "150%"):
        with pytest.raises(gradckpt.UsageError):
            check_budget(budget)
    assert time.perf_counter() - started < 0.5


# --------------------------------------------------------------------------------------------
# format_bytes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (123, "123 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (MIB - 1, "1.00 MiB"),  # not "1024.00 KiB"
        (512 * MIB, "512.00 MiB"),
        (3 * GIB // 2, "1.50 GiB"),
        (6 * GIB, "6.00 GiB"),
        (5 * TIB, "5.00 TiB"),
        (2**50, "1.00 PiB"),
        (2**60, "1024.00 PiB"),  # the largest unit
        (-123, "-123 B"),
        (-3 * MIB, "-3.00 MiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@given(st.integers(min_value=1, max_value=2**62))
def test_format_then_parse_round_trips_within_rounding(n: int) -> None:
    text = format_bytes(n)
    back = parse_budget(text)
    if n < 1024:
        assert back == n
    else:
        # two decimals of the unit: off by at most half a hundredth of it, i.e. 0.5% of n
        unit = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(text.split()[1])
        assert abs(back - n) <= unit // 200 + 1


@given(st.integers(min_value=1, max_value=2**55))
def test_a_rounded_up_budget_is_never_below_and_barely_above(n_bytes: int) -> None:
    typed = rounded_up_budget(n_bytes)
    read = parse_budget(typed)
    assert n_bytes <= read
    unit = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(typed.lstrip("0123456789."))
    assert read - n_bytes <= max(unit // 100, 1)  # one hundredth of its unit at most
    whole, _, hundredths = typed.rstrip("BKMGTPi").partition(".")
    assert int(whole) >= 1 and (not hundredths or len(hundredths) == 2)
