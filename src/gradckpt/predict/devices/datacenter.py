"""Data-center GPUs: Volta and Turing (V100, T4), Ampere (A100, A10G), Ada (L4, L40S), Hopper
(H100, H200) and Blackwell (B200), each with its figures' source (docs/devices.md lists them).
"""

from __future__ import annotations

from .datasheet import CUDA_GPUS, DENSE, NO_BF16, NO_INT8, from_datasheet
from .spec import DeviceSpec

__all__ = ["DATACENTER"]

_HPCTECH_H100 = "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"
_KLOCKWOOD = "glennklockwood.com/garden/processors"
_STAS00 = (
    "github.com/stas00/ml-engineering, compute/accelerator/README.md, commit 00744732 (its "
    "TFLOPS table without sparsity and its memory table)"
)
_V100_SXM2 = (
    f"NVIDIA V100 Tensor Core GPU datasheet, V100 SXM2 (NVLink) column: FP32 15.7 TFLOPS, Tensor "
    f"125 TFLOPS (FP16 with FP32 accumulation, dense), HBM2 at 900GB/s; all unverified: no copy "
    f"of the datasheet's table found; the figures reproductions agree on "
    f"(github.com/avensun/deep-learning-benchmark: V100 15.7 FP32, 125 FP16; the V100 article of "
    f"grokipedia: 15.7 FP32, 125 tensor); {NO_BF16}; {NO_INT8}; {CUDA_GPUS}"
)
_V100_PCIE = (
    f"NVIDIA V100 Tensor Core GPU datasheet, V100 PCIe column: FP32 14 TFLOPS, Tensor 112 TFLOPS "
    f"(FP16 with FP32 accumulation, dense), HBM2 at 900GB/s; all unverified: no copy of the "
    f"datasheet's table found; NVIDIA's PCIe figures as io-tech.fi reported them at launch (14 "
    f"TFLOPS FP32, 112 TFLOPS tensor, 900GB/s); spec databases: 14.13 TFLOPS, 897GB/s "
    f"(sysrqmts.com); {NO_BF16}; {NO_INT8}; {CUDA_GPUS}"
)

DATACENTER: tuple[DeviceSpec, ...] = (
    from_datasheet(
        "h100-80gb", "NVIDIA H100 SXM5 80GB",
        memory_gib=80, tensor_tflops=1979 / 2, fp32_tflops=67, bandwidth_gb_per_second=3350,
        compute_capability=(9, 0), int8_tops=3958 / 2,
        source=(
            f"NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TFLOPS, BF16 "
            f"Tensor Core 1,979 TFLOPS*, INT8 Tensor Core 3,958 TOPS*, 80GB HBM3 at 3.35TB/s; "
            f"{DENSE}; all checked against a copy of the datasheet table ({_HPCTECH_H100}); "
            f"INT8 also against {_KLOCKWOOD}/h100 (INT8 1,978.9 dense, 3,957.8 sparse); "
            f"{CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "h100-pcie-80gb", "NVIDIA H100 PCIe 80GB",
        memory_gib=80, tensor_tflops=1513 / 2, fp32_tflops=51, bandwidth_gb_per_second=2000,
        compute_capability=(9, 0), int8_tops=3026 / 2,
        source=(
            f"NVIDIA H100 Tensor Core GPU datasheet (2022 edition), H100 PCIe column: FP32 51 "
            f"TFLOPS, BF16 Tensor Core 1,513 TFLOPS*, INT8 Tensor Core 3,026 TOPS*, 80GB HBM2e "
            f"at 2TB/s; {DENSE}; all checked against a copy of the datasheet table "
            f"({_HPCTECH_H100}); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "h200-141gb", "NVIDIA H200 SXM 141GB",
        memory_gib=141, tensor_tflops=1979 / 2, fp32_tflops=67, bandwidth_gb_per_second=4800,
        compute_capability=(9, 0), int8_tops=3958 / 2,
        source=(
            f"NVIDIA H200 Tensor Core GPU datasheet and product page, H200 SXM column: FP32 67 "
            f"TFLOPS, BF16 Tensor Core 1,979 TFLOPS*, 141GB HBM3e at 4.8TB/s; {DENSE}; these "
            f"checked against a copy of the figures ({_STAS00}: H200 SXM fp32 67.0, bf16 989 "
            f"dense, 141GB of HBM3e at 4.80TBps); the 141GB and 4.8TB/s also match "
            f"ai-hpc.github.io's 8x H200 page; INT8 Tensor Core 3,958 TOPS* ({DENSE}) "
            f"unverified: no copy of the datasheet's INT8 row read; it is the H100 SXM's, checked "
            f"above: the H200 is the same GH100 with more memory (as {_KLOCKWOOD}/h100 says), and "
            f"the copies found give it the H100 SXM's FP8 and BF16 figures (ai-hpc.github.io: "
            f"FP8 about 3,958, BF16 about 1,979); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "b200-180gb", "NVIDIA B200 180GB (HGX/DGX B200)",
        memory_gib=180, tensor_tflops=4500 / 2, fp32_tflops=80, bandwidth_gb_per_second=8000,
        compute_capability=(10, 0), int8_tops=9000 / 2,
        source=(
            f"NVIDIA's HGX B200 figures (NVIDIA prints no datasheet for the B200 alone): BF16 "
            f"Tensor Core 4,500 TFLOPS* and INT8 Tensor Core 9,000 TOPS* per GPU, FP32 80 TFLOPS "
            f"at 1,000W, HBM3e at 8TB/s; {DENSE}; BF16, INT8, FP32 and bandwidth checked against "
            f"the copy of NVIDIA's figures at {_KLOCKWOOD}/B200 (HGX B200 at 1,000W: BF16 2,250 "
            f"dense, 4,500 sparse, INT8 4,500 dense, 9,000 sparse, FP32 80; 8TB/s), BF16 and "
            f"bandwidth also against {_STAS00} (B200 "
            f"SXM bf16 2,250, 8.00TBps); spec databases give FP32 75 (hmc-tech.com); memory "
            f"unverified: NVIDIA announced 192GB of HBM3e (the stacks fitted, as both copies "
            f"say), but an HGX B200 GPU offers about 180GB (nvidia-smi in docs.vultr.com's HGX "
            f"B200 overview: 179 GB), so the preset is the 180GB a user gets; {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "a100-80gb", "NVIDIA A100 SXM4 80GB",
        memory_gib=80, tensor_tflops=312, fp32_tflops=19.5, bandwidth_gb_per_second=2039,
        compute_capability=(8, 0), int8_tops=624,
        source=(
            f"NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: FP32 19.5 TFLOPS, BF16 "
            f"Tensor Core 312 TFLOPS (624* with sparsity), INT8 Tensor Core 624 TOPS (1,248*), "
            f"80GB HBM2e at 2,039GB/s; all checked against a copy of the datasheet's figures "
            f"({_KLOCKWOOD}/A100: INT8 624 dense, 1,248 sparse); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "a100-40gb", "NVIDIA A100 SXM4 40GB",
        memory_gib=40, tensor_tflops=312, fp32_tflops=19.5, bandwidth_gb_per_second=1555,
        compute_capability=(8, 0), int8_tops=624,
        source=(
            f"NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column: FP32 19.5 TFLOPS, BF16 "
            f"Tensor Core 312 TFLOPS (624* with sparsity), INT8 Tensor Core 624 TOPS (1,248*), "
            f"40GB HBM2 at 1,555GB/s; all checked against a copy of the datasheet's figures "
            f"({_KLOCKWOOD}/A100: INT8 624 dense, 1,248 sparse); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "a10g-24gb", "NVIDIA A10G 24GB (AWS G5)",
        memory_gib=24, tensor_tflops=62.5, fp32_tflops=31.2, bandwidth_gb_per_second=600,
        compute_capability=(8, 6), int8_tops=125,
        source=(
            f"no vendor datasheet: the A10G is an AWS-only variant of the A10 (the A10 in spec "
            f"databases: FP32 31.24 TFLOPS, 24GB GDDR6 at 600.2GB/s, sysrqmts.com); memory and "
            f"bandwidth are where every source agrees (24GB GDDR6 at 600GB/s, "
            f"baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference, which also says the "
            f"A10G trades some of the A10's tensor throughput for more CUDA-core throughput); "
            f"throughput unverified: the one table of A10G figures found (the GPU catalog of "
            f"huggingface.co/RajBhope/gpu-runtime-predictor) gives FP32 31.2 and FP16 tensor "
            f"62.5 TFLOPS, used here; if Baseten is right that the A10G's CUDA cores outrun the "
            f"A10's, the FP32 figure is low and an fp32 time errs long; INT8 125 TOPS "
            f"unverified: no A10G INT8 figure found; twice the FP16 tensor figure, the ratio on "
            f"every Ampere card whose table was read (A100: 312 and 624; the A40 datasheet as "
            f"ecer.com copies it: 149.7 and 299.3); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "l4-24gb", "NVIDIA L4 24GB",
        memory_gib=24, tensor_tflops=242 / 2, fp32_tflops=30.3, bandwidth_gb_per_second=300,
        compute_capability=(8, 9), int8_tops=485 / 2,
        source=(
            f"NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, BF16 Tensor Core 242 "
            f"TFLOPS*, INT8 Tensor Core 485 TOPS*, 24GB GDDR6 at 300GB/s; {DENSE}; FP32, BF16 "
            f"and memory checked against the datasheet's text (its copy at cisco.com, "
            f"nvidia-l4-gpu.pdf); INT8 checked against the datasheet's rows as a reseller "
            f"reproduces them (store.sourcecode.com's L4/L40S comparison: INT8 Tensor Core 485 "
            f"TOPS, with sparsity); the 300GB/s bandwidth unverified (spec databases: 300GB/s); "
            f"{CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "l40s-48gb", "NVIDIA L40S 48GB",
        memory_gib=48, tensor_tflops=362.05, fp32_tflops=91.6, bandwidth_gb_per_second=864,
        compute_capability=(8, 9), int8_tops=733,
        source=(
            f"NVIDIA L40S datasheet: FP32 91.6 TFLOPS, BF16 Tensor Core 362.05 | 733* TFLOPS "
            f"(dense printed beside the sparse figure), 48GB GDDR6 at 864GB/s, PCIe Gen4 x16 "
            f"64GB/s; these checked against the datasheet's table as reproduced by mullet.se "
            f"(product 355414, the L40/L40S table, '* With Sparsity') and against {_STAS00} "
            f"(L40S fp32 91.6, bf16 362, 48GB GDDR6 at 0.86TBps); INT8 733 | 1,466* TOPS "
            f"unverified: the copy's INT8 row holds the L40's 362 | 724* and no L40S figure; 733 "
            f"is the L40S's FP8 figure in the same copy (733 | 1,466*), and Ada runs INT8 at its "
            f"FP8 rate (the L40's 362 | 724* for both); spec databases agree (hmc-tech.com: INT8 "
            f"732.86 dense, 1.47 POPS sparse); {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "t4-16gb", "NVIDIA T4 16GB",
        memory_gib=16, tensor_tflops=65, fp32_tflops=8.1, bandwidth_gb_per_second=320,
        compute_capability=(7, 5), int8_tops=130, bf16=False,
        source=(
            f"NVIDIA T4 Tensor Core GPU datasheet: Single-Precision 8.1 TFLOPS, Mixed-Precision "
            f"(FP16/FP32) 65 TFLOPS, INT8 130 TOPS (Turing's tensor cores, dense), 16GB GDDR6, "
            f"PCIe Gen3 x16; FP32, FP16, INT8 and memory checked against NVIDIA's launch figures "
            f"as reported (pc.watch.impress.co.jp/docs/news/1142896.html: FP16 65 TFLOPS, FP16 "
            f"products accumulated in FP32; geektopia.es: 8.1 TFLOPS FP32, 130 TOPS INT8; "
            f"pcnews.ru: 16GB GDDR6, over 320GB/s, PCIe Gen3); the 320GB/s "
            f"unverified (spec databases: 320.0GB/s, sysrqmts.com); {NO_BF16}; {CUDA_GPUS}"
        ),
    ),
    from_datasheet(
        "v100-16gb", "NVIDIA Tesla V100 SXM2 16GB",
        memory_gib=16, tensor_tflops=125, fp32_tflops=15.7, bandwidth_gb_per_second=900,
        compute_capability=(7, 0), int8_tops=None, bf16=False,
        source=_V100_SXM2,
    ),
    from_datasheet(
        "v100-32gb", "NVIDIA Tesla V100 SXM2 32GB",
        memory_gib=32, tensor_tflops=125, fp32_tflops=15.7, bandwidth_gb_per_second=900,
        compute_capability=(7, 0), int8_tops=None, bf16=False,
        source=_V100_SXM2,
    ),
    from_datasheet(
        "v100-pcie-16gb", "NVIDIA Tesla V100 PCIe 16GB",
        memory_gib=16, tensor_tflops=112, fp32_tflops=14, bandwidth_gb_per_second=900,
        compute_capability=(7, 0), int8_tops=None, bf16=False,
        source=_V100_PCIE,
    ),
    from_datasheet(
        "v100-pcie-32gb", "NVIDIA Tesla V100 PCIe 32GB",
        memory_gib=32, tensor_tflops=112, fp32_tflops=14, bandwidth_gb_per_second=900,
        compute_capability=(7, 0), int8_tops=None, bf16=False,
        source=_V100_PCIE,
    ),
)
