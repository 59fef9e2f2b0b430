// The MoE schedule's own small kernels (symmring.moe.gpu.stages): the end of a call, timeline stamps, and the
// test and benchmark hooks.
//
//   moe_end_call     one thread, after every kernel of the call on every stream (a two-stream schedule
//                    joins the streams first): generation base + num_chunks (device-resident, so graph
//                    replays stay fresh).
//   moe_stamp        one thread: stamps[idx] = %globaltimer (the timeline of `bench stream`).
//   moe_sleep        one thread: spin for a given number of ns (tests: a deliberately slow producer or
//                    consumer).
//   moe_spin_probe   the consumer's wait loop on a word nobody sets, for a bounded time, on a chosen number
//                    of blocks (bench stream --spin-check: does spinning slow the producer's kernels?).
#include <stdint.h>

#include <symmring/protocol.cuh>

using namespace symmring;

extern "C" __global__ void moe_end_call(const RingDescriptor* desc_ptr, int num_chunks) {
    if (blockIdx.x == 0 && threadIdx.x == 0) end_call(*desc_ptr, num_chunks);
}

// Runs when the stream's previous kernel ended.
extern "C" __global__ void moe_stamp(unsigned long long* stamps, int idx) {
    if (blockIdx.x == 0 && threadIdx.x == 0) stamps[idx] = globaltimer_ns();
}

// Bounded by its argument.
extern "C" __global__ void moe_sleep(unsigned long long duration_ns) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < duration_ns) __nanosleep(1000);
}

// Thread 0 of every block: ld.acquire.sys of `word`, which nobody sets to `until`, with a %globaltimer
// deadline, for duration_ns. Not part of the layer.
extern "C" __global__ void moe_spin_probe(const unsigned long long* word, unsigned long long until,
                                          unsigned long long duration_ns) {
    if (threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (ld_acquire_sys(reinterpret_cast<const uint64_t*>(word)) != until &&
           globaltimer_ns() - start < duration_ns) {
    }
}
