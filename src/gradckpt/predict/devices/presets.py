"""The GPUs ``estimate`` knows by name: the vendor's datasheet figures, each with its source
(docs/devices.md lists them)."""

from __future__ import annotations

import torch

from .spec import GIB, GIGA, TERA, DeviceSpec

__all__ = ["ALIASES", "DEVICES"]

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
                f"Tensor Core 1,979 TFLOPS*, 80GB HBM3 at 3.35TB/s; {_DENSE}"
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
                f"NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column: FP32 51 TFLOPS, BF16 "
                f"Tensor Core 1,513 TFLOPS*, 80GB HBM2e at 2TB/s; {_DENSE}"
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
                f"NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 Tensor Core 1,979 "
                f"TFLOPS*, 141GB HBM3e at 4.8TB/s; {_DENSE}; FP32 67 TFLOPS as the H100 SXM (the "
                f"same GH100 compute), from memory: verify"
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
                "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: FP32 19.5 TFLOPS, "
                "BF16 Tensor Core 312 TFLOPS (624* with sparsity), 80GB HBM2e at 2,039GB/s"
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
                "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column: FP32 19.5 TFLOPS, "
                "BF16 Tensor Core 312 TFLOPS (624* with sparsity), 40GB HBM2 at 1,555GB/s"
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
                f"TFLOPS*, 24GB GDDR6 at 300GB/s; {_DENSE}"
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
                "NVIDIA Ada GPU architecture whitepaper, appendix table for the GeForce RTX 4090: "
                "FP32 82.6 TFLOPS, FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense (330.4 "
                "with sparsity; GeForce runs FP32-accumulate at half the FP16-accumulate rate, and "
                "PyTorch accumulates in FP32), 24GB GDDR6X at 1,008GB/s; the tensor figure is from "
                "memory, matched by third-party spec tables (165.15 TFLOPS): verify"
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

