// The MoE schedule's own small kernels (symmring.moe.gpu.stages): the end of a call, timeline stamps, and the
// test and benchmark hooks.
//
//   moe_end_call     one thread, after every kernel of the call on every stream (a two-stream schedule
//                    joins the streams first): generation base + num_chunks and call number + 1
//                    (device-resident, so graph replays stay fresh).
//   moe_refuse_call  one thread: a call refused on this PE inside a step (its arguments failed a host check no
//                    other rank could see): record kErrorPeerRefused on the layer's ring, which raises every
//                    other PE's abort word (their waits of the call end at once, their outputs are NaN), and
//                    count the call, so this PE's later calls keep their numbers.
//   moe_stamp        one thread: stamps[idx] = %globaltimer (the timeline of `bench stream`).
//   moe_sleep        one thread: spin for a given number of ns (tests: a deliberately slow producer or
//                    consumer).
//   moe_spin_probe   the consumer's wait loop on a word nobody sets, for a bounded time, on a chosen number
//                    of blocks (bench stream --spin-check: does spinning slow the producer's kernels?).
#include <stdint.h>

#include <moe/args.cuh>
#include <symmring/protocol.cuh>

using namespace symmring;
using symmring_moe::EndCallArgs;
using symmring_moe::RefuseCallArgs;
using symmring_moe::StampArgs;
using symmring_moe::SleepArgs;
using symmring_moe::SpinProbeArgs;

extern "C" __global__ void moe_end_call(const EndCallArgs args) {
    if (blockIdx.x == 0 && threadIdx.x == 0) end_call(*args.desc, args.num_chunks);
}

// expected: the refused call's identity (call_identity of this PE's call number and the layer), for the record.
extern "C" __global__ void moe_refuse_call(const RefuseCallArgs args) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const RingDescriptor& d = *args.desc;
    record_error(d, kErrorPeerRefused, d.rank, 0, 0, expected_call(d, args.layer), 0, 0);
    advance_call_number(d);
}

// Runs when the stream's previous kernel ended.
extern "C" __global__ void moe_stamp(const StampArgs args) {
    if (blockIdx.x == 0 && threadIdx.x == 0) args.stamps[args.idx] = globaltimer_ns();
}

// Bounded by its argument.
extern "C" __global__ void moe_sleep(const SleepArgs args) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < args.duration_ns) __nanosleep(1000);
}

// Thread 0 of every block: ld.acquire.sys of `word`, which nobody sets to `until`, with a %globaltimer
// deadline, for duration_ns. Not part of the layer.
extern "C" __global__ void moe_spin_probe(const SpinProbeArgs args) {
    if (threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (ld_acquire_sys(reinterpret_cast<const uint64_t*>(args.word)) != args.until &&
           globaltimer_ns() - start < args.duration_ns) {
    }
}
