"""``from_datasheet``: a preset ``DeviceSpec`` from the figures a vendor's table prints, and the
phrases the presets' sources share (``datacenter.py`` and ``desktop.py`` hold the figures).

How a preset's ``source`` reads (docs/devices.md says the same): it names the vendor's document,
then says which figures were **checked** against a copy of its table (NVIDIA's PDFs and pages
themselves could not be opened where the presets were written, so "checked" means "matches the
vendor's table as reproduced in the copy named") and which are **unverified** (no copy of the
vendor's table found; the figure is the one third-party spec databases agree on, or, where they
disagree, the range they give and which end was taken). Compute capabilities are from NVIDIA's
CUDA GPUs page (developer.nvidia.com/cuda-gpus).

The INT8 figure is the dense INT8 tensor-core rate (int8 products accumulated in int32, in
TOPS: a multiply-add counts as two operations, as a FLOP formula counts it), the rate of the
int8 matmul an 8-bit base (bitsandbytes' LLM.int8()) runs in each frozen layer. It is not
halved on GeForce cards as the FP16 figure with FP32 accumulation is: their INT8 rate is twice
their FP16-accumulate rate, four times the FP32-accumulate one.
"""

from __future__ import annotations

import torch

from .spec import GIB, GIGA, TERA, DeviceSpec

__all__ = ["from_datasheet"]

# Dense figures: NVIDIA prints Hopper, Ada and Blackwell tensor-core rates "with sparsity"
# (marked *, 2:4 structured sparsity, which training does not use); the dense rate is half.
DENSE = "tensor-core figures printed with sparsity (*), halved"
CUDA_GPUS = "compute capability from developer.nvidia.com/cuda-gpus"
# GeForce cards run FP16/BF16 tensor math with FP32 accumulation at half the rate of FP16
# accumulation; PyTorch accumulates in FP32, so that is the figure that applies. (Data-center
# and RTX professional cards run both at the same rate.)
GEFORCE = (
    "the FP32-accumulate figure: GeForce runs it at half the FP16-accumulate rate, and PyTorch "
    "accumulates in FP32"
)
NO_BF16 = "no bf16: tensor cores before Ampere take fp16 only, so bf16 is refused, not guessed"
# Volta's tensor cores take fp16 only; INT8 tensor cores came with Turing (bitsandbytes: "7.5 is
# the minimum CC for int8 tensor cores"; below it, "only slow 8-bit matmul is supported").
NO_INT8 = (
    "no INT8 figure: Volta has no INT8 tensor cores (they came with Turing, compute capability "
    "7.5), and the datasheet prints no INT8 rate; an int8 matmul (an 8-bit base's) is timed at "
    "the FP32 figure, as every dtype without a figure of its own is (bitsandbytes warns that "
    "below 7.5 'only slow 8-bit matmul is supported')"
)


def from_datasheet(
    name: str,
    description: str,
    *,
    memory_gib: int,
    tensor_tflops: float,
    fp32_tflops: float,
    bandwidth_gb_per_second: float,
    compute_capability: tuple[int, int],
    source: str,
    int8_tops: float | None,
    bf16: bool = True,
) -> DeviceSpec:
    """A preset from its datasheet: ``tensor_tflops`` is the dense FP16 (and BF16) tensor-core
    rate with FP32 accumulation, ``fp32_tflops`` the plain (non-tensor) FP32 rate, ``int8_tops``
    the dense INT8 tensor-core rate (``None`` for a card without INT8 tensor cores: an int8
    matmul is then timed at the FP32 figure), memory in the vendor's GB (binary: ``spec.GIB``)
    and bandwidth in its GB/s (10**9 bytes per second).

    ``bf16=False`` for a card without bf16 tensor cores (Volta, Turing): the spec then has no
    bfloat16 figure and lists it in ``unsupported_dtypes``, so that a bf16 estimate on it is an
    error rather than a silent fall back to the fp32 figure.

    Example:
        >>> t4 = from_datasheet("t4", "T4", memory_gib=16, tensor_tflops=65, fp32_tflops=8.1,
        ...                     bandwidth_gb_per_second=320, compute_capability=(7, 5),
        ...                     source="example", int8_tops=130, bf16=False)
        >>> sorted(str(dtype) for dtype in t4.flops_per_second), t4.unsupported_dtypes
        (['torch.float16', 'torch.float32', 'torch.int8'], (torch.bfloat16,))
    """
    flops = {torch.float16: tensor_tflops * TERA, torch.float32: fp32_tflops * TERA}
    if int8_tops is not None:
        flops[torch.int8] = int8_tops * TERA
    if bf16:
        # FP16 and BF16 tensor rates are equal on every GPU listed (one figure for both).
        flops[torch.bfloat16] = tensor_tflops * TERA
    return DeviceSpec(
        name=name,
        description=description,
        memory_bytes=memory_gib * GIB,
        flops_per_second=flops,
        memory_bandwidth_bytes_per_second=bandwidth_gb_per_second * GIGA,
        source=source,
        compute_capability=compute_capability,
        unsupported_dtypes=() if bf16 else (torch.bfloat16,),
    )
