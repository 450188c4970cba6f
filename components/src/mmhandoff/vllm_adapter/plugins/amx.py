"""vLLM plugin (entry point `vllm.general_plugins`): on CPUs with AMX, a vLLM process asks the
kernel for the AMX tile state before vLLM's attention kernel uses it.

vLLM's CPU attention picks its AMX kernel when the CPU reports AMX (bf16, blocks of a multiple
of 32 tokens). Linux hands a process the AMX tile registers only after it asks
(`arch_prctl(ARCH_REQ_XCOMP_PERM)`); an AMX instruction before that dies with SIGILL. oneDNN asks
on its own, so an engine whose first AMX use is a oneDNN matmul works, but a decode engine whose
first step attends over pulled KV runs vLLM's kernel first: its worker died with "Illegal
instruction" at the first handoff (seen on a Sapphire-Rapids-class CI host, 2026-12-05). Asking
once per process at plugin load is cheap and idempotent; CPUs without AMX and GPU hosts are left
alone.
"""

from __future__ import annotations


def install() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        raise RuntimeError("the CPU reports AMX but the kernel refused the AMX tile state "
                           "(arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's AMX attention would die "
                           "with SIGILL")
