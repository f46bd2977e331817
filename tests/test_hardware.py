"""The machine reading and the kernel-path choices made from it (pure Python, fake machines)."""

import subprocess
import sys

import pytest
import torch

from specserve import hardware
from specserve.errors import InvalidParameterError
from specserve.hardware import Isa, detect, emulation_env, level_from_flags

EPYC_AVX2 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n"
EPYC_AVX512 = ("model name\t: AMD EPYC 9B14\nflags\t\t: avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl "
               "avx512_vnni avx512_bf16\n")
SPR = EPYC_AVX512.replace("AMD EPYC 9B14", "Intel Xeon").replace("avx512_bf16", "avx512_bf16 amx_tile amx_int8 amx_bf16")


@pytest.mark.parametrize("flags, level", [
    ("", Isa.GENERIC), ("avx avx2 fma", Isa.GENERIC), ("avx2 fma f16c", Isa.AVX2),
    ("avx2 fma f16c avx512f avx512bw avx512vl", Isa.AVX2),  # no DQ: not the AVX-512 level
    ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq", Isa.AVX512),
    ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16", Isa.AVX512),  # bf16 without VNNI
    ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni", Isa.AVX512_VNNI),
])
def test_levels_need_every_flag_of_the_levels_below(flags, level):
    assert level_from_flags(set(flags.split())) == level


def test_avx2_only_epyc_and_an_avx512_one():
    low = detect(env={}, cpuinfo=EPYC_AVX2, torch_capability="AVX2")
    assert (low.detected, low.isa, low.cpu_name) == (Isa.AVX2, Isa.AVX2, "AMD EPYC 7B13")
    high = detect(env={}, cpuinfo=EPYC_AVX512, torch_capability="AVX512")
    assert high.isa == Isa.AVX512_BF16 and high.vnni
    assert detect(env={}, cpuinfo=SPR, torch_capability="AVX512").isa == Isa.AMX
    # torch started under ATEN_CPU_CAPABILITY=avx2 caps the level: its kernels run as on AVX2.
    assert detect(env={}, cpuinfo=SPR, torch_capability="AVX2").isa == Isa.AVX2


def test_arm_and_unknown_cpus_take_the_generic_path():
    arm = detect(env={}, cpuinfo="processor\t: 0\nFeatures\t: fp asimd\n", torch_capability="DEFAULT")
    assert arm.isa == Isa.GENERIC and not arm.native_bf16 and not arm.vnni
    assert detect(env={}, cpuinfo="", torch_capability="AVX2").isa == Isa.AVX2  # no /proc/cpuinfo: torch's word


def test_forcing_lowers_and_never_raises_the_level():
    m = detect(env={"SPECSERVE_CPU_ISA": "avx2"}, cpuinfo=EPYC_AVX512, torch_capability="AVX512")
    assert (m.detected, m.isa, m.forced) == (Isa.AVX512_BF16, Isa.AVX2, "avx2")
    assert not m.native_bf16
    assert "forced by SPECSERVE_CPU_ISA=avx2" in m.describe() and "has avx512_bf16" in m.describe()
    assert detect(env={"SPECSERVE_CPU_ISA": "generic"}, cpuinfo=EPYC_AVX512, torch_capability="AVX512").isa == Isa.GENERIC
    capped = detect(env={"SPECSERVE_CPU_ISA": "amx"}, cpuinfo=EPYC_AVX2, torch_capability="AVX2")
    assert capped.isa == Isa.AVX2


def test_a_bad_forced_level_names_the_allowed_ones():
    with pytest.raises(InvalidParameterError, match="SPECSERVE_CPU_ISA.*avx9.*generic, avx2, avx512"):
        detect(env={"SPECSERVE_CPU_ISA": "avx9"}, cpuinfo=EPYC_AVX512, torch_capability="AVX512")


def test_emulation_env_caps_torch_too():
    assert emulation_env("avx2") == {"SPECSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                     "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert emulation_env(Isa.GENERIC)["ATEN_CPU_CAPABILITY"] == "default"


def test_paths_chosen_on_a_cpu_without_native_bf16(monkeypatch):
    low = detect(env={}, cpuinfo=EPYC_AVX2, torch_capability="AVX2")
    monkeypatch.setattr(hardware, "machine", lambda: low)
    cpu = torch.device("cpu")
    assert hardware.can_pack(cpu, torch.float32)
    assert not hardware.can_pack(cpu, torch.bfloat16)
    assert hardware.drafter_dtype(torch.bfloat16, cpu) == torch.float32
    assert hardware.drafter_dtype(torch.float32, cpu) == torch.float32
    assert hardware.autocast_dtype(cpu) is None
    assert "no native bfloat16" in hardware.bf16_notice(cpu, torch.bfloat16)
    assert hardware.bf16_notice(cpu, torch.float32) is None
    assert "torch generic linears" in hardware.torch_path(cpu, torch.bfloat16)


def test_a_process_under_avx2_emulation_sees_an_avx2_machine():
    code = ("from specserve.hardware import machine; m = machine(); "
            "print(m.isa.label, m.native_bf16, m.forced)")
    env = {**__import__("os").environ, **emulation_env("avx2")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["avx2", "False", "avx2"]
