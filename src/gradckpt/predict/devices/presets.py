"""The GPUs ``estimate`` knows by name: the vendor's datasheet figures, each with its source
and whether it was checked (docs/devices.md lists them, with the copies they were checked
against).

Each ``source`` names the vendor's document and says which figures were checked against a copy
of its table ("checked": NVIDIA's PDFs and pages themselves could not be opened where the
presets were checked) and which are "unverified" (no copy of the vendor's table found; the
figure is the one third-party spec databases agree on). Compute capabilities are from NVIDIA's
CUDA GPUs page (developer.nvidia.com/cuda-gpus).
"""

from __future__ import annotations

import torch

from .spec import GIB, GIGA, TERA, DeviceSpec

__all__ = ["ALIASES", "DEVICES", "HOST_LINKS", "host_link_bytes_per_second"]

def _preset(
    name: str,
    description: str,
    memory_gib: int,
    bf16_tflops: float,
    fp32_tflops: float,
    bandwidth_gb_per_second: float,
    source: str,
    compute_capability: tuple[int, int],
) -> DeviceSpec:
    # FP16 and BF16 tensor-core rates are equal on every GPU listed (the datasheets print one
    # figure for both), and PyTorch accumulates both in fp32.
    return DeviceSpec(
        name=name,
        description=description,
        memory_bytes=memory_gib * GIB,
        flops_per_second={
            torch.bfloat16: bf16_tflops * TERA,
            torch.float16: bf16_tflops * TERA,
            torch.float32: fp32_tflops * TERA,
        },
        memory_bandwidth_bytes_per_second=bandwidth_gb_per_second * GIGA,
        source=source,
        compute_capability=compute_capability,
    )


# Dense figures: NVIDIA prints Hopper/Ada tensor-core rates "with sparsity" (marked *, 2:4
# structured sparsity, which training does not use); the dense rate is half of that.
_DENSE = "tensor-core figures printed with sparsity (*), halved"
_CUDA_GPUS = "compute capability from developer.nvidia.com/cuda-gpus"

DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _preset(
            name="h100-80gb",
            description="NVIDIA H100 SXM5 80GB",
            memory_gib=80,
            bf16_tflops=1979 / 2,
            fp32_tflops=67,
            bandwidth_gb_per_second=3350,
            source=(
                f"NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TFLOPS, BF16 "
                f"Tensor Core 1,979 TFLOPS*, 80GB HBM3 at 3.35TB/s; {_DENSE}; all checked "
                f"against a copy of the datasheet table "
                f"(archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html); {_CUDA_GPUS}"
            ),
            compute_capability=(9, 0),
        ),
        _preset(
            name="h100-pcie-80gb",
            description="NVIDIA H100 PCIe 80GB",
            memory_gib=80,
            bf16_tflops=1513 / 2,
            fp32_tflops=51,
            bandwidth_gb_per_second=2000,
            source=(
                f"NVIDIA H100 Tensor Core GPU datasheet (2022 edition), H100 PCIe column: FP32 51 "
                f"TFLOPS, BF16 Tensor Core 1,513 TFLOPS*, 80GB HBM2e at 2TB/s; {_DENSE}; all "
                f"checked against a copy of the datasheet table "
                f"(archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html); {_CUDA_GPUS}"
            ),
            compute_capability=(9, 0),
        ),
        _preset(
            name="h200-141gb",
            description="NVIDIA H200 SXM 141GB",
            memory_gib=141,
            bf16_tflops=1979 / 2,
            fp32_tflops=67,
            bandwidth_gb_per_second=4800,
            source=(
                f"NVIDIA H200 Tensor Core GPU datasheet and product page, H200 SXM column: FP32 "
                f"67 TFLOPS, BF16 Tensor Core 1,979 TFLOPS*, 141GB HBM3e at 4.8TB/s; {_DENSE}; "
                f"all checked against a copy of the table (github.com/stas00/ml-engineering, "
                f"compute/accelerator: H200 SXM fp32 67, bf16 989 dense, 141GB at 4.8TBps); "
                f"{_CUDA_GPUS}"
            ),
            compute_capability=(9, 0),
        ),
        _preset(
            name="a100-80gb",
            description="NVIDIA A100 SXM4 80GB",
            memory_gib=80,
            bf16_tflops=312,
            fp32_tflops=19.5,
            bandwidth_gb_per_second=2039,
            source=(
                f"NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: FP32 19.5 TFLOPS, "
                f"BF16 Tensor Core 312 TFLOPS (624* with sparsity), 80GB HBM2e at 2,039GB/s; all "
                f"checked against a copy of the datasheet's figures "
                f"(glennklockwood.com/garden/processors/A100); {_CUDA_GPUS}"
            ),
            compute_capability=(8, 0),
        ),
        _preset(
            name="a100-40gb",
            description="NVIDIA A100 SXM4 40GB",
            memory_gib=40,
            bf16_tflops=312,
            fp32_tflops=19.5,
            bandwidth_gb_per_second=1555,
            source=(
                f"NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column: FP32 19.5 TFLOPS, "
                f"BF16 Tensor Core 312 TFLOPS (624* with sparsity), 40GB HBM2 at 1,555GB/s; all "
                f"checked against a copy of the datasheet's figures "
                f"(glennklockwood.com/garden/processors/A100); {_CUDA_GPUS}"
            ),
            compute_capability=(8, 0),
        ),
        _preset(
            name="l4-24gb",
            description="NVIDIA L4 24GB",
            memory_gib=24,
            bf16_tflops=242 / 2,
            fp32_tflops=30.3,
            bandwidth_gb_per_second=300,
            source=(
                f"NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, BF16 Tensor Core 242 "
                f"TFLOPS*, 24GB GDDR6 at 300GB/s; {_DENSE}; FP32, BF16 and memory checked "
                f"against the datasheet's text (its copy at cisco.com, nvidia-l4-gpu.pdf); the "
                f"300GB/s bandwidth unverified (spec databases: 300GB/s); {_CUDA_GPUS}"
            ),
            compute_capability=(8, 9),
        ),
        _preset(
            name="rtx4090-24gb",
            description="NVIDIA GeForce RTX 4090 24GB",
            memory_gib=24,
            bf16_tflops=165.2,
            fp32_tflops=82.6,
            bandwidth_gb_per_second=1008,
            source=(
                f"NVIDIA Ada GPU architecture whitepaper, appendix table for the GeForce RTX 4090: "
                f"FP32 82.6 TFLOPS, FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense "
                f"(GeForce runs FP32-accumulate at half the FP16-accumulate rate, and PyTorch "
                f"accumulates in FP32), 24GB GDDR6X at 1,008GB/s; all unverified: no copy of the "
                f"whitepaper's table found, the figures are those spec databases agree on (82.58 "
                f"TFLOPS FP32, 165.15 dense BF16, 1,008GB/s); {_CUDA_GPUS}"
            ),
            compute_capability=(8, 9),
        ),
    )
}

# Other names people use, lowercased and with "-" for spaces and "_"; documented in
# docs/devices.md. A bare model name means its most common variant today: the SXM board, and for
# the A100 the 80GB one (the 40GB part was replaced by it).
ALIASES: dict[str, str] = {
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "h100-sxm-80gb": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h100-80gb-hbm3": "h100-80gb",  # what torch.cuda.get_device_name() says
    "h100-pcie": "h100-pcie-80gb",
    "h200": "h200-141gb",
    "h200-sxm": "h200-141gb",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb",
    "l4": "l4-24gb",
    "4090": "rtx4090-24gb",
    "rtx4090": "rtx4090-24gb",
    "rtx-4090": "rtx4090-24gb",
    "rtx-4090-24gb": "rtx4090-24gb",
}


# The link between each GPU and its host's memory, for offloading: the datasheet's PCIe figure
# (both directions together), with its source. A copy runs one way at a time, at half of it;
# pinned-memory copies reach about 80% of that in NVIDIA's bandwidthTest on Gen4 and Gen5
# hosts (about 25 of 32 GB/s, 50 of 64 GB/s), the figure the cost model uses
# (``host_link_bytes_per_second``). bench/device_check.sh measures it where a GPU is at hand.
_GEN5 = (128, "PCIe Gen5 x16: 128 GB/s, the vendor's datasheet (both directions)")
_GEN4 = (64, "PCIe Gen4 x16: 64 GB/s, the vendor's datasheet (both directions)")
HOST_LINKS: dict[str, tuple[float, str]] = {
    "h100-80gb": _GEN5, "h100-pcie-80gb": _GEN5, "h200-141gb": _GEN5,
    "a100-80gb": _GEN4, "a100-40gb": _GEN4, "l4-24gb": _GEN4,
    "rtx4090-24gb": (64, "PCIe Gen4 x16: 64 GB/s, the PCIe 4.0 specification (both directions)"),
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
