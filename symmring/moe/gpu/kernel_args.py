"""The MoE kernels' argument structs on the host: a NumPy dtype per struct of ``device/moe/args.cuh``, field by
field, and `KernelArgs`, the record a launcher fills by name and passes as the kernel's one argument.

Every kernel of ``device/moe/`` takes one struct by value (`KERNELS` names it). CuPy passes a one-element NumPy
array by value, its bytes as they are (CuPy 13.6 and 14 alike; a structured NumPy scalar only from 14 on), so a
record's bytes are the kernel's parameter. Two checks hold the host and the device together:

* CI: ``tests/test_kernel_args.py`` compiles ``args.cuh`` with the host compiler and compares every struct's
  size and every field's name, order, offset, size and kind with `STRUCTS`, both ways;
* load time: `check_device_layout` (run by `symmring.moe.gpu.stages.Kernels`) compiles static assertions of
  these dtypes' sizes and offsets against the header with nvcc and the library's options; any disagreement is
  `symmring.errors.KernelArgsMismatch`, naming the struct and field, before a kernel runs.

Cost: a launcher's record is made once per layer state with the fields the state fixes (its buffers' addresses,
the expert range), and a call sets only its own fields (chunk, window bounds, tensors) by name, through typed
views of the record's bytes.

Example:
    >>> args = KernelArgs(STRUCTS["ChunkArgs"], per_call=("chunk_idx",), desc=0xD000)
    >>> (param,) = args.set(chunk_idx=3)
    >>> param.shape, param.dtype.itemsize, int(args.record["chunk_idx"]), hex(int(args.record["desc"]))
    ((1,), 16, 3, '0xd000')
"""

from __future__ import annotations

import functools
import keyword
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ...errors import CompileError, KernelArgsMismatch

#: A device address (a pointer field).
PTR = np.dtype(np.uint64)
I32, I64, U64, F32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.float32)


def _struct(fields: List[Tuple[str, np.dtype]]) -> np.dtype:
    """A C struct's dtype: fields in order, each at its natural alignment (``align=True``: C's layout rule)."""
    return np.dtype(fields, align=True)


def _struct_aligned(fields: List[Tuple[str, np.dtype]], alignment: Dict[str, int]) -> np.dtype:
    """`_struct` where some fields' types are ``alignas(n)`` (``alignment``: field name -> n) and so is the struct:
    NumPy knows no alignment beyond a type's own, so the offsets are C's rule, written out."""
    names, formats, offsets, offset, struct_align = [], [], [], 0, 1
    for name, dtype in fields:
        align = max(dtype.alignment, alignment.get(name, 1))
        offset = -(-offset // align) * align
        names.append(name), formats.append(dtype), offsets.append(offset)
        offset, struct_align = offset + dtype.itemsize, max(struct_align, align)
    itemsize = -(-offset // struct_align) * struct_align
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})


#: The structs of device/moe/args.cuh, by their C name, in the header's order.
STRUCTS: Dict[str, np.dtype] = {}
STRUCTS["RouterOptions"] = _struct([
    ("bias", PTR), ("routed_scaling_factor", F32), ("scoring", I32), ("num_experts", I32), ("topk", I32),
    ("n_group", I32), ("topk_group", I32), ("norm_topk_prob", I32)])
STRUCTS["PassRows"] = _struct([("entry_rows", PTR), ("pass_begin", I32), ("pass_rows", I32)])
STRUCTS["ChunkArgs"] = _struct([("desc", PTR), ("chunk_idx", I32)])
STRUCTS["ProduceRouteArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("topk_idx", PTR), ("topk_weights", PTR), ("num_valid", I32),
    ("call_tokens", PTR), ("counter", PTR), ("layer", I32)])
STRUCTS["ProduceLayoutArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("x", PTR), ("x_row_stride", I64), ("num_valid", I32), ("call_tokens", PTR),
    ("counter", PTR)])
STRUCTS["ProduceChunkArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("topk_idx", PTR), ("topk_weights", PTR), ("x", PTR), ("x_row_stride", I64),
    ("num_valid", I32), ("call_tokens", PTR), ("counter", PTR), ("layer", I32), ("logits", PTR),
    ("logits_dtype", I32), ("logits_stride", I64), ("router", STRUCTS["RouterOptions"])])
STRUCTS["RouteTopkArgs"] = _struct([
    ("logits", PTR), ("logits_dtype", I32), ("logits_stride", I64), ("num_tokens", I32), ("topk_idx", PTR),
    ("topk_weights", PTR), ("router", STRUCTS["RouterOptions"])])
STRUCTS["DispatchWaitArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("parts", I32), ("counts", PTR), ("num_local_experts", I32),
    ("token_base", PTR), ("clear_counts", I32), ("layer", I32)])
STRUCTS["DispatchStageArgs"] = _struct([
    ("desc", PTR), ("stage", PTR), ("chunk_idx", I32), ("parts", I32), ("wait", I32)])
STRUCTS["DispatchCountArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("counts", PTR), ("expert_begin", I32), ("num_local_experts", I32),
    ("status", PTR), ("bad_id", PTR), ("stage", PTR)])
STRUCTS["DispatchScanArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("counts", PTR), ("begin", PTR), ("group_end", PTR), ("cursor", PTR),
    ("total", PTR), ("num_local_experts", I32), ("align", I32), ("expert_begin", I32), ("window_rows", I32),
    ("rows_per_expert", I32)])
STRUCTS["DispatchPullArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("cursor", PTR), ("pool_x", PTR), ("row_src", PTR), ("row_weight", PTR),
    ("expert_begin", I32), ("num_local_experts", I32), ("status", PTR), ("stage", PTR),
    ("pass", STRUCTS["PassRows"])])
STRUCTS["DispatchPullFp8Args"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("cursor", PTR), ("pool_x", PTR), ("pool_sf", PTR), ("sf_row_stride", I64),
    ("sf_col_stride", I64), ("m_indices", PTR), ("row_src", PTR), ("row_weight", PTR), ("expert_begin", I32),
    ("num_local_experts", I32), ("status", PTR), ("stage", PTR), ("pass", STRUCTS["PassRows"])])
STRUCTS["DispatchFusedArgs"] = _struct([
    ("desc", PTR), ("chunk_idx", I32), ("token_base", PTR), ("expert_counts", PTR), ("begin", PTR),
    ("group_end", PTR), ("total", PTR), ("pool_x", PTR), ("pool_sf", PTR), ("sf_row_stride", I64),
    ("sf_col_stride", I64), ("m_indices", PTR), ("row_src", PTR), ("row_weight", PTR), ("expert_begin", I32),
    ("num_local_experts", I32), ("align", I32), ("status", PTR), ("bad_id", PTR), ("ack_now", I32),
    ("counter", PTR), ("stage", PTR), ("pool_rows", I32), ("rows_per_expert", I32), ("layer", I32),
    ("plan", PTR)])
STRUCTS["CombineScatterArgs"] = _struct([
    ("desc", PTR), ("pool_out", PTR), ("row_src", PTR), ("total", PTR), ("token_base", PTR), ("window_begin", I32),
    ("m_indices", PTR), ("combine_rows", PTR), ("pass_begin", I32), ("pass_rows", I32), ("combine_tokens", I32),
    ("rows_sent", I32)])
STRUCTS["CombineSignalArgs"] = _struct([
    ("desc", PTR), ("chunk_begin", I32), ("chunk_end", I32), ("combine_ready", PTR), ("ack_now", I32)])
STRUCTS["CombineWaitArgs"] = _struct([("desc", PTR), ("chunk_idx", I32), ("combine_ready", PTR)])
STRUCTS["CombineReduceArgs"] = _struct([
    ("desc", PTR), ("combine_rows", PTR), ("topk_idx", PTR), ("topk_weights", PTR), ("y", PTR),
    ("y_row_stride", I64), ("token_begin", I32), ("num_valid", I32), ("call_tokens", PTR),
    ("end_call_chunks", I32)])
STRUCTS["CombineFusedArgs"] = _struct([
    ("desc", PTR), ("pool_out", PTR), ("row_src", PTR), ("expert_counts", PTR), ("begin", PTR),
    ("num_local_experts", I32), ("token_base", PTR), ("m_indices", PTR), ("combine_rows", PTR), ("chunk_idx", I32),
    ("combine_ready", PTR), ("ack_now", I32), ("topk_idx", PTR), ("topk_weights", PTR), ("y", PTR),
    ("y_row_stride", I64), ("token_begin", I32), ("num_valid", I32), ("call_tokens", PTR),
    ("end_call_chunks", I32), ("counters", PTR), ("pool_rows", I32), ("combine_tokens", I32), ("rows_sent", I32)])
STRUCTS["FusedExpertsArgs"] = _struct([
    ("pool_x", PTR), ("pool_sf", PTR), ("sf_row_stride", I64), ("sf_col_stride", I64), ("m_indices", PTR),
    ("w13", PTR), ("w13_sf", PTR), ("w_down", PTR), ("w_down_sf", PTR), ("act", PTR), ("act_sf", PTR),
    ("out", PTR), ("counters", PTR), ("bad_groups", PTR), ("status", PTR), ("timeout_ns", U64),
    ("num_rows", I32), ("hidden", I32), ("inter", I32), ("num_local_experts", I32), ("m_blocks_per_group", I32),
    ("row_src", PTR), ("token_base", PTR), ("send_peers", PTR), ("combine_tokens", I64), ("window_begin", I32),
    ("num_ranks", I32), ("num_topk", I32), ("weights_evict_first", I32), ("dispatch_plan", PTR)])
#: A CUtensorMap's bytes (``alignas(64)`` in the header: `TENSOR_MAP_ALIGN`, which `_struct_aligned` applies).
STRUCTS["TensorMap"] = _struct([("opaque", np.dtype((U64, (16,))))])
TENSOR_MAP_ALIGN = 64
STRUCTS["FusedExpertsTmaArgs"] = _struct_aligned(
    [("experts", STRUCTS["FusedExpertsArgs"]), ("pool_x_map", STRUCTS["TensorMap"]), ("act_map", STRUCTS["TensorMap"]),
     ("w13_map", STRUCTS["TensorMap"]), ("w_down_map", STRUCTS["TensorMap"]), ("pool_sf_map", STRUCTS["TensorMap"]),
     ("act_sf_map", STRUCTS["TensorMap"])],
    {name: TENSOR_MAP_ALIGN for name in ("pool_x_map", "act_map", "w13_map", "w_down_map", "pool_sf_map", "act_sf_map")})
STRUCTS["FusedDivProbeArgs"] = _struct([("a", PTR), ("b", PTR), ("q", PTR), ("n", I32)])
STRUCTS["EndCallArgs"] = _struct([("desc", PTR), ("num_chunks", I32)])
STRUCTS["RefuseCallArgs"] = _struct([("desc", PTR), ("layer", I32)])
STRUCTS["StampArgs"] = _struct([("stamps", PTR), ("idx", I32)])
STRUCTS["SleepArgs"] = _struct([("duration_ns", U64)])
STRUCTS["SpinProbeArgs"] = _struct([("word", PTR), ("until", U64), ("duration_ns", U64)])

#: Every kernel of device/moe/ and the struct it takes (its only parameter).
KERNELS: Dict[str, str] = {
    "moe_wait_slot": "ChunkArgs", "moe_produce_route": "ProduceRouteArgs",
    "moe_produce_layout_fp8": "ProduceLayoutArgs", "moe_produce_layout_bf16": "ProduceLayoutArgs",
    "moe_produce_chunk_fp8": "ProduceChunkArgs", "moe_route_topk": "RouteTopkArgs",
    "moe_dispatch_wait": "DispatchWaitArgs", "moe_dispatch_stage": "DispatchStageArgs",
    "moe_dispatch_count": "DispatchCountArgs", "moe_dispatch_scan": "DispatchScanArgs",
    "moe_dispatch_pull": "DispatchPullArgs", "moe_dispatch_pull_fp8": "DispatchPullFp8Args",
    "moe_dispatch_ack": "ChunkArgs", "moe_dispatch_fused_fp8": "DispatchFusedArgs",
    "moe_dispatch_fused_fp8_small": "DispatchFusedArgs",
    "moe_combine_scatter": "CombineScatterArgs", "moe_combine_signal": "CombineSignalArgs",
    "moe_combine_wait": "CombineWaitArgs", "moe_combine_reduce": "CombineReduceArgs",
    "moe_combine_fused": "CombineFusedArgs", "moe_end_call": "EndCallArgs", "moe_refuse_call": "RefuseCallArgs",
    "moe_fused_experts_m16": "FusedExpertsArgs", "moe_fused_experts_m32": "FusedExpertsArgs",
    "moe_fused_experts_wg64": "FusedExpertsArgs", "moe_fused_experts_wg64t": "FusedExpertsTmaArgs",
    "moe_fused_experts_wg128t": "FusedExpertsTmaArgs",
    "moe_fused_div_probe": "FusedDivProbeArgs",
    "moe_stamp": "StampArgs", "moe_sleep": "SleepArgs", "moe_spin_probe": "SpinProbeArgs",
}

#: ``struct`` format characters of the scalar field kinds (a field is set through a view of this format).
_FORMATS = {"u8": "Q", "i4": "i", "i8": "q", "f4": "f"}


def address(value) -> int:
    """A device address: a torch tensor's ``data_ptr()``, a CuPy array's ``data.ptr``, an int (or NumPy integer)
    as it is; 0 for None (a null pointer)."""
    if value is None:
        return 0
    if hasattr(value, "data_ptr"):
        return int(value.data_ptr())
    data = getattr(value, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return int(data.ptr)
    return int(value)


class KernelArgs:
    """One kernel's argument record: its struct's bytes, the fields fixed when made, the rest set by name per call.

    Args:
        dtype: the struct's dtype (`STRUCTS`).
        per_call: the fields each call sets (every one, every call), in the order they are set; ``outer__inner``
            names field ``inner`` of struct field ``outer`` (``router`` then ``router__topk``: the struct, then one
            of its own fields).
        **fixed: the value of every other field (pointer fields: `address` values; a struct field: a record of
            its dtype).

    `set` (keyword arguments: exactly the ``per_call`` fields) sets them and returns the launch's argument tuple:
    the record as a one-element array (CuPy and `symmring.pdl` pass its bytes by value). The record is reused by
    the next `set`, so launch before setting it again (a launch copies its parameters). `set` is a function made
    for these fields, writing each through a typed view of the record's bytes: a tenth of a loop over NumPy
    field assignments, a launch's host cost.

    Raises:
        TypeError: ``fixed`` and ``per_call`` do not cover the struct's fields exactly once; `set` given other
            fields than ``per_call`` (Python's own message for a missing or unknown keyword argument), or a
            struct field a record of another struct.
        OverflowError / ValueError: a value does not fit its field.
    """

    __slots__ = ("dtype", "record", "param", "set")

    def __init__(self, dtype: np.dtype, per_call: Sequence[str] = (), **fixed):
        leaves = _leaves(dtype)
        call_leaves = {leaf for name in per_call for leaf in _covered(leaves, name)}
        fixed_leaves = [leaf for name in fixed for leaf in _covered(leaves, name)]
        if sorted(fixed_leaves + sorted(call_leaves)) != sorted(leaves) or len(set(per_call)) != len(per_call):
            raise TypeError(f"KernelArgs: fields {leaves} must each be fixed or per call, once; got fixed "
                            f"{sorted(fixed)} and per call {list(per_call)}")
        self.dtype = dtype
        self.record = np.zeros((), dtype)
        #: The record's bytes as the launch's argument (a view: setting a field changes it).
        self.param = self.record.reshape(1).view(np.dtype((np.void, dtype.itemsize)))
        for name, value in fixed.items():
            self.record[name] = value
        self.set = _setter(self.record, (self.param,), per_call)


def _covered(leaves: List[str], name: str) -> List[str]:
    """The scalar fields (`_leaves`) a field name sets: itself, or every field of a struct field."""
    dotted = name.replace("__", ".")
    return [leaf for leaf in leaves if leaf == dotted or leaf.startswith(dotted + ".")]


def _setter(record: np.ndarray, result: tuple, names: Sequence[str]):
    """A function of keyword arguments ``names`` that writes each into ``record`` (in that order) and returns
    ``result``: the fields' views of the record's bytes bound in its namespace, so a call is a few stores."""
    raw = memoryview(record.reshape(1).view(np.uint8))
    namespace = {"_result": result, "_struct_bytes": _struct_bytes}
    body = []
    for i, name in enumerate(names):
        if not name.isidentifier() or keyword.iskeyword(name):
            raise TypeError(f"KernelArgs: {name!r} cannot be set per call: not an identifier (a struct field's "
                            "field is outer__inner)")
        field, offset = _field(record.dtype, name.replace("__", "."))
        view = raw[offset: offset + field.itemsize]
        fmt = _FORMATS.get(field.str[1:])
        if fmt is not None:
            namespace[f"_v{i}"] = view.cast(fmt)
            body.append(f"    _v{i}[0] = {name}")
        else:  # a struct field: the bytes of a record of its dtype
            namespace[f"_v{i}"], namespace[f"_d{i}"] = view, field
            body.append(f"    _v{i}[:] = _struct_bytes({name}, _d{i}, {name!r})")
    params = f"*, {', '.join(names)}" if names else ""
    exec(f"def set({params}):\n" + "\n".join(body + ["    return _result"]), namespace)  # noqa: S102
    return namespace["set"]


def _struct_bytes(value, dtype: np.dtype, name: str) -> bytes:
    if getattr(value, "dtype", None) != dtype:
        raise TypeError(f"KernelArgs: {name}={value!r}: expected a record of {dtype}")
    return value.tobytes()


def _leaves(dtype: np.dtype, prefix: str = "") -> List[str]:
    """The scalar fields of ``dtype``, a struct field's as ``"outer.inner"``."""
    out = []
    for name in dtype.names:
        field = dtype.fields[name][0]
        out += _leaves(field, f"{prefix}{name}.") if field.names else [prefix + name]
    return out


def _field(dtype: np.dtype, name: str) -> Tuple[np.dtype, int]:
    """``(dtype, offset)`` of field ``name`` of ``dtype``; ``"outer.inner"`` names a field of a struct field."""
    outer, _, inner = name.partition(".")
    if dtype.names is None or outer not in dtype.names:
        raise TypeError(f"KernelArgs: no field {name!r} in {dtype}")
    field, offset = dtype.fields[outer][:2]
    if not inner:
        return field, offset
    field, inner_offset = _field(field, inner)
    return field, offset + inner_offset


def pack(dtype: np.dtype, **values) -> tuple:
    """A launch's argument tuple from every field of ``dtype`` by name (a new record; `KernelArgs` reuses one)."""
    return KernelArgs(dtype, **values).set()


def layout_source(structs: Dict[str, np.dtype] = STRUCTS) -> str:
    """C++ that includes ``moe/args.cuh`` and asserts every struct's size and every field's offset and size as
    ``structs`` lay them out: what `check_device_layout` compiles."""
    lines = ["// The host's layout of the MoE kernels' argument structs (symmring.moe.gpu.kernel_args).",
             "#include <stddef.h>", "#include <moe/args.cuh>", ""]
    for struct, dtype in structs.items():
        c = f"symmring_moe::{struct}"
        lines.append(f'static_assert(sizeof({c}) == {dtype.itemsize}, "kernel args: sizeof({struct}) is '
                     f'{dtype.itemsize} on the host");')
        for name in dtype.names:
            field, offset = dtype.fields[name][:2]
            lines.append(f'static_assert(offsetof({c}, {name}) == {offset}, "kernel args: {struct}.{name} at offset '
                         f'{offset} on the host");')
            lines.append(f'static_assert(sizeof({c}::{name}) == {field.itemsize}, "kernel args: {struct}.{name} of '
                         f'{field.itemsize} bytes on the host");')
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def check_device_layout(cc: int) -> None:
    """Check, once per process and compute capability, that nvcc lays out device/moe/args.cuh as `STRUCTS` do:
    compiles `layout_source` with the library's options (cached like every module).

    Raises:
        KernelArgsMismatch: a size or an offset differs (the message lists each, as the compiler found it).
        CompileError: the header itself does not compile.
    """
    from ... import jit
    try:
        jit.compile_cubin(layout_source(), name="moe_kernel_args", cc=int(cc))
    except CompileError as exc:
        # nvcc reports each failed assertion once per compilation pass (host, device): each once, in order.
        found = list(dict.fromkeys(line.split('"')[1] for line in exc.log.splitlines() if '"kernel args: ' in line))
        if not found:
            raise
        raise KernelArgsMismatch(
            "the MoE kernels' argument structs of symmring.moe.gpu.kernel_args disagree with device/moe/args.cuh "
            f"as nvcc lays it out (sm_{cc}): " + "; ".join(found) + ". Edit both sides together "
            "(tests/test_kernel_args.py compares them)") from None
