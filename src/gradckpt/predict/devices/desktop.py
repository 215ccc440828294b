"""Desktop GPUs: GeForce RTX 3090, 4090 and 5090 and the RTX workstation cards A6000 and RTX 6000
Ada, each with its figures' source (docs/devices.md lists them).
"""

from __future__ import annotations

from .datasheet import CUDA_GPUS, GEFORCE, from_datasheet
from .spec import DeviceSpec

__all__ = ["DESKTOP"]

DESKTOP: tuple[DeviceSpec, ...] = (
    from_datasheet(
        "rtx3090-24gb", "NVIDIA GeForce RTX 3090 24GB",
        memory_gib=24, tensor_tflops=71, fp32_tflops=35.6, bandwidth_gb_per_second=936,
        compute_capability=(8, 6), int8_tops=284,
        source=(
            f"NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A (GeForce RTX 3090): "
            f"FP32 35.6 TFLOPS, FP16/BF16 Tensor with FP32 accumulate 71 TFLOPS dense, 24GB "
            f"GDDR6X at 936GB/s; 71 is {GEFORCE}; all unverified: copies of the whitepaper were "
            f"found (docslib.org, studylib.net) but their appendix table could not be read; "
            f"FP32, memory and bandwidth are those spec tables agree on (Tom's Hardware's RTX "
            f"3090 table, as copied at holynerdvana.blogspot.com: 35.6 TFLOPS, 24GB, 936GB/s, "
            f"and FP16 tensor 142 dense, 285 sparse, the FP16-accumulate rate, twice the 71; "
            f"spec databases: 35.58 TFLOPS, 936.2GB/s); INT8 Tensor 284 TOPS dense (568 "
            f"sparse) unverified for the same reason: twice Tom's Hardware's FP16-accumulate 142, "
            f"the ratio on every Ampere card whose table was read (the A40 datasheet as ecer.com "
            f"copies it: FP16 149.7, INT8 299.3); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "rtx4090-24gb", "NVIDIA GeForce RTX 4090 24GB",
        memory_gib=24, tensor_tflops=165.2, fp32_tflops=82.6, bandwidth_gb_per_second=1008,
        compute_capability=(8, 9), int8_tops=660.6,
        source=(
            f"NVIDIA Ada GPU architecture whitepaper, appendix table for the GeForce RTX 4090: "
            f"FP32 82.6 TFLOPS, FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense, 24GB "
            f"GDDR6X at 1,008GB/s; 165.2 is {GEFORCE}; FP32, memory and bandwidth checked "
            f"against NVIDIA's figures as grafikkarten.com reproduces them (its RTX 6000 Ada vs "
            f"GeForce RTX 4090 table: 82.6 TFLOPS, 24GB, 1,008GB/s); the 165.2 unverified: a "
            f"copy of the whitepaper was found (scribd.com/document/656196379) but its table "
            f"could not be read; spec databases agree on it (waredb.com: BF16 165.15 dense, "
            f"330.30 sparse; hmc-tech.com: FP16 with FP32 accumulate 165.2); INT8 Tensor 660.6 "
            f"TOPS dense (1,321.2 sparse) unverified likewise; spec tables agree (waredb.com: "
            f"INT8 660.60 dense, 1,321.21 sparse; Tom's Hardware's table as copied at "
            f"holynerdvana.blogspot.com: 661, 1,321 with sparsity); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "rtx5090-32gb", "NVIDIA GeForce RTX 5090 32GB",
        memory_gib=32, tensor_tflops=209.5, fp32_tflops=104.8, bandwidth_gb_per_second=1792,
        compute_capability=(12, 0), int8_tops=838,
        source=(
            f"NVIDIA RTX Blackwell GPU architecture whitepaper, GeForce RTX 5090: FP32 104.8 "
            f"TFLOPS, FP16/BF16 Tensor with FP32 accumulate 209.5 TFLOPS dense, 32GB GDDR7 at "
            f"1,792GB/s; 209.5 is {GEFORCE}; all unverified: no copy of the whitepaper's table "
            f"found; spec pages agree on 32GB GDDR7 at 1,792GB/s and about 104-105 TFLOPS FP32 "
            f"(spheron.network, Tom's Hardware's review in Linux Format) and give FP16 tensor "
            f"838 sparse with FP16 accumulation, a quarter of which, 209.5, is the dense "
            f"FP32-accumulate rate (codesota.com gives 209.5 dense); INT8 Tensor 838 TOPS dense "
            f"unverified: NVIDIA prints 3,352 AI TOPS (FP4 with sparsity), a quarter of which is "
            f"the dense INT8 rate (analysis.castromedia.org derives 838 dense INT8 so; "
            f"spheron.network: FP8 1,676.8 sparse); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "a6000-48gb", "NVIDIA RTX A6000 48GB",
        memory_gib=48, tensor_tflops=154.8, fp32_tflops=38.7, bandwidth_gb_per_second=768,
        compute_capability=(8, 6), int8_tops=309.7,
        source=(
            f"NVIDIA RTX A6000 datasheet and the GA102 whitepaper's appendix C: FP32 38.7 "
            f"TFLOPS, Tensor 309.7 TFLOPS* (154.8 dense; RTX professional cards run FP32 "
            f"accumulation at the full rate), 48GB GDDR6 at 768GB/s; all unverified: no copy of "
            f"the vendor's table read; spec databases agree (sysrqmts.com: 38.71 TFLOPS, "
            f"768.0GB/s; llmperf.net, citing Microway: FP16/BF16 154.8 dense, 309.7 sparse); "
            f"consistent with a copy of the A40 datasheet, the same GA102 at 1,740 against the "
            f"A6000's 1,800MHz (ecer.com: BF16 Tensor with FP32 accumulate 149.7 | 299.4*); "
            f"INT8 Tensor 309.7 TOPS dense (619.4 sparse) unverified likewise: the A40 copy's "
            f"Peak INT8 Tensor TOPS 299.3 | 598.6* at the A6000's clock (299.3 x 1,800 / 1,740 = "
            f"309.6), twice the FP16 figure as on every Ampere card read; {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "rtx6000ada-48gb", "NVIDIA RTX 6000 Ada Generation 48GB",
        memory_gib=48, tensor_tflops=364.2, fp32_tflops=91.1, bandwidth_gb_per_second=960,
        compute_capability=(8, 9), int8_tops=728.5,
        source=(
            f"NVIDIA RTX 6000 Ada Generation datasheet: FP32 91.1 TFLOPS, Tensor Performance "
            f"1,457 TFLOPS (FP8 with sparsity; FP16/BF16 dense with FP32 accumulation, full "
            f"rate on this professional card, is a quarter of it: 364.2), 48GB GDDR6 at "
            f"960GB/s; FP32, memory and bandwidth checked against NVIDIA's figures as "
            f"grafikkarten.com reproduces them (91.1 TFLOPS, 48GB, 960GB/s); the 364.2 "
            f"unverified: no copy of the datasheet's table found; it is close to the L40S's, the "
            f"same AD102 with 142 SMs (362.05 dense at 91.6 TFLOPS FP32); INT8 728.5 TOPS dense, "
            f"half the 1,457: Ada runs INT8 at its FP8 rate (the L40 datasheet as mullet.se "
            f"copies it: 362 | 724* for both), unverified likewise; {CUDA_GPUS}"
        ),
    ),
)
