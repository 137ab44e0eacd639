"""Accelerators the plan knows by name: memory, dense 16-bit matmul peak, memory bandwidth, device-to-device link.

Figures are the vendors' data sheets (dense, i.e. without 2:4 sparsity), with
memory as the CUDA runtime reports it (a little under the marketed GB: an
"80 GB" H100 shows 79.2 GiB). `gpu_spec` resolves `--gpu NAME` or a custom
`--gpu-memory-gb/--gpu-tflops/--gpu-bw-gbs` triple; an unknown name is a
one-line InputError listing the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import InputError

GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """One device: `memory_gib` usable, `tflops` dense bf16/fp16 peak, `bandwidth_gbs` memory GB/s (1e9 bytes),
    `link_gbs` device-to-device GB/s within a node (NVLink; 0: PCIe only), `source` where the figures come from."""

    name: str
    memory_gib: float
    tflops: float
    bandwidth_gbs: float
    link_gbs: float
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


GPUS = {spec.name: spec for spec in (
    GpuSpec("h100-80gb", 79.2, 989.0, 3350.0, 900.0, "NVIDIA H100 SXM5 data sheet"),
    GpuSpec("h100-pcie", 79.2, 756.0, 2000.0, 0.0, "NVIDIA H100 PCIe data sheet"),
    GpuSpec("h200", 139.8, 989.0, 4800.0, 900.0, "NVIDIA H200 SXM data sheet"),
    GpuSpec("a100-80gb", 79.2, 312.0, 2039.0, 600.0, "NVIDIA A100 SXM4 80GB data sheet"),
    GpuSpec("a100-40gb", 39.4, 312.0, 1555.0, 600.0, "NVIDIA A100 SXM4 40GB data sheet"),
    GpuSpec("b200", 178.4, 2250.0, 8000.0, 1800.0, "NVIDIA DGX B200 data sheet, per GPU"),
    GpuSpec("l40s", 44.5, 362.0, 864.0, 0.0, "NVIDIA L40S data sheet"),
)}
DEFAULT_GPU = "h100-80gb"


def gpu_spec(name: str | None, *, memory_gb: float | None = None, tflops: float | None = None,
             bandwidth_gbs: float | None = None) -> GpuSpec:
    """The named device, or a custom one when all three figures are given (GiB, TFLOP/s, GB/s)."""
    custom = (memory_gb, tflops, bandwidth_gbs)
    if any(value is not None for value in custom):
        if name is not None:
            raise InputError(f"--gpu: give a name or --gpu-memory-gb/--gpu-tflops/--gpu-bw-gbs, not both (got {name})")
        if any(value is None for value in custom):
            raise InputError("--gpu-memory-gb/--gpu-tflops/--gpu-bw-gbs: give all three for a custom device "
                             f"(got {memory_gb}, {tflops}, {bandwidth_gbs})")
        for flag, value in zip(("--gpu-memory-gb", "--gpu-tflops", "--gpu-bw-gbs"), custom):
            if not value > 0:
                raise InputError(f"{flag}: must be > 0 (got {value})")
        return GpuSpec("custom", float(memory_gb), float(tflops), float(bandwidth_gbs), 0.0,
                       "given on the command line")
    name = name or DEFAULT_GPU
    if name not in GPUS:
        raise InputError(f"--gpu: unknown device {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory-gb, "
                         "--gpu-tflops and --gpu-bw-gbs)")
    return GPUS[name]
