"""Compile `symmring.moe.engines.triton_small`'s kernel for sm_90 without a GPU: PTX and cubin (Triton's bundled ptxas).

A check the CPU interpreter cannot make: that the GPU compiler accepts the kernel (the split-K path's
atomic, barriers and ``.cg`` loads included) and how much shared memory each configuration takes (the
default rule assumes two split fused-L1 programs fit one SM). Needs torch and triton (the CPU wheels are
enough); a stand-in driver gives Triton the target (cuda, 90, warp size 32) and ``warmup`` compiles without
launching. Written against Triton 3.6::

    python tools/compile_fp8_small.py [--out DIR]   # DIR: one .ptx per configuration

Prints one line per configuration: shared memory, cubin size, and whether the PTX has the split path's
``atom.global.gpu.acq_rel.add``, ``ld.global.cg`` and the promotion's ``fma.rn.f32``.
"""

from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Sm90:
    """Just enough of a driver for ``JITFunction.run(warmup=True)``: the target, device 0, stream 0."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_one(cfg, swiglu: bool, M: int = 1024, K: int = 2048, inter: int = 768, G: int = 8):
    """The compiled kernel of ``cfg`` (fused L1 when ``swiglu``) for CPU stand-ins of the layer's tensors
    (pool scales MN-major, as the layer passes them)."""
    from symmring.moe.engines import triton_small
    _, kernel, tensor_descriptor = triton_small._jit()
    NB = 2 * inter if swiglu else 2048
    n_out = inter if swiglu else NB
    a = torch.empty((M, K), dtype=torch.float8_e4m3fn)
    a_sf = torch.empty((K // 128, M), dtype=torch.float32).t()
    b = torch.empty((G, NB, K), dtype=torch.float8_e4m3fn)
    b_sf = torch.empty((G, NB // 128, K // 128), dtype=torch.float32)
    m_indices = torch.empty(M, dtype=torch.int32)
    if swiglu:
        out = torch.empty((M, inter), dtype=torch.float8_e4m3fn)
        q_sf = torch.empty((inter // 128, M), dtype=torch.float32).t()
    else:
        out = torch.empty((M, n_out), dtype=torch.bfloat16)
        q_sf = None
    a_desc = b_desc = None
    if cfg.tma:
        a_desc = tensor_descriptor(a, [M, K], [a.stride(0), 1], [cfg.block_t, 128])
        b_desc = tensor_descriptor(b, [G * NB, K], [b.stride(1), 1], [cfg.block_n, 128])
    split = cfg.split_k > 1
    partial = torch.empty(1024, dtype=torch.float32) if split else a_sf
    counters = torch.empty(1024, dtype=torch.int32) if split else m_indices
    return kernel.warmup(
        a, a_desc, a_sf, b, b_desc, b_sf, m_indices, out, q_sf if q_sf is not None else a_sf, partial, counters,
        M, n_out, NB, K, 1,
        a.stride(0), a_sf.stride(0), a_sf.stride(1),
        b.stride(0), b.stride(1), b_sf.stride(0), b_sf.stride(1), b_sf.stride(2),
        out.stride(0), q_sf.stride(0) if q_sf is not None else 0, q_sf.stride(1) if q_sf is not None else 0,
        BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, NUM_STAGES=cfg.num_stages, TMA_LOAD=cfg.tma,
        SWIGLU=swiglu, ACCURATE_EXP=True, SPLIT_K=cfg.split_k,
        enable_fp_fusion=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write each configuration's PTX into this directory")
    args = parser.parse_args(argv)
    driver.set_active(_Sm90())
    from symmring.moe.engines.triton_heuristics import SmallConfig
    cases = [(SmallConfig(128, 16, 4, 4), True), (SmallConfig(128, 16, 4, 3, split_k=3), True),
             (SmallConfig(128, 32, 4, 3, split_k=2), True), (SmallConfig(128, 16, 4, 4, split_k=2), True),
             (SmallConfig(128, 16, 4, 4), False), (SmallConfig(64, 16, 4, 4, split_k=2), False),
             (SmallConfig(128, 32, 4, 4, tma=False, split_k=2), False)]
    print(f"triton {triton.__version__}, target sm_90")
    for cfg, swiglu in cases:
        compiled = compile_one(cfg, swiglu)
        ptx = compiled.asm["ptx"]
        kind = "fused" if swiglu else "gemm"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{kind}_{cfg.name}.ptx"), "w") as f:
                f.write(ptx)
        atom = "atom.global.gpu.acq_rel.add" in ptx
        print(f"{kind:<5} {cfg.name:<17} shared {compiled.metadata.shared:>7} B  cubin "
              f"{len(compiled.asm.get('cubin', b'')):>7} B  atom.acq_rel.gpu {atom!s:<5}"
              f"  ld.cg {'ld.global.cg' in ptx!s:<5}  fma.rn.f32 {'fma.rn.f32' in ptx}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
