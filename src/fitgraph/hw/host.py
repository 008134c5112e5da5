"""This machine's CPU in the accelerator template, so that the GEMM model can be compared with
GEMMs measured here (``bench.gemm_sweep``).

Each core is one output-stationary "array" of its FMA units × their FP32 lanes (AVX-512: 16,
AVX2: 8; two FMA units per core, as every Intel server core since Skylake-SP and AMD's since
Zen 2 — an assumption the kernel cannot report); its L2 is the SRAM the kernels block into,
one 64-byte line per cycle each way (Intel's and AMD's L2 bandwidth); DRAM is the "HBM", at
``cost.devices``'s cpu-generic figure of 10 GB/s per core (STREAM on server cores); the clock is
what the kernel reports (``cpu MHz``, the nominal one in a VM: turbo is not seen).

Example:
    >>> chip = host_chip(cores=1)
    >>> chip.tensor_cores, chip.dataflow
    (1, 'output-stationary')
"""

from __future__ import annotations

import os
import re

from .chip import Chip, GiB, KiB, MiB

__all__ = ["host_chip"]

FMA_UNITS = 2
DRAM_PER_CORE = 10e9


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _l2_bytes() -> int:
    path = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(path)):
            with open(f"{path}/{index}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{path}/{index}/size") as f:
                size = f.read().strip()
            unit = {"K": KiB, "M": MiB}.get(size[-1], 1)
            return int(size.rstrip("KM")) * unit
    except OSError:
        pass
    return 1 * MiB


def host_chip(cores: int = 1) -> Chip:
    """``cores`` cores of this machine's CPU as a ``Chip``."""
    info = _cpuinfo()
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split()) if info else set()
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
    clock = float(mhz.group(1)) * 1e6 if mhz else 2.5e9
    l2 = _l2_bytes()
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    return Chip(
        name="host-cpu", tensor_cores=cores, array_rows=FMA_UNITS, array_cols=lanes,
        vector_cores=cores, vector_lanes=FMA_UNITS * lanes, sram_bytes=l2 * cores,
        hbm_bytes=8 * GiB, hbm_bandwidth=DRAM_PER_CORE * cores, clock_hz=clock, links=1,
        link_bandwidth=1e9, topology="switch", dataflow="output-stationary",
        sram_bank_bytes=l2, sram_port_bytes=64,
        description=f"{name.group(1).strip() if name else 'this CPU'}: {cores} core(s), "
                    f"{FMA_UNITS} FMA x {lanes} FP32 lanes at {clock / 1e9:.2f} GHz, "
                    f"L2 {l2 // KiB} KiB per core")
