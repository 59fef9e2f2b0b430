"""The TMA streaming ceiling of the card with the fused kernel's ring: how fast weights-shaped fp8 rows reach shared
memory when nothing else happens.

Usage (on a GPU machine, from the repository's root; ``PYTHONPATH`` naming it)::

    python tools/tma_stream.py

One block per SM (or two), 384 threads: thread 0 draws items (static, block b takes b, b + grid, ...; or from an
atomic ticket) and issues each K block's TMA boxes into a ring of stages with full/empty mbarriers, as wg64t's
producer does; eight warps wait for each stage and release it. No math, no stores. It prints one line per ring
shape (stages, box rows x boxes per stage, blocks per SM, tickets, K blocks per item) over a 6.5 GB buffer of
7168-byte rows (the DeepSeek-V3-like L1 weights of 221 experts) and a 3.2 GB one of 2048-byte rows (their L2
weights): ms and TB/s. Session 15 (docs/FUSED.md, "Where the rest goes: the epilogue") measured 3.10-3.17 TB/s on an
H100 for every shape, the ceiling that wg64t's probes (tools/fused_probe.py) are read against.
"""
import itertools

import cupy as cp
import numpy as np
import torch

from symmring import jit
from symmring.moe.gpu import tensor_map as tm

SRC = r"""
// symmring-jit: sm_90a
// symmring-jit: whole-program
#include <stdint.h>

struct alignas(64) TensorMap { uint64_t opaque[16]; };

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void load(uint8_t* dst, const TensorMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        ::"r"(smem(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem(bar)), "r"(c0), "r"(c1) : "memory");
}

// Items: row block rb (boxes x box_rows rows) times a run of kb_per_item K blocks.
extern "C" __global__ void __launch_bounds__(384, 1)
tma_stream(const TensorMap* map, int num_kb, int row_blocks, int stages, int box_rows, int boxes, int* ticket,
           int atomic_tickets, int kb_per_item) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) uint8_t ring[];
    const uint32_t stage_bytes = boxes * box_rows * 128;
    uint64_t* full = reinterpret_cast<uint64_t*>(ring + stages * stage_bytes);
    uint64_t* empty = full + stages;
    volatile int* done = reinterpret_cast<volatile int*>(empty + stages);
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            init(&full[s], 1);
            init(&empty[s], 8);  // the eight consumer warps
        }
        *done = 0;
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int runs = num_kb / kb_per_item;
    if (threadIdx.x == 0) {  // the producer
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
        int s = 0;
        uint32_t phase = 0;
        for (int i = 0;; ++i) {
            const int item = atomic_tickets ? atomicAdd(ticket, 1) : blockIdx.x + i * gridDim.x;
            if (item >= row_blocks * runs) break;
            const int rb = item / runs, run = item % runs;
            for (int kb = run * kb_per_item; kb < (run + 1) * kb_per_item; ++kb) {
                wait(&empty[s], phase ^ 1u);
                expect(&full[s], stage_bytes);
                for (int b = 0; b < boxes; ++b)
                    load(ring + s * stage_bytes + b * box_rows * 128, map, &full[s], kb * 128,
                         (rb * boxes + b) * box_rows);
                if (++s == stages) s = 0, phase ^= 1u;
            }
        }
        wait(&empty[s], phase ^ 1u);  // the end: a stage completed by an arrival alone, with done set
        *done = 1;
        __threadfence_block();
        arrive(&full[s]);
    } else if (warp >= 4) {  // the consumers: release each stage once it is full
        int s = 0;
        uint32_t phase = 0;
        for (;;) {
            wait(&full[s], phase);
            if (*done) break;
            __syncwarp();
            if (lane == 0) arrive(&empty[s]);
            if (++s == stages) s = 0, phase ^= 1u;
        }
    }
#endif
}
"""

#: (stages, box rows, boxes per stage, blocks per SM); the first also with atomic tickets and 8-K-block items.
RINGS = ((5, 128, 2, 1), (4, 128, 2, 1), (6, 128, 2, 1), (3, 128, 2, 1), (5, 256, 1, 1), (10, 128, 1, 1),
         (12, 64, 2, 1), (5, 64, 4, 1), (3, 128, 2, 2), (2, 128, 2, 2))


def main():
    kernel = cp.RawModule(path=str(jit.compile_cubin(SRC, name="tma_stream", cc=90))).get_function("tma_stream")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    encode = tm.Encoder()
    for k, rows in ((7168, 221 * 4096), (2048, 221 * 7168)):
        w = torch.randint(0, 255, (rows, k), dtype=torch.uint8, device="cuda")
        gigabytes = rows * k / 1e9
        num_kb = k // 128
        for ring, atomic, per_item in itertools.product(RINGS, (0, 1), (num_kb, 8)):
            if ring != RINGS[0] and (atomic or per_item != num_kb):
                continue
            stages, box_rows, boxes, per_sm = ring
            record = encode(tm.tile_spec("w", w, box_rows))
            map_bytes = torch.from_numpy(np.frombuffer(record.tobytes(), dtype=np.uint8).copy()).cuda()
            ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
            shared = stages * boxes * box_rows * 128 + 2 * stages * 8 + 16
            kernel.max_dynamic_shared_size_bytes = shared
            args = (cp.uint64(map_bytes.data_ptr()), cp.int32(num_kb), cp.int32(rows // (box_rows * boxes)),
                    cp.int32(stages), cp.int32(box_rows), cp.int32(boxes), cp.uint64(ticket.data_ptr()),
                    cp.int32(atomic), cp.int32(per_item))
            times = []
            for _ in range(7):
                ticket.zero_()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kernel((sms * per_sm,), (384,), args, shared_mem=shared)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = sorted(times[2:])[2]  # the median of the last five
            print(f"stream K={k} GB={gigabytes:.2f} stages={stages} box={box_rows}x{boxes} blocks/SM={per_sm} "
                  f"dynamic={atomic} kb/item={per_item}: {ms:.3f} ms, {gigabytes / ms:.2f} TB/s", flush=True)
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
