"""The GPUs ``estimate`` knows by name, and the names people give them.

- ``DEVICES``: the presets, the vendor's figures each with its source and whether it was
  checked (the figures are in ``datacenter.py`` and ``desktop.py``; how a source reads is said in
  ``datasheet.py``; docs/devices.md lists them all);
- ``ALIASES``: other names for a preset, among them what ``torch.cuda.get_device_name()`` prints;
- ``AMBIGUOUS``: short names that could mean more than one preset, refused with the choices;
- ``FAMILIES``: product lines; a misspelt name is matched only against presets of its own line
  (``family_of``), never turned into another kind of card;
- ``HOST_LINKS``: each GPU's link to host memory, for offloading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .datacenter import DATACENTER
from .desktop import DESKTOP
from .spec import GIGA, DeviceSpec

__all__ = [
    "ALIASES", "AMBIGUOUS", "DEVICES", "FAMILIES", "HOST_LINKS", "Family", "family_of",
    "host_link_bytes_per_second",
]

DEVICES: dict[str, DeviceSpec] = {spec.name: spec for spec in (*DATACENTER, *DESKTOP)}


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

# Other names people use, written as ``device_spec`` normalizes a name: lowercased, "-" for
# spaces and "_", without a leading "nvidia-", "geforce-" or "tesla-" (so "NVIDIA GeForce RTX
# 3090" is "rtx-3090" and "Tesla V100-SXM2-16GB" is "v100-sxm2-16gb"). Each name that
# torch.cuda.get_device_name() prints for a preset's card is here (marked "torch"); a name it
# prints for another variant (an A100 PCIe, an H100 NVL, a V100S) is not, and gets the
# same-family suggestions instead. A bare model name means its most common variant today:
# the SXM board, and for the A100 the 80GB one (the 40GB part was replaced by it).
ALIASES: dict[str, str] = {
    # Hopper, Blackwell
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "h100-sxm-80gb": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h100-80gb-hbm3": "h100-80gb",  # torch
    "h100-pcie": "h100-pcie-80gb",  # torch
    "h200": "h200-141gb",  # torch
    "h200-sxm": "h200-141gb",
    "b200": "b200-180gb",  # torch
    # Ampere, Ada data center
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",  # torch
    "a100-sxm4-40gb": "a100-40gb",  # torch
    "a10g": "a10g-24gb",  # torch
    "l4": "l4-24gb",  # torch
    "l40s": "l40s-48gb",  # torch
    # Volta, Turing
    "t4": "t4-16gb",  # torch: "Tesla T4"
    "v100-sxm2-16gb": "v100-16gb",  # torch
    "v100-sxm2-32gb": "v100-32gb",  # torch
    # GeForce
    "3090": "rtx3090-24gb",
    "rtx3090": "rtx3090-24gb",
    "rtx-3090": "rtx3090-24gb",  # torch
    "rtx-3090-24gb": "rtx3090-24gb",
    "4090": "rtx4090-24gb",
    "rtx4090": "rtx4090-24gb",
    "rtx-4090": "rtx4090-24gb",  # torch
    "rtx-4090-24gb": "rtx4090-24gb",
    "5090": "rtx5090-32gb",
    "rtx5090": "rtx5090-32gb",
    "rtx-5090": "rtx5090-32gb",  # torch
    "rtx-5090-32gb": "rtx5090-32gb",
    # RTX workstation
    "a6000": "a6000-48gb",
    "rtxa6000": "a6000-48gb",
    "rtx-a6000": "a6000-48gb",  # torch
    "rtx-a6000-48gb": "a6000-48gb",
    "6000ada": "rtx6000ada-48gb",
    "6000-ada": "rtx6000ada-48gb",
    "rtx6000ada": "rtx6000ada-48gb",
    "rtx6000-ada": "rtx6000ada-48gb",
    "rtx-6000-ada": "rtx6000ada-48gb",
    "rtx-6000-ada-generation": "rtx6000ada-48gb",  # torch
}

# Short names that mean more than one preset, where the difference decides whether a step
# fits: refused with the choices (docs/devices.md), not mapped to a guess.
AMBIGUOUS: dict[str, tuple[str, ...]] = {
    "v100": ("v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb"),
    "v100-sxm2": ("v100-16gb", "v100-32gb"),
    "v100-pcie": ("v100-pcie-16gb", "v100-pcie-32gb"),
}


@dataclass(frozen=True)
class Family:
    """A product line: the names that belong to it (``pattern``, matched at the start of a
    normalized name) and the presets in it."""

    name: str
    description: str
    pattern: re.Pattern[str]
    presets: tuple[str, ...]


# In the order they are tried: the RTX workstation line before GeForce, so that "rtx-6000" is a
# workstation card (4-digit GeForce numbers never end in "000"), and "a6000" is never an A100.
FAMILIES: tuple[Family, ...] = (
    Family("hopper", "the NVIDIA H100 / H200 line", re.compile(r"(gh|h)\d"),
           ("h100-80gb", "h100-pcie-80gb", "h200-141gb")),
    Family("blackwell", "the NVIDIA B100 / B200 / B300 line", re.compile(r"(gb|b)\d"),
           ("b200-180gb",)),
    Family("rtx-workstation", "the NVIDIA RTX workstation line (RTX A6000, RTX 6000 Ada)",
           re.compile(r"(rtx-?)?(pro-?)?(a\d{4}|[2-6]000|4500)(?!\d)|.*ada|.*quadro"),
           ("a6000-48gb", "rtx6000ada-48gb")),
    Family("ampere-datacenter", "the NVIDIA A100 / A10G line", re.compile(r"a\d{1,3}(?!\d)"),
           ("a100-80gb", "a100-40gb", "a10g-24gb")),
    Family("ada-datacenter", "the NVIDIA L4 / L40S line", re.compile(r"l\d"),
           ("l4-24gb", "l40s-48gb")),
    Family("tesla", "the NVIDIA Tesla V100 / T4 line (no bf16)", re.compile(r"[vptk]\d{1,3}"),
           ("v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "t4-16gb")),
    Family("geforce", "the NVIDIA GeForce RTX line", re.compile(r"((rtx|gtx)-?)?\d{4}(?!\d)"),
           ("rtx3090-24gb", "rtx4090-24gb", "rtx5090-32gb")),
)


def family_of(name: str) -> Family | None:
    """The product line a normalized device name belongs to, or None for a name of no line
    gradckpt has presets for (a TPU, a typo far from any card).

    Example:
        >>> family_of("a6000ada").name, family_of("a100-pcie-40gb").name, family_of("h300").name
        ('rtx-workstation', 'ampere-datacenter', 'hopper')
        >>> family_of("tpu-v5e") is None
        True
    """
    return next((family for family in FAMILIES if family.pattern.match(name)), None)


# --------------------------------------------------------------------------------------------
# Host links
# --------------------------------------------------------------------------------------------

# The link between each GPU and its host's memory, for offloading: the PCIe figure (both
# directions together), with its source. A copy runs one way at a time, at half of it;
# pinned-memory copies reach about 80% of that in NVIDIA's bandwidthTest on Gen4 and Gen5
# hosts (about 25 of 32 GB/s, 50 of 64 GB/s), the figure the cost model uses
# (``host_link_bytes_per_second``). bench/device_check.sh measures it where a GPU is at hand.
_GEN5 = (128, "PCIe Gen5 x16: 128 GB/s, the vendor's datasheet (both directions)")
_GEN4 = (64, "PCIe Gen4 x16: 64 GB/s, the vendor's datasheet (both directions)")
_GEN3 = (32, "PCIe Gen3 x16: 32 GB/s, the vendor's datasheet (both directions)")
_GEN4_SPEC = (64, "PCIe Gen4 x16: 64 GB/s, the PCIe 4.0 specification (both directions)")
_GEN5_SPEC = (128, "PCIe Gen5 x16: 128 GB/s, the PCIe 5.0 specification (both directions)")
HOST_LINKS: dict[str, tuple[float, str]] = {
    "h100-80gb": _GEN5, "h100-pcie-80gb": _GEN5, "h200-141gb": _GEN5,
    "b200-180gb": (128, "PCIe Gen5 x16: 128 GB/s (both directions), unverified: B200 supports "
                        "Gen6, but the HGX/DGX B200 hosts' CPUs are Gen5"),
    "a100-80gb": _GEN4, "a100-40gb": _GEN4, "l4-24gb": _GEN4, "l40s-48gb": _GEN4,
    "a10g-24gb": (64, "PCIe Gen4 x16: 64 GB/s, the PCIe 4.0 specification (both directions); "
                      "AWS publishes no A10G datasheet"),
    "t4-16gb": _GEN3, "v100-16gb": _GEN3, "v100-32gb": _GEN3,
    "v100-pcie-16gb": _GEN3, "v100-pcie-32gb": _GEN3,
    "rtx3090-24gb": _GEN4_SPEC, "rtx4090-24gb": _GEN4_SPEC, "rtx5090-32gb": _GEN5_SPEC,
    "a6000-48gb": _GEN4_SPEC, "rtx6000ada-48gb": _GEN4_SPEC,
}
PINNED_COPY_SHARE = 0.8  # of one direction's datasheet rate, reached by pinned copies


def host_link_bytes_per_second(name: str) -> float | None:
    """What one copy between the GPU ``name`` and pinned host memory moves per second, or
    None for a device without a known host link (a CPU, or a GPU given by numbers).

    Example:
        >>> host_link_bytes_per_second("h100-80gb") / 1e9  # Gen5: 64 GB/s one way, 80% of it
        51.2
        >>> host_link_bytes_per_second("this") is None
        True
    """
    if name not in HOST_LINKS:
        return None
    both_ways_gb_per_second, _ = HOST_LINKS[name]
    return both_ways_gb_per_second / 2 * GIGA * PINNED_COPY_SHARE
