"""``"this"``: the machine at hand, its GPU if torch sees one, else its CPU; its throughput and
bandwidth measured once and cached in ``$GRADCKPT_CACHE_DIR`` (default ``~/.cache/gradckpt``)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import warn_once
from .spec import GIB, DeviceSpec

__all__ = ["THIS"]

THIS = "this"

# --------------------------------------------------------------------------------------------
# "this": the machine at hand, measured once and cached
# --------------------------------------------------------------------------------------------

CACHE_FILE_NAME = "this-device.json"
# Bump when the way of measuring changes, so that old cached numbers are measured over.
_METHOD_VERSION = 1
# Measured dtypes. float16 too: on CPUs it can be 100x slower than float32 (no native support),
# and falling back to float32's figure would then be far off.
_MEASURED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A timed sample lasts about this long: long enough to dwarf timer and launch overheads, short
# enough that all of "this" takes about a second on a 2-core CPU.
_SAMPLE_SECONDS = 0.04
_SAMPLES = 3  # best of: noise on a shared machine only ever makes a run slower


def _this_device(*, refresh: bool) -> DeviceSpec:
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else None
    description, memory_bytes = _cuda_identity(device) if device is not None else _cpu_identity()
    fingerprint = _fingerprint(kind, description)
    path = _cache_path()
    entry = None if refresh else _read_cache(path).get(fingerprint)
    if entry is None or not _valid_entry(entry):
        entry = _measure(device)
        _write_cache(path, fingerprint, entry)
    flops = {getattr(torch, name): rate for name, rate in entry["flops_per_second"].items()}
    return DeviceSpec(
        name=THIS,
        description=f"this machine's {'GPU' if kind == 'cuda' else 'CPU'}: {description}",
        memory_bytes=memory_bytes,
        flops_per_second=flops,
        memory_bandwidth_bytes_per_second=entry["memory_bandwidth_bytes_per_second"],
        source=f"measured here on {entry['measured_at']} ({entry['method']}); cached in {path}",
        kind=kind,
        compute_capability=(
            tuple(torch.cuda.get_device_capability(device)) if device is not None else None),
    )


def _cuda_identity(device: torch.device) -> tuple[str, int]:
    properties = torch.cuda.get_device_properties(device)
    return properties.name, int(properties.total_memory)


def _cpu_identity() -> tuple[str, int]:
    """The CPU's model name with the threads torch uses, and the memory this process can have.

    Memory is the capacity, as for a GPU (not what is free now, which is ``"auto"``'s
    business, ``gradckpt.budget.available_bytes``): total RAM, capped by a cgroup (container)
    memory limit where there is one.
    """
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    description = f"{model}, {torch.get_num_threads()} threads"
    memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_limit_bytes()
    if limit is not None:
        memory_bytes = min(memory_bytes, limit)
    return description, int(memory_bytes)


_CGROUP_LIMIT_FILES = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2: "max" when unlimited
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # v1: a huge number when unlimited
)


def _cgroup_limit_bytes() -> int | None:
    for path in _CGROUP_LIMIT_FILES:
        try:
            with open(path) as file:
                limit = int(file.read().strip())
        except (OSError, ValueError):
            continue
        return limit if limit < 2**60 else None
    return None


def _fingerprint(kind: str, description: str) -> str:
    """What the measured numbers depend on; a cached entry is used only where all of it agrees."""
    parts = {
        "host": socket.gethostname(),
        "kind": kind,
        "device": description,  # the CPU's model and thread count, or the GPU's name
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        # "high"/"medium" let fp32 matmuls use TF32/bf16 tensor cores: another fp32 figure.
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "method": _METHOD_VERSION,
    }
    return json.dumps(parts, sort_keys=True)


def _cache_path() -> Path:
    directory = os.environ.get("GRADCKPT_CACHE_DIR")
    if not directory:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "gradckpt")
    return Path(directory) / CACHE_FILE_NAME


def _read_cache(path: Path) -> dict[str, Any]:
    """The cached entries by fingerprint; {} when the file is missing or unreadable (a corrupt
    file is measured over, never an error)."""
    try:
        with open(path) as file:
            content = json.load(file)
    except (OSError, ValueError):
        return {}
    entries = content.get("entries") if isinstance(content, dict) else None
    return entries if isinstance(entries, dict) else {}


def _valid_entry(entry: Any) -> bool:
    try:
        rates = entry["flops_per_second"]
        values = [*rates.values(), entry["memory_bandwidth_bytes_per_second"]]
        return (
            "float32" in rates
            and all(isinstance(getattr(torch, name, None), torch.dtype) for name in rates)
            and all(
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
                for value in values
            )
            and isinstance(entry["measured_at"], str)
            and isinstance(entry["method"], str)
        )
    except (KeyError, TypeError, AttributeError):
        return False


def _write_cache(path: Path, fingerprint: str, entry: dict[str, Any]) -> None:
    entries = _read_cache(path)
    entries[fingerprint] = entry
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write a temporary file and rename it: a reader never sees half a file.
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=".this-device-", suffix=".json", delete=False
        ) as file:
            temporary = file.name
            json.dump({"version": 1, "entries": entries}, file, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
        warn_once(
            "devices-cache-unwritable",
            f"gradckpt could not cache this device's measured speed in {path} ({error}); it "
            f"will be measured again in every process. Set GRADCKPT_CACHE_DIR to a writable "
            f"directory.",
        )


def _measure(device: torch.device | None) -> dict[str, Any]:
    """Measure this device's dense matmul throughput per dtype and its copy bandwidth.

    Each benchmark is sized first, then all are timed in turns, ``_SAMPLES`` rounds, keeping
    each one's fastest sample: a burst of load from another process then spoils a sample of
    each rather than every sample of one (the numbers are cached, so a spoiled one would stay).
    """
    benchmarks = {
        str(dtype).removeprefix("torch."): _matmul_benchmark(dtype, device)
        for dtype in _MEASURED_DTYPES
    }
    benchmarks["copy"] = _copy_benchmark(device)
    fastest = dict.fromkeys(benchmarks, math.inf)
    for _ in range(_SAMPLES):
        for key, benchmark in benchmarks.items():
            fastest[key] = min(fastest[key], _timed(benchmark.run, device))
    rates = {key: benchmark.amount / fastest[key] for key, benchmark in benchmarks.items()}
    bandwidth = rates.pop("copy")
    method = (
        f"fastest of {_SAMPLES} rounds: square matmuls ("
        + ", ".join(f"{key} n={benchmarks[key].size}" for key in rates)
        + f"), a copy of {benchmarks['copy'].size / 2**20:.0f} MiB counting bytes read and "
        "written"
    )
    return {
        "flops_per_second": rates,
        "memory_bandwidth_bytes_per_second": bandwidth,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": method,
    }


@dataclass
class _Benchmark:
    run: Callable[[], None]  # one timed sample
    amount: float  # FLOPs or bytes one sample does
    size: int  # matrix side, or bytes copied


def _matmul_benchmark(dtype: torch.dtype, device: torch.device | None) -> _Benchmark:
    """Products of two n x n ``dtype`` matrices (2 n**3 FLOPs each), repeated to fill a sample.

    n grows until one product takes a fair part of a sample (small matrices measure call
    overheads, not the math units) or reaches the largest size allowed.
    """
    largest = 4096
    if device is not None and torch.cuda.mem_get_info(device)[0] >= 16 * GIB:
        largest = 8192  # 8192 x 8192 fp32 operands and product: 768 MiB, held while measuring
    generator = torch.Generator(device=device or "cpu").manual_seed(0)  # the global RNG untouched
    n = 256
    while True:
        a = torch.rand(n, n, generator=generator, device=device).to(dtype)
        b = torch.rand(n, n, generator=generator, device=device).to(dtype)
        # The first calls at a size pay one-off setup (oneDNN builds its kernel, cuBLAS picks
        # one): the fastest of a few is the product's own time.
        seconds = min(_timed(lambda: a @ b, device) for _ in range(3))  # noqa: B023 - used here
        # Past an eighth of a sample, overheads are small and repeats fill the rest; doubling n
        # costs 8x the time (seconds, on a CPU without fp16 units).
        if seconds >= _SAMPLE_SECONDS / 8 or n >= largest:
            break
        # Time grows as n**3: jump most of the way at once, to a multiple of 256.
        grow = (_SAMPLE_SECONDS / max(seconds, 1e-7)) ** (1 / 3)
        n = min(largest, max(2 * n, int(n * grow) // 256 * 256))
    repeats = max(1, math.ceil(_SAMPLE_SECONDS / max(seconds, 1e-7)))

    def products() -> None:
        for _ in range(repeats):
            a @ b

    return _Benchmark(run=products, amount=2 * n**3 * repeats, size=n)


def _copy_benchmark(device: torch.device | None) -> _Benchmark:
    """``b.copy_(a)`` on tensors far larger than any cache, counting the bytes read and the
    bytes written (as STREAM's copy does)."""
    if device is not None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
        size = min(GIB, free_bytes // 8)
    else:
        size = min(256 * 2**20, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 32)
    a = torch.ones(max(size // 4, 1), dtype=torch.float32, device=device)
    b = torch.zeros_like(a)  # both written once: their pages are mapped before timing
    seconds = min(_timed(lambda: b.copy_(a), device) for _ in range(2))
    repeats = max(1, math.ceil(_SAMPLE_SECONDS / max(seconds, 1e-7)))

    def copies() -> None:
        for _ in range(repeats):
            b.copy_(a)

    return _Benchmark(run=copies, amount=2 * a.nbytes * repeats, size=a.nbytes)


def _timed(work: Callable[[], Any], device: torch.device | None) -> float:
    if device is not None:
        torch.cuda.synchronize(device)  # CUDA runs asynchronously: wait for work queued before
    start = time.perf_counter()
    work()
    if device is not None:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
