// The device-visible ring descriptor. Mirrors symmring/layout.py: DESCRIPTOR_DTYPE field by field
// (tests/test_layout.py compiles this header with the host compiler and compares every offset and the
// size, so editing one side alone fails CI). Plain C layout, includable from host C/C++ and from CUDA.
#pragma once
#include <stdint.h>

namespace symmring {

// Values of RingDescriptor::x_format (layout.X_FORMATS).
enum XFormat : int32_t { kXFormatFp8E4M3 = 0, kXFormatBf16 = 1 };

// Columns of the per-slot metadata rows (layout.META_*). kMetaCallId: the identity of the call that wrote the
// slot (call_identity in protocol.cuh: call number and layer), compared by every consumer with its own.
enum MetaColumn : int32_t { kMetaTokenBase = 0, kMetaNumValid = 1, kMetaChunkIdx = 2, kMetaPayloadGen = 3,
                            kMetaCallId = 4, kMetaColumns = 5 };

// Device error record (layout.ERROR_*): words and kinds.
enum ErrorWord : int32_t { kErrKind = 0, kErrRank = 1, kErrPeer = 2, kErrSlot = 3, kErrChunk = 4,
                           kErrExpected = 5, kErrObserved = 6, kErrMissing = 7, kErrorWords = 8 };
// Timeouts (route, layout, reuse, combine); kErrorAborted: a wait of this PE gave up because another PE
// raised the ring's abort word; kErrorStalePayload: a slot's meta row did not name the awaited chunk and
// generation after its readiness was acquired; kErrorDoubleAck: this PE's acknowledgement bit was already
// set in the owner's mask when it acknowledged; kErrorCallMismatch: a slot's meta row named another call
// (number or layer) than the consumer's own, the ranks' call sequences diverged; kErrorPeerRefused: this PE
// refused its call inside a step (the host found its arguments bad where no other rank could see them);
// kErrorPoolOverflow: a MoE kernel found more rows (or a token further) than its plan bounded and wrote
// none past its buffer (device/moe/bounds.cuh).
enum ErrorKind : int64_t { kErrorNone = 0, kErrorRoute = 1, kErrorLayout = 2, kErrorReuse = 3,
                           kErrorCombine = 4, kErrorAborted = 5, kErrorStalePayload = 6, kErrorDoubleAck = 7,
                           kErrorCallMismatch = 8, kErrorPeerRefused = 9, kErrorPoolOverflow = 10 };

// The abort word (layout.ABORT_*): one uint64 per PE, 0 while the ring runs. A PE that records a device
// error stores (1 << kAbortFlagShift) | kind << kAbortKindShift | origin << kAbortOriginShift |
// peer << kAbortPeerShift | chunk << kAbortChunkShift into every other PE's word (first abort wins there);
// origin and peer are kAbortFieldBits wide, the kind 7 bits, the chunk 24 bits (saturated at kAbortChunkMax).
enum AbortWord : int32_t { kAbortChunkShift = 0, kAbortPeerShift = 24, kAbortOriginShift = 40, kAbortKindShift = 56,
                           kAbortFlagShift = 63, kAbortFieldBits = 16, kAbortChunkMax = (1 << 24) - 1 };

struct RingDescriptor {
    // Local addresses of the regions of this PE's ring allocation. Offsets are identical on every PE
    // (symmetric heap), so a peer's copy is nvshmem_ptr(ptr, pe).
    uint64_t x_ptr;             // [S][T][H] fp8 e4m3 (uint8) or bf16 (uint16), slot stride x_slot_stride
    uint64_t x_sf_ptr;          // [S][T][num_sf] float, slot stride x_sf_slot_stride
    uint64_t topk_idx_ptr;      // [S][T][K] int32, slot stride topk_slot_stride
    uint64_t topk_weights_ptr;  // [S][T][K] float, slot stride topk_slot_stride
    uint64_t meta_ptr;          // [S][kMetaColumns] int64
    uint64_t route_ready_ptr;   // [S] uint64 generation signals
    uint64_t layout_ready_ptr;  // [S] uint64 generation signals
    uint64_t ack_mask_ptr;      // [S][mask_words] uint64 acknowledgement bits
    uint64_t gen_base_ptr;      // [1] uint64: expected generation of chunk c is *gen_base_ptr + c + 1
    uint64_t call_ptr;          // [1] uint64 call counter: the number of this PE's current call (call_identity);
                                // the ring's own word, or a word every ring of a workspace shares
    uint64_t error_ptr;         // [kErrorWords] int64 error record
    uint64_t abort_ptr;         // [1] uint64 abort word (AbortWord), written by other PEs
    uint64_t rdma_mask_ptr;     // [mask_words] uint64, local memory (not symmetric): bit q % 64 of word
                                // q / 64 set when peer q is reached by NVSHMEM one-sided operations
                                // (transport rdma) instead of nvshmem_ptr loads/stores; 0: no rdma peer
    uint64_t x_slot_stride;     // bytes
    uint64_t x_sf_slot_stride;  // bytes
    uint64_t topk_slot_stride;  // bytes (topk_idx and topk_weights)
    uint64_t timeout_ns;        // bound of every wait; 0 means the library default
    int32_t num_slots;
    int32_t tokens_per_slot;
    int32_t hidden;
    int32_t num_topk;
    int32_t num_experts;
    int32_t num_sf;             // scales per token (0 for bf16)
    int32_t sf_group_size;
    int32_t x_format;           // XFormat
    int32_t x_elem_bytes;
    int32_t rank;
    int32_t num_ranks;
    int32_t mask_words;
};

}  // namespace symmring
