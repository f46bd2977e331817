"""What this machine can do, and the one place where a kernel path is chosen from it.

CPUs differ from machine to machine (AVX2 only; AVX-512; AVX-512 with VNNI and BF16; AMX;
ARM), and a kernel built for a higher level crashes on a lower one (oneDNN's bfloat16 weight
packing needs AVX-512BW/VL/DQ or AVX-NE-CONVERT). So every choice of a fast path is made here,
from one `Machine`, and every fast path has a fallback that runs anywhere through stock torch
ops. The levels form a ladder, each including the ones below it:

    generic       no x86 SIMD assumed (any CPU, ARM included): scalar C++ or torch ops
    avx2          AVX2 + FMA + F16C (Haswell, Zen 1-3)
    avx512        AVX-512 F/BW/VL/DQ (Skylake-X, Zen 4)
    avx512_vnni   + VNNI int8 dot products (Cascade Lake, Ice Lake, Zen 4)
    avx512_bf16   + native bfloat16 (Cooper Lake, Zen 4, Sapphire Rapids)
    amx           + AMX tiles (Sapphire Rapids and later)

`SPECSERVE_CPU_ISA=<level>` forces a lower level on any machine (a higher one than the CPU has
is capped at what it has; `Machine.describe` names both), so the lower paths are exercised
wherever the suite runs. It
governs specserve's own choices; torch's internal kernels read their own switches at start-up
(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`), which `emulation_env` gives for a level and which
are read here too, so a process started under them behaves as on the lower CPU.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from specserve.errors import InvalidParameterError

ISA_ENV = "SPECSERVE_CPU_ISA"


class Isa(IntEnum):
    GENERIC = 0
    AVX2 = 1
    AVX512 = 2
    AVX512_VNNI = 3
    AVX512_BF16 = 4
    AMX = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str) -> Isa:
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise InvalidParameterError(ISA_ENV, value, f"must be one of {', '.join(i.label for i in cls)}") from None


# /proc/cpuinfo flags each level needs on top of the level below it.
_LEVEL_FLAGS = (
    (Isa.AVX2, {"avx2", "fma", "f16c"}),
    (Isa.AVX512, {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    (Isa.AVX512_VNNI, {"avx512_vnni"}),
    (Isa.AVX512_BF16, {"avx512_bf16"}),
    (Isa.AMX, {"amx_tile", "amx_int8", "amx_bf16"}),
)
# What torch's own dispatch reports (torch.backends.cpu.get_cpu_capability()) caps the level:
# it is lowered by ATEN_CPU_CAPABILITY, and is all there is off Linux.
_TORCH_CAP = {"AVX512": Isa.AMX, "AVX2": Isa.AVX2}


def level_from_flags(flags: set[str] | frozenset[str]) -> Isa:
    """The highest level whose flags (and those of every level below) are all present."""
    level = Isa.GENERIC
    for isa, needed in _LEVEL_FLAGS:
        if not needed <= flags:
            break
        level = isa
    return level


@dataclass(frozen=True, slots=True)
class Machine:
    """This machine as specserve sees it."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    cpu_name: str
    cores: int
    detected: Isa  # what the CPU (and torch's start-up switches) allow
    isa: Isa  # what specserve uses: `detected`, lowered by SPECSERVE_CPU_ISA
    forced: str | None  # the SPECSERVE_CPU_ISA value, when set
    onednn_bf16: bool  # oneDNN can pack and multiply bfloat16 here (torch's own answer)
    cuda: str | None  # name of CUDA device 0, when there is one

    @property
    def native_bf16(self) -> bool:
        """bfloat16 matrix products in hardware: oneDNN's packed bf16 kernels are usable."""
        return self.isa >= Isa.AVX512_BF16 and self.onednn_bf16

    @property
    def vnni(self) -> bool:
        return self.isa >= Isa.AVX512_VNNI

    def describe(self) -> str:
        """One line for load lines and benchmark headers."""
        text = f"{self.cpu_name} ({self.arch}, {self.cores} cpus), CPU path {self.isa.label}"
        if self.forced is not None:
            text += f" (forced by {ISA_ENV}={self.forced}; the CPU has {self.detected.label})"
        if self.cuda:
            text += f", CUDA {self.cuda}"
        return text


def detect(env: Mapping[str, str] | None = None, cpuinfo: str | None = None,
           torch_capability: str | None = None) -> Machine:
    """Read the machine. Arguments stand in for the environment, /proc/cpuinfo and torch's
    capability string in tests; None reads the real ones."""
    env = os.environ if env is None else env
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    if torch_capability is None:
        torch_capability = torch.backends.cpu.get_cpu_capability()
    flags: set[str] = set()
    name = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and not name:
            name = value.strip()
    arch = platform.machine()
    if flags:
        detected = level_from_flags(flags)
    else:  # no /proc/cpuinfo (macOS, Windows): torch's own reading is all there is
        detected = {"AVX512": Isa.AVX512, "AVX2": Isa.AVX2}.get(torch_capability, Isa.GENERIC)
    detected = min(detected, _TORCH_CAP.get(torch_capability, Isa.GENERIC))
    forced = env.get(ISA_ENV) or None
    isa = detected if forced is None else min(detected, Isa.parse(forced))
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return Machine(arch=arch, cpu_name=name or platform.processor() or arch, cores=os.cpu_count() or 1,
                   detected=detected, isa=isa, forced=forced, onednn_bf16=onednn_bf16, cuda=cuda)


@functools.cache
def machine() -> Machine:
    """This process's machine, read once (the switches are read at start-up, as torch's are)."""
    return detect()


def emulation_env(level: Isa | str) -> dict[str, str]:
    """Environment that makes a new process behave as on a CPU of `level`: specserve's switch
    plus torch's own (ATen's vectorised kernels, oneDNN's ISA), which torch reads only at start-up."""
    level = Isa.parse(level) if isinstance(level, str) else level
    aten = {Isa.GENERIC: "default", Isa.AVX2: "avx2"}.get(level, "avx512")
    onednn = {Isa.GENERIC: "SSE41", Isa.AVX2: "AVX2", Isa.AVX512: "AVX512_CORE",
              Isa.AVX512_VNNI: "AVX512_CORE_VNNI", Isa.AVX512_BF16: "AVX512_CORE_BF16"}.get(level, "ALL")
    return {ISA_ENV: level.label, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}


# ---- kernel paths ----------------------------------------------------------------------------

# How weights are computed on: "none" the torch path at a float dtype; "gguf" a quantized GGUF's
# own blocks on the native kernels; "int8" / "int4" (or a block format by name) weights
# quantized at load (Q8_0 / Q4_1) for the native kernels; "auto" picks (see choose_quantization).
LOAD_FORMATS = ("q8_0", "q4_0", "q4_1")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4", *LOAD_FORMATS)


def native_level() -> int | None:
    """The CPU level to run specserve's native kernels at, or None when they are unavailable
    (not built: the reason is printed once by specserve.native.load). AMX also needs the
    operating system to grant the process its tile registers (Linux 5.16+ on request), which
    the kernels ask for; without the grant the level is the one below."""
    from specserve import native

    ext = native.load()
    return None if ext is None else int(min(machine().isa, Isa(ext.top_level())))


def choose_quantization(quantization: str, dtype_given: bool, device: torch.device, quantized_file: bool) -> str:
    """The weight path of a load. "auto": a quantized GGUF runs on its own blocks with the native
    kernels (on a CPU, with the kernels built, no --dtype asked for); everything else on the
    torch path, where an explicit --dtype float32 stays the exact reference. An explicit
    quantization falls back to the torch path only when the kernels are unavailable."""
    if quantization not in QUANTIZATIONS:
        raise InvalidParameterError("quantization", quantization, f"must be one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return "none"
    if quantization == "auto":
        if dtype_given or not quantized_file or device.type != "cpu":
            return "none"
        quantization = "gguf"
    if dtype_given:
        raise InvalidParameterError("dtype", "given with quantization", f"the {quantization} path computes with float32 "
                                    "activations of its own; leave --dtype out, or use --quantization none")
    if device.type != "cpu":
        raise InvalidParameterError("quantization", quantization, f"the native kernels run on the CPU; on {device} "
                                    "use --quantization none")
    if quantization == "gguf" and not quantized_file:
        raise InvalidParameterError("quantization", quantization, "needs a quantized GGUF file; for float weights "
                                    "use int8 or int4")
    return quantization if native_level() is not None else "none"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN-prepacked linears (model/linear.py) run here: on a CPU with oneDNN, in
    float32 on any CPU, in bfloat16 only with native bf16 (its packing refuses other CPUs)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and machine().native_bf16


def torch_path(device: torch.device, dtype: torch.dtype) -> str:
    """How the torch path multiplies in this dtype here, for load lines and benchmark headers."""
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return f"{dtype_name} torch on {device}"
    how = "oneDNN-packed linears" if can_pack(device, dtype) else "torch generic linears"
    return f"{dtype_name} {how}, CPU path {machine().isa.label}"


def bf16_notice(device: torch.device, dtype: torch.dtype) -> str | None:
    """The one line to print when bfloat16 is asked for on a CPU without native bfloat16: it
    works, through torch's generic kernels, unpacked."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not machine().native_bf16:
        return (f"note: this CPU path ({machine().isa.label}) has no native bfloat16: products run through torch's "
                "generic kernels (no faster than float32 here)")
    return None


def drafter_dtype(saved: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a trained drafter drafts in: its saved one, except bfloat16 on a CPU without
    native bfloat16, where float32 is the faster path (the verifier keeps the output exact
    whatever the drafter computes in)."""
    if device.type == "cpu" and saved == torch.bfloat16 and not machine().native_bf16:
        return torch.float32
    return saved


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """Mixed precision for training: bfloat16 where the hardware has it, else None (float32):
    emulated bfloat16 autocast on CPU is ~10x slower than float32 (conversions on every op)."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if machine().native_bf16 else None
