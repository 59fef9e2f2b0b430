"""`RingModel`, the transition system of one `ModelConfig`: the state encoding (one byte per model word),
every step of the producers, the consumers (per-chunk and windowed), the store buffers, the ends of calls
and the graph executors, the invariants checked on each step, and the text of a step and of a deadlock."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .. import protocol
from ..errors import ConfigError
from ..protocol import AckPolicy
from .config import ModelConfig
from .invariants import INV_COMBINE_ONCE, INV_EXACT_READ, INV_NO_STALE_WAIT, INV_REUSE
from .mutants import EQUIVALENT_VARIANTS, FINE_MUTANTS, GRAPH_MUTANTS, MUTANT_NAMES, WINDOW_MUTANTS

# Consumer operations, in the order a consumer's per-source program runs them.
OP_WAIT, OP_READ_ROUTE, OP_READ_LAYOUT, OP_ACK, OP_COMBINE = range(5)
_FIELD_NAMES = ("route", "layout")

# Per-producer program counter: call, chunk, acquired, route phase, layout phase, late reset done.
_PROD_WORDS = 6
# Per owner slot: route_ready, layout_ready, ack mask, route_data tag, layout_data tag, and the tags still
# in the owner's store buffer (0: nothing pending) for route and layout.
_SLOT_WORDS = 7
# Producer field phases.
_PH_NONE, _PH_WRITTEN, _PH_PUBLISHED = 0, 1, 2


def _validate(cfg: ModelConfig) -> None:
    for name in ("num_producers", "num_consumers", "num_slots", "num_chunks", "num_calls"):
        value = getattr(cfg, name)
        if name == "num_chunks" and isinstance(value, tuple):
            if len(value) != cfg.num_calls or not sum(value) or any(
                    not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in value):
                raise ConfigError(f"num_chunks={value!r}: expected a positive int or one count >= 0 per call "
                                  f"({cfg.num_calls}), not all 0")
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}={value!r}: expected a positive int")
    if cfg.num_consumers > 8:
        # The state stores each acknowledgement mask in one byte.
        raise ConfigError(f"num_consumers={cfg.num_consumers}: expected at most 8 (one mask byte)")
    if sum(cfg.chunks_per_call()) > 120:
        raise ConfigError(f"chunks over all calls={sum(cfg.chunks_per_call())}: expected at most 120 "
                          "(generations and stream positions are stored in one byte)")
    if cfg.mutant is not None and cfg.mutant not in MUTANT_NAMES + EQUIVALENT_VARIANTS:
        raise ConfigError(f"mutant={cfg.mutant!r}: expected one of {MUTANT_NAMES + EQUIVALENT_VARIANTS}")
    ranks = max(cfg.num_producers, cfg.num_consumers)
    for name in ("lookahead", "expert_window"):
        value = getattr(cfg, name)
        values = value if isinstance(value, tuple) else (value,)
        low = 0 if name == "lookahead" else 1
        if value is not None and (not values or any(not isinstance(v, int) or isinstance(v, bool) or v < low
                                                    for v in values)
                                  or (isinstance(value, tuple) and len(value) != ranks)):
            raise ConfigError(f"{name}={value!r}: expected None, an int >= {low} or one per rank ({ranks})")
    if cfg.expert_window is not None:
        if cfg.num_producers != cfg.num_consumers:
            raise ConfigError(f"expert_window={cfg.expert_window!r}: the windowed consumer needs every rank to be "
                              f"producer and consumer (P == Q), got P={cfg.num_producers}, Q={cfg.num_consumers}")
        if cfg.mutant is not None and cfg.mutant not in WINDOW_MUTANTS:
            raise ConfigError(f"mutant={cfg.mutant!r}: only {list(WINDOW_MUTANTS)} run with expert windows")
        if cfg.mutant != "window_exceeds_slots":
            for width in cfg.window_widths():
                protocol.check_expert_window(width, cfg.num_slots)
    elif cfg.mutant in WINDOW_MUTANTS:
        raise ConfigError(f"mutant={cfg.mutant!r} needs expert_window (the windowed consumer)")
    if cfg.split_acquire and (cfg.expert_window is not None or cfg.mutant not in (
            None, "split_acquire_full_mask_only")):
        raise ConfigError("split_acquire=True: only with the per-chunk consumer and the split mutant")
    if cfg.mutant == "split_acquire_full_mask_only" and not cfg.split_acquire:
        raise ConfigError(f"mutant={cfg.mutant!r} needs split_acquire=True")
    if cfg.graph and cfg.expert_window is None:
        raise ConfigError("graph=True: the captured graph is the windowed consumer's (set expert_window)")
    if cfg.mutant in GRAPH_MUTANTS and not cfg.graph:
        raise ConfigError(f"mutant={cfg.mutant!r} needs graph=True")
    if cfg.graph and max(len(protocol.expert_windows(n, w)) + n + 1 for n in cfg.chunks_per_call()
                         for w in cfg.window_widths()) > 16:
        raise ConfigError("graph=True: at most 16 items per call (the done set is stored in two bytes)")


Label = Tuple
Successor = Tuple[Label, bytes, Optional[Tuple[str, str]]]


def _window_stages(first: int, last: int, policy: AckPolicy) -> Tuple[Tuple, ...]:
    """The stages of the GPU layer's consumer of the expert window ``[first, last]`` (moe/gpu/stages.py
    ``consume_window``), each done for every source before the next starts:

    ``("route", c)`` for each chunk: wait for its route, read it (count); then for each chunk
    ``("layout", c)``: wait for its layout, read it and its route again (pull), and under EARLY
    ``("ack", c)``; then ``("combine",)``: write the window's results into every owner's combine rows,
    signal the owner (the window's last generation) and under CONSERVATIVE acknowledge the window's chunks;
    then ``("reduce",)``, once for the rank: wait until every consumer's combine signal for this rank's
    rows reached the window's last generation (``>=``), then read them.
    """
    stages: List[Tuple] = [("route", c) for c in range(first, last + 1)]
    for c in range(first, last + 1):
        stages.append(("layout", c))
        if policy == AckPolicy.EARLY:
            stages.append(("ack", c))
    return tuple(stages) + (("combine",), ("reduce",))


class RingModel:
    """Transition system of one `ModelConfig`; states are ``bytes`` (one byte per model word).

    Args:
        cfg: the configuration.

    Raises:
        ConfigError: a count is not positive or does not fit the byte encoding, or the mutant is unknown.

    Example:
        >>> model = RingModel(ModelConfig(1, 1, 2, 3, 1))
        >>> len(model.successors(model.initial()))
        1
    """

    def __init__(self, cfg: ModelConfig):
        _validate(cfg)
        self.cfg = cfg
        P, Q, S, _, C = cfg.shape()
        self.P, self.Q, self.S, self.C = P, Q, S, C
        #: Chunks of each call, and the index of each call's first chunk among all the calls' chunks.
        self.chunks = cfg.chunks_per_call()
        self.call_offset = [sum(self.chunks[:k]) for k in range(C)]
        total = sum(self.chunks)
        self.R = max(P, Q)
        mutant = cfg.mutant
        self.mutant = mutant
        self.windowed = cfg.expert_window is not None
        self.split = cfg.split_acquire
        self.o_cons = _PROD_WORDS * P
        # Per consumer: call, chunk, then a phase per source; windowed: call, window's first chunk, stage
        # of the window, the sources done with that stage (a bit mask).
        self.cons_words = 4 if self.windowed else 2 + P
        # Per rank: serial: its position in its stream; graph: the set of its finished items of the call
        # (two words) and the item its serial executor runs (1 + index; 0: none).
        self.stream_words = 3 if cfg.graph else 1
        self.o_stream = self.o_cons + self.cons_words * Q
        self.o_base = self.o_stream + self.stream_words * self.R
        self.o_mem = self.o_base + self.R
        self.o_acked = self.o_mem + _SLOT_WORDS * P * S
        self.o_written = self.o_acked + P * total
        # Windowed: the combine-ready word of each consumer on each owner (the generation it last signalled).
        self.o_comb = self.o_written + P * total
        self.num_words = self.o_comb + (P * Q if self.windowed else 0)

        self.all_consumers = protocol.full_mask(Q)[0]
        # Required mask per owner (the protocol: all consumers; one mutant leaves out the owner itself).
        self.required = []
        for p in range(P):
            consumers = [q for q in range(Q) if not (mutant == "required_mask_excludes_owner" and q == p)]
            self.required.append(protocol.required_mask(consumers, protocol.mask_words(Q)))

        # Fine steps wherever the variant breaks a premise of the coarse-step reduction (docs/MODELCHECK.md).
        self.fine = cfg.fine or mutant in FINE_MUTANTS
        policy = cfg.ack_policy if mutant != "combine_rereads_slot" else AckPolicy.EARLY
        tail = [OP_ACK, OP_COMBINE] if policy == AckPolicy.EARLY else [OP_COMBINE, OP_ACK]
        if mutant == "no_acquire":
            ops = [OP_READ_ROUTE, OP_READ_LAYOUT, OP_WAIT] + tail
        elif mutant == "ack_before_last_read":
            ops = [OP_WAIT, OP_READ_ROUTE, OP_ACK, OP_READ_LAYOUT, OP_COMBINE]
        else:
            ops = [OP_WAIT, OP_READ_ROUTE, OP_READ_LAYOUT] + tail
        if self.fine:
            steps = [(op,) for op in ops]
        else:
            # Coarse: the wait and both reads are one step, the (local) combine and the ack another.
            steps = [tuple(ops[:3]), tuple(ops[3:])]
        #: The consumer's per-source program: a tuple of steps, each a tuple of operations done atomically.
        self.consumer_steps = tuple(steps)
        #: Windowed consumer: per consumer and call, its windows by first chunk: (last chunk, stages).
        self.windows: List[List[Dict[int, Tuple[int, Tuple[Tuple, ...]]]]] = []
        if self.windowed:
            self.policy = policy
            for q, width in enumerate(cfg.window_widths()[:Q]):
                self.windows.append([{first: (last, _window_stages(first, last, policy))
                                      for first, last in protocol.expert_windows(n, width)} for n in self.chunks])

        # Serial mode: each rank's single stream, call after call, ending each call with the base advance.
        #: Graph mode: per rank and call, each item's (index, mask of the items it must follow).
        self.graph_nodes: List[List[Dict[Tuple[str, int, int], Tuple[int, int]]]] = []
        self.graph_serial = cfg.graph and cfg.serial
        if cfg.graph:
            for r in range(self.R):
                self.graph_nodes.append([self._call_graph(r, k) for k in range(C)])
        self.stream_items: List[Tuple[Tuple[str, int, int], ...]] = []
        if cfg.serial and not cfg.graph:
            for r in range(self.R):
                items = []
                for k in range(C):
                    for kind, c in self._rank_order(r, self.chunks[k]):
                        if (kind == "produce" and r < P) or (kind == "consume" and r < Q):
                            items.append((kind, k, c))
                    items.append(("advance", k, self.chunks[k]))
                self.stream_items.append(tuple(items))
            if max(len(items) for items in self.stream_items) > 250:
                raise ConfigError("serial stream too long for the byte encoding: reduce num_chunks*num_calls")

    def _call_graph(self, r: int, k: int) -> Dict[Tuple[str, int, int], Tuple[int, int]]:
        """Rank ``r``'s captured graph of call ``k``: each model item -> (index, predecessor mask)."""
        N = self.chunks[k]
        order = protocol.windowed_enqueue_order(N, self.S, self.cfg.window_widths()[r])
        items, edges = protocol.call_dependency_graph(order, self.S, two_streams=True)
        dropped = {"graph_without_own_chunk_edges": "own chunks", "graph_without_own_ack_edges": "own acknowledgement"}
        edges = tuple(e for e in edges if e.why != dropped.get(self.mutant))
        names = {"produce": "produce", "consume": "consume", "end_call": "advance"}
        model = {item: (names[item[0]], k, item[1]) for item in items}
        index = {item: i for i, item in enumerate(items)}
        preds = {item: 0 for item in items}
        for edge in edges:
            preds[edge.after] |= 1 << index[edge.before]
        return {model[item]: (index[item], preds[item]) for item in items}

    def _rank_order(self, r: int, N: int) -> List[Tuple[str, int]]:
        """Rank ``r``'s serial enqueue order of a call of ``N`` chunks: ``(kind, chunk)`` items (a consume
        item of a windowed order names its window's first chunk)."""
        S, cfg = self.S, self.cfg
        if self.windowed:
            width = cfg.window_widths()[r]
            order = protocol.windowed_enqueue_order(N, S, width, check=self.mutant != "window_exceeds_slots")
            return [(kind, first) for kind, first, _ in order]
        lookahead = cfg.lookaheads()[r]
        # lookahead_eq_slots: the forbidden lookahead S, the producer of chunk S before the consumer of 0.
        check = not (self.mutant == "lookahead_eq_slots" and lookahead == S)
        try:
            return protocol.enqueue_order(N, S, lookahead, check=check)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    # --- encoding helpers -----------------------------------------------------------------------------

    def initial(self) -> bytes:
        """The initial state: nothing published, every mask full (slot free), every base 0."""
        words = [0] * self.num_words
        for p in range(self.P):
            for s in range(self.S):
                words[self._slot(p, s) + 2] = self.all_consumers
        return bytes(words)

    def _slot(self, p: int, s: int) -> int:
        return self.o_mem + _SLOT_WORDS * (p * self.S + s)

    def _chunk_idx(self, p: int, k: int, c: int) -> int:
        return p * sum(self.chunks) + self.call_offset[k] + c

    def tag(self, k: int, c: int) -> int:
        """Payload tag of chunk ``c`` of call ``k`` (0 means never written)."""
        return self.call_offset[k] + c + 1

    def tag_text(self, tag: int) -> str:
        """Human-readable tag."""
        if tag == 0:
            return "(never written)"
        k = max(k for k in range(self.C) if self.call_offset[k] < tag)
        return f"(call {k}, chunk {tag - 1 - self.call_offset[k]})"

    def _gate(self, w: Sequence[int], r: int, item: Tuple[str, int, int]) -> bool:
        """Whether ``item`` may take a step on rank ``r``: serial, it is the next work item on the rank's
        single stream; graph, it runs already, or every item it follows finished (and, with a serial
        executor, no other item of the rank runs)."""
        if self.cfg.graph:
            idx, preds = self.graph_nodes[r][item[1]][item]
            if self.graph_serial and item[0] != "advance":
                return w[self.o_stream + 3 * r + 2] == idx + 1  # the executor started it
            return self._graph_ready(w, r, idx, preds)
        if not self.cfg.serial:
            return True
        idx = w[self.o_stream + r]
        items = self.stream_items[r]
        return idx < len(items) and items[idx] == item

    def _graph_done(self, w: Sequence[int], r: int) -> int:
        o = self.o_stream + 3 * r
        return w[o] | w[o + 1] << 8

    def _graph_ready(self, w: Sequence[int], r: int, idx: int, preds: int) -> bool:
        """Whether rank ``r``'s graph item ``idx`` has not finished and every item of ``preds`` has."""
        done = self._graph_done(w, r)
        return not done >> idx & 1 and done & preds == preds

    def _executor_steps(self, w: bytes, out: List[Successor]) -> None:
        """Graph mode with a serial executor: a rank that runs no item starts one whose predecessors all
        finished (any of them: every topological order). It then runs only that item until it finishes,
        even while the item waits (a launched kernel holds the executor)."""
        for r in range(self.R):
            if w[self.o_stream + 3 * r + 2]:
                continue
            o_prod, o_cons = _PROD_WORDS * r, self.o_cons + self.cons_words * r
            for item in (("produce", w[o_prod], w[o_prod + 1]), ("consume", w[o_cons], w[o_cons + 1])):
                k, c = item[1], item[2]
                if k >= self.C or c >= self.chunks[k]:
                    continue
                idx, preds = self.graph_nodes[r][k][item]
                if self._graph_ready(w, r, idx, preds):
                    nxt = bytearray(w)
                    nxt[self.o_stream + 3 * r + 2] = idx + 1
                    out.append((("start", r, item), bytes(nxt), None))

    def _item_finished(self, nxt: bytearray, r: int, item: Tuple[str, int, int]) -> None:
        """``item`` of rank ``r`` finished: the next stream item (serial), a finished item (graph)."""
        if self.cfg.graph:
            o = self.o_stream + 3 * r
            if item[0] == "advance":  # a new call: nothing of it finished yet
                nxt[o] = nxt[o + 1] = nxt[o + 2] = 0
                return
            done = self._graph_done(nxt, r) | 1 << self.graph_nodes[r][item[1]][item][0]
            nxt[o], nxt[o + 1], nxt[o + 2] = done & 0xFF, done >> 8, 0
        elif self.cfg.serial:
            nxt[self.o_stream + r] += 1

    def _reuse_ok(self, mask: int, p: int) -> bool:
        required = self.required[p]
        if self.mutant == "reuse_on_any_ack":
            return (mask & required[0]) != 0
        return protocol.mask_complete((mask,), required)

    def _ready(self, route_gen: int, layout_gen: int, expected: int) -> bool:
        mutant = self.mutant
        if mutant == "ready_ignores_generation":
            return route_gen != protocol.GEN_NONE and layout_gen != protocol.GEN_NONE
        if mutant == "wait_route_only":
            return route_gen == expected
        if mutant == "ready_ge":
            return route_gen >= expected and layout_gen >= expected
        return protocol.is_ready(route_gen, layout_gen, expected)

    def _previous_use(self, k: int, c: int) -> Optional[Tuple[int, int]]:
        """(call, chunk) that occupied the slot of chunk ``c`` of call ``k`` before it, or ``None``."""
        if c >= self.S:
            return (k, c - self.S)
        s = protocol.slot_of(c, self.S)
        for earlier in range(k - 1, -1, -1):  # the last earlier call whose chunks reached slot s
            n = self.chunks[earlier]
            if s < n:
                return (earlier, s + self.S * ((n - 1 - s) // self.S))
        return None

    def _missing(self, mask: int) -> List[int]:
        """The consumers whose bit ``mask`` lacks."""
        return [q for q in range(self.Q) if not mask >> q & 1]

    def _published(self, w: Sequence[int], p: int, k: int, c: int, field: int) -> bool:
        """Ghost: whether producer ``p`` has executed its publish of ``field`` for chunk ``(k, c)``."""
        o = _PROD_WORDS * p
        pk, pc = w[o], w[o + 1]
        if (pk, pc) != (k, c):
            return (pk, pc) > (k, c)
        return w[o + 3 + field] == _PH_PUBLISHED

    # --- transitions ----------------------------------------------------------------------------------

    def is_final(self, w: Sequence[int]) -> bool:
        """Every program finished every call and no payload store is still buffered."""
        C = self.C
        for p in range(self.P):
            if w[_PROD_WORDS * p] != C:
                return False
        for q in range(self.Q):
            if w[self.o_cons + self.cons_words * q] != C:
                return False
        for p in range(self.P):
            for s in range(self.S):
                o = self._slot(p, s)
                if w[o + 5] or w[o + 6]:
                    return False
        return True

    def final_violation(self, w: Sequence[int]) -> Optional[Tuple[str, str]]:
        """Invariant 4 at the end: every (source, call, chunk, consumer) result was written."""
        for p in range(self.P):
            for k in range(self.C):
                for c in range(self.chunks[k]):
                    written = w[self.o_written + self._chunk_idx(p, k, c)]
                    if written != self.all_consumers:
                        missing = self._missing(written)
                        return (INV_COMBINE_ONCE, f"final state: result of source {p} call {k} chunk {c} "
                                f"never written by consumers {missing}")
        return None

    def successors(self, state: bytes) -> List[Successor]:
        """Every enabled step of ``state``: ``(label, next state, violation or None)``.

        A violation is ``(invariant, message)`` about the step itself (a read that saw the wrong tag, an
        overwrite before all acknowledgements, ...).
        """
        w = state
        out: List[Successor] = []
        consumer_steps = self._window_steps if self.windowed else self._consumer_steps
        if self.cfg.reduced():
            # Partial-order reduction (docs/MODELCHECK.md): a consumer step that no other step can conflict
            # with before it runs is explored alone.
            consumer_steps(w, out, reduce=True)
            if out:
                return out
        self._producer_steps(w, out)
        self._drain_steps(w, out)
        consumer_steps(w, out)
        self._advance_steps(w, out)
        if self.graph_serial:
            self._executor_steps(w, out)
        return out

    def _producer_steps(self, w: bytes, out: List[Successor]) -> None:
        S, mutant = self.S, self.mutant
        for p in range(self.P):
            o = _PROD_WORDS * p
            k, c = w[o], w[o + 1]
            if k >= self.C or c >= self.chunks[k] or not self._gate(w, p, ("produce", k, c)):
                continue
            s = protocol.slot_of(c, S)
            m = self._slot(p, s)
            acquired = w[o + 2]  # split producer: one bit per part (1 << field), else 1 for both
            if self.split:
                self._split_acquire_steps(w, out, p, k, c, s)
            elif not acquired:
                mask = w[m + 2]
                # acquire: pairs with the consumers' release of their acknowledgement (atomic OR)
                if self._reuse_ok(mask, p):
                    nxt = bytearray(w)
                    nxt[o + 2] = 1
                    reset = mutant not in ("reset_forgotten", "reset_after_publish")
                    if reset:
                        nxt[m + 2] = 0
                    out.append((("acquire", p, k, c, s, mask, reset), bytes(nxt), None))
                continue
            gen = protocol.generation(w[self.o_base + p], c)
            tag = self.tag(k, c)
            for field in (0, 1):
                if self.split and not acquired >> field & 1:
                    continue
                phase = w[o + 3 + field]
                if phase == _PH_NONE and not self.fine:
                    # Coarse: write the payload, release fence, publish, as one step.
                    nxt = bytearray(w)
                    violation = self._check_overwrite(w, p, k, c, s, field)
                    nxt[m + 3 + field] = tag
                    self._publish(nxt, p, m, field, gen)
                    labels = (("write", p, k, c, s, field, tag, False), ("publish", p, k, c, s, field, gen))
                    out.append((labels, bytes(nxt), violation))
                elif phase == _PH_NONE:
                    nxt = bytearray(w)
                    violation = self._check_overwrite(w, p, k, c, s, field)
                    if mutant == "fence_removed":
                        # The store enters the store buffer; a still-buffered older store to the same
                        # word becomes visible first (coherence order of one thread's stores).
                        if nxt[m + 5 + field]:
                            nxt[m + 3 + field] = nxt[m + 5 + field]
                        nxt[m + 5 + field] = tag
                    else:
                        nxt[m + 3 + field] = tag
                    nxt[o + 3 + field] = _PH_WRITTEN
                    self._finish_producer_chunk(nxt, p)
                    out.append((("write", p, k, c, s, field, tag, mutant == "fence_removed"), bytes(nxt),
                                violation))
                elif phase == _PH_WRITTEN:
                    nxt = bytearray(w)
                    self._publish(nxt, p, m, field, gen)
                    out.append((("publish", p, k, c, s, field, gen), bytes(nxt), None))
            if (mutant == "reset_after_publish" and not w[o + 5] and w[o + 3] == _PH_PUBLISHED
                    and w[o + 4] == _PH_PUBLISHED):
                nxt = bytearray(w)
                nxt[m + 2] = 0
                nxt[o + 5] = 1
                self._finish_producer_chunk(nxt, p)
                out.append((("late_reset", p, k, c, s, w[m + 2]), bytes(nxt), None))

    def _split_acquire_steps(self, w: bytes, out: List[Successor], p: int, k: int, c: int, s: int) -> None:
        """The split producer: each part not yet acquired acquires when the mask is complete (acquire:
        pairs with the consumers' release) or when the other part of this chunk is published (acquire:
        pairs with that part's release, issued after its own acquire saw the mask complete)."""
        o = _PROD_WORDS * p
        acquired, mask = w[o + 2], w[self._slot(p, s) + 2]
        for field in (0, 1):
            if acquired >> field & 1:
                continue
            free = self._reuse_ok(mask, p)
            other = w[o + 3 + (1 - field)] == _PH_PUBLISHED and self.mutant != "split_acquire_full_mask_only"
            if free or other:
                nxt = bytearray(w)
                nxt[o + 2] = acquired | 1 << field
                out.append((("acquire_part", p, k, c, s, field, mask, free), bytes(nxt), None))

    def _publish(self, nxt: bytearray, p: int, m: int, field: int, gen: int) -> None:
        """Producer ``p`` publishes ``field`` of the slot at word ``m`` with generation ``gen`` (the split
        producer resets the mask first), then finishes its chunk if that was the chunk's last step."""
        if self.split:
            nxt[m + 2] = 0  # grid_publish(reset_mask=true): the reset, then the release
        # release: pairs with the consumers' acquire in their ready wait
        nxt[m + field] = gen
        nxt[_PROD_WORDS * p + 3 + field] = _PH_PUBLISHED
        self._finish_producer_chunk(nxt, p)

    def _finish_producer_chunk(self, nxt: bytearray, p: int) -> None:
        o = _PROD_WORDS * p
        done = nxt[o + 2] and nxt[o + 3] == _PH_PUBLISHED and nxt[o + 4] == _PH_PUBLISHED
        if self.mutant == "reset_after_publish":
            done = done and nxt[o + 5]
        if done:
            self._item_finished(nxt, p, ("produce", nxt[o], nxt[o + 1]))
            nxt[o + 1] += 1
            nxt[o + 2] = nxt[o + 3] = nxt[o + 4] = nxt[o + 5] = 0

    def _check_overwrite(self, w: bytes, p: int, k: int, c: int, s: int,
                         field: int) -> Optional[Tuple[str, str]]:
        prev = self._previous_use(k, c)
        if prev is None:
            return None
        acked = w[self.o_acked + self._chunk_idx(p, *prev)]
        if acked == self.all_consumers:
            return None
        missing = self._missing(acked)
        return (INV_REUSE, f"producer {p} overwrites {_FIELD_NAMES[field]} of slot {s} with call {k} chunk "
                f"{c} while call {prev[0]} chunk {prev[1]} lacks acknowledgements of consumers {missing}")

    def _drain_steps(self, w: bytes, out: List[Successor]) -> None:
        if self.mutant != "fence_removed":
            return
        for p in range(self.P):
            for s in range(self.S):
                m = self._slot(p, s)
                for field in (0, 1):
                    tag = w[m + 5 + field]
                    if tag:
                        nxt = bytearray(w)
                        nxt[m + 3 + field] = tag
                        nxt[m + 5 + field] = 0
                        out.append((("drain", p, s, field, tag), bytes(nxt), None))

    def _independent(self, w: bytes, q: int, p: int, k: int, c: int) -> bool:
        """Whether consumer ``q``'s next step on source ``p`` commutes with every step any other program
        can take before it: the owner cannot touch the slot again until ``q`` acknowledges.

        The owner writes or publishes slot ``s`` only after acquiring it, and it can only acquire it
        once ``q``'s bit is in the mask (only ``q`` sets it). Other consumers' acknowledgements (atomic ORs)
        and reads commute with ``q``'s operations.
        """
        phase = w[self.o_cons + self.cons_words * q + 2 + p]
        if self.consumer_steps[phase] == (OP_COMBINE,) and self.mutant != "combine_rereads_slot":
            return True  # a lone combine write touches only ghost state of q's own results
        return self._slot_guarded(w, q, p, c)

    def _slot_guarded(self, w: bytes, q: int, p: int, c: int) -> bool:
        """Whether owner ``p`` cannot touch the slot of chunk ``c`` before consumer ``q`` acknowledges it:
        ``q``'s bit is required and absent from the slot's mask, and the owner does not hold the slot for
        another use."""
        s = protocol.slot_of(c, self.S)
        o = _PROD_WORDS * p
        if w[o] < self.C and w[o + 1] < self.chunks[w[o]] and w[o + 2] and protocol.slot_of(w[o + 1], self.S) == s:
            return False  # the owner already holds the slot for another use: its writes may come first
        _, bit = protocol.ack_bit(q)
        required = self.required[p][0]
        mask = self._slot(p, s) + 2
        if not required & bit or w[mask] & bit:
            return False
        return not self._reuse_ok(w[mask] | (required & ~bit), p)

    def _consumer_steps(self, w: bytes, out: List[Successor], reduce: bool = False) -> None:
        """Consumer steps; with ``reduce``, only the first independent one (`_independent`)."""
        P, steps = self.P, self.consumer_steps
        num_steps = len(steps)
        for q in range(self.Q):
            o = self.o_cons + self.cons_words * q
            k, c = w[o], w[o + 1]
            if k >= self.C or c >= self.chunks[k] or not self._gate(w, q, ("consume", k, c)):
                continue
            for p in range(P):
                phase = w[o + 2 + p]
                if phase == num_steps or (reduce and not self._independent(w, q, p, k, c)):
                    continue
                nxt = bytearray(w)
                labels: List[Label] = []
                violation = None
                for op in steps[phase]:
                    result = self._consumer_op(nxt, op, q, p, k, c)
                    if result is None:
                        break  # a wait that is not satisfied (always the first operation of a step)
                    label, bad = result
                    labels.append(label)
                    violation = violation or bad
                else:
                    nxt[o + 2 + p] = phase + 1
                    if all(nxt[o + 2 + i] == num_steps for i in range(P)):
                        self._item_finished(nxt, q, ("consume", k, c))
                        nxt[o + 1] += 1
                        for i in range(P):
                            nxt[o + 2 + i] = 0
                    out.append((tuple(labels), bytes(nxt), violation))
                    if reduce:
                        return

    def _window_steps(self, w: bytes, out: List[Successor], reduce: bool = False) -> None:
        """Steps of the windowed consumers (`_window_stages`); with ``reduce``, only the first one that no
        other step can conflict with before it runs (a read of a slot its owner cannot touch before this
        consumer acknowledges it, an acknowledgement, a combine write and signal, the reduce)."""
        P, all_sources = self.P, (1 << self.P) - 1
        for q in range(self.Q):
            o = self.o_cons + self.cons_words * q
            k, first, stage, done = w[o], w[o + 1], w[o + 2], w[o + 3]
            if k >= self.C or first >= self.chunks[k] or not self._gate(w, q, ("consume", k, first)):
                continue
            last, stages = self.windows[q][k][first]
            step = stages[stage]
            for p in ((None,) if step[0] == "reduce" else range(P)):
                if p is not None and done >> p & 1:
                    continue
                if reduce and step[0] in ("route", "layout") and not self._slot_guarded(w, q, p, step[1]):
                    continue
                nxt = bytearray(w)
                result = self._window_op(nxt, step, q, p, k, first, last)
                if result is None:
                    continue  # a wait that is not satisfied
                label, violation = result
                done_now = all_sources if p is None else nxt[o + 3] | 1 << p
                if done_now == all_sources:  # every source finished the stage: the next one
                    nxt[o + 3] = 0
                    nxt[o + 2] = stage + 1
                    if stage + 1 == len(stages):  # the window is done
                        nxt[o + 1], nxt[o + 2] = last + 1, 0
                        self._item_finished(nxt, q, ("consume", k, first))
                else:
                    nxt[o + 3] = done_now
                out.append((label, bytes(nxt), violation))
                if reduce:
                    return

    def _window_op(self, nxt: bytearray, step: Tuple, q: int, p: Optional[int], k: int, first: int,
                   last: int) -> Optional[Tuple[Label, Optional[Tuple[str, str]]]]:
        """Apply one stage of consumer ``q``'s window ``[first, last]`` for source ``p`` (``None``: the
        reduce) to ``nxt``; ``None`` when it is a wait that is not satisfied."""
        base = nxt[self.o_base + q]
        kind = step[0]
        if kind in ("route", "layout"):
            c = step[1]
            s = protocol.slot_of(c, self.S)
            m = self._slot(p, s)
            gen, tag = protocol.generation(base, c), self.tag(k, c)
            field = 0 if kind == "route" else 1
            observed = nxt[m + field]
            # acquire: pairs with the producer's release before its publish of this field
            if observed != gen:
                return None
            violation = None
            if not self._published(nxt, p, k, c, field):
                violation = (INV_NO_STALE_WAIT, f"consumer {q} passed its {kind} wait for source {p} call {k} "
                             f"chunk {c} (gen {gen}) seeing {kind}_ready={observed}, but that chunk's {kind} is "
                             "not published yet")
            # route: count (reads topk_idx); layout: pull (reads x, and topk_idx again for the rows)
            seen = [nxt[m + f] for f in ((0,) if field == 0 else (1, 0))]
            for f, tag_seen in zip((0,) if field == 0 else (1, 0), seen):
                violation = violation or self._check_read(q, p, k, c, s, f, tag_seen, tag)
            return ("w" + kind, q, p, k, c, s, observed, gen, tuple(seen), tag), violation
        if kind == "ack":
            c = step[1]
            return ("ack", q, p, k, c, protocol.slot_of(c, self.S), self._ack(nxt, q, p, k, c)), None
        if kind == "combine":
            violation = None
            gen = protocol.generation(base, last)
            for c in range(first, last + 1):
                again = self._write_result(nxt, q, p, k, c)
                violation = violation or again
            # release: the rows before the signal; pairs with the acquire of owner p's reduce
            nxt[self.o_comb + p * self.Q + q] = gen
            conservative = self.policy == AckPolicy.CONSERVATIVE
            if conservative:
                for c in range(first, last + 1):
                    self._ack(nxt, q, p, k, c)
            return ("wcombine", q, p, k, first, last, gen, conservative), None
        # reduce: this rank's own rows of the window, once every consumer signalled them (>=, as the device)
        gen = protocol.generation(base, last)
        signals = [nxt[self.o_comb + q * self.Q + r] for r in range(self.Q)]
        if any(sig < gen for sig in signals):
            return None
        violation = None
        for c in range(first, last + 1):
            written = nxt[self.o_written + self._chunk_idx(q, k, c)]
            if written != self.all_consumers:
                missing = self._missing(written)
                violation = violation or (INV_COMBINE_ONCE, f"owner {q} reduces call {k} chunk {c} before "
                                          f"consumers {missing} wrote their results")
        return ("reduce", q, k, first, last, gen, tuple(signals)), violation

    def _consumer_op(self, nxt: bytearray, op: int, q: int, p: int, k: int,
                     c: int) -> Optional[Tuple[Label, Optional[Tuple[str, str]]]]:
        """Apply one consumer operation to ``nxt``; ``None`` when it is a wait that is not satisfied."""
        s = protocol.slot_of(c, self.S)
        m = self._slot(p, s)
        gen = protocol.generation(nxt[self.o_base + q], c)
        tag = self.tag(k, c)
        violation = None
        if op == OP_WAIT:
            route_gen, layout_gen = nxt[m], nxt[m + 1]
            # acquire: pairs with the producer's release before its publish
            if not self._ready(route_gen, layout_gen, gen):
                return None
            label = ("wait", q, p, k, c, s, route_gen, layout_gen, gen)
            unpublished = [_FIELD_NAMES[f] for f in (0, 1) if not self._published(nxt, p, k, c, f)]
            if unpublished:
                violation = (INV_NO_STALE_WAIT, f"consumer {q} passed its wait for source {p} call {k} chunk "
                             f"{c} (gen {gen}) seeing route_ready={route_gen} layout_ready={layout_gen}, but "
                             f"{'+'.join(unpublished)} of that chunk is not published yet")
        elif op in (OP_READ_ROUTE, OP_READ_LAYOUT):
            field = 0 if op == OP_READ_ROUTE else 1
            seen = nxt[m + 3 + field]
            label = ("read", q, p, k, c, s, field, seen, tag)
            violation = self._check_read(q, p, k, c, s, field, seen, tag)
        elif op == OP_ACK:
            label = ("ack", q, p, k, c, s, self._ack(nxt, q, p, k, c))
        else:
            label = ("combine", q, p, k, c)
            if self.mutant == "combine_rereads_slot":
                seen = nxt[m + 3]
                label = ("combine_reread", q, p, k, c, s, seen, tag)
                violation = self._check_read(q, p, k, c, s, 0, seen, tag)
            again = self._write_result(nxt, q, p, k, c)
            violation = violation or again
        return label, violation

    def _ack(self, nxt: bytearray, q: int, p: int, k: int, c: int) -> int:
        """Consumer ``q`` acknowledges chunk ``c`` of call ``k`` of source ``p``: its bit into the slot's mask
        and into the chunk's (ghost) acknowledgements. Returns the slot's mask."""
        _, bit = protocol.ack_bit(q)
        mask = self._slot(p, protocol.slot_of(c, self.S)) + 2
        # release: pairs with the owner's acquire of the slot (its mask wait)
        nxt[mask] |= bit
        nxt[self.o_acked + self._chunk_idx(p, k, c)] |= bit
        return nxt[mask]

    def _write_result(self, nxt: bytearray, q: int, p: int, k: int, c: int) -> Optional[Tuple[str, str]]:
        """Consumer ``q`` writes its result of chunk ``c`` of call ``k`` of source ``p`` (ghost); the violation
        of invariant 4 when it had written it before."""
        idx = self.o_written + self._chunk_idx(p, k, c)
        _, bit = protocol.ack_bit(q)
        violation = None
        if nxt[idx] & bit:
            violation = (INV_COMBINE_ONCE, f"consumer {q} writes the result of source {p} call {k} chunk {c} "
                         "a second time")
        nxt[idx] |= bit
        return violation

    def _check_read(self, q: int, p: int, k: int, c: int, s: int, field: int, seen: int,
                    expected: int) -> Optional[Tuple[str, str]]:
        if seen == expected:
            return None
        kind = "stale" if seen < expected else "future"
        return (INV_EXACT_READ, f"consumer {q} reads {_FIELD_NAMES[field]} of source {p} slot {s} expecting "
                f"{self.tag_text(expected)} but sees {self.tag_text(seen)} ({kind} data)")

    def _advance_steps(self, w: bytes, out: List[Successor]) -> None:
        """End of a call on one rank: both streams joined, the device advances the generation base."""
        C = self.C
        for r in range(self.R):
            # The rank's program counters (call, chunk): its producer's, its consumer's.
            counters = (([_PROD_WORDS * r] if r < self.P else [])
                        + ([self.o_cons + self.cons_words * r] if r < self.Q else []))
            calls = [(w[o], w[o + 1]) for o in counters]
            k = calls[0][0]
            if k >= C:
                continue
            N = self.chunks[k]
            if any(pc != (k, N) for pc in calls) or not self._gate(w, r, ("advance", k, N)):
                continue
            nxt = bytearray(w)
            base = w[self.o_base + r]
            new_base = base if self.mutant == "generation_baked" else protocol.next_base(base, N)
            nxt[self.o_base + r] = new_base
            for o in counters:
                nxt[o], nxt[o + 1] = k + 1, 0
            self._item_finished(nxt, r, ("advance", k, N))
            out.append((("advance", r, k, base, new_base), bytes(nxt), None))

    # --- traces ---------------------------------------------------------------------------------------

    def blocked(self, w: bytes) -> List[str]:
        """What every unfinished program of a deadlocked state waits for."""
        lines = []
        programs = [("producer", p, _PROD_WORDS * p) for p in range(self.P)]
        programs += [("consumer", q, self.o_cons + self.cons_words * q) for q in range(self.Q)]
        for role, r, o in programs:
            k, c = w[o], w[o + 1]
            item = ("produce" if role == "producer" else "consume", k, c)
            if k >= self.C:
                continue
            if c >= self.chunks[k]:
                lines.append(f"{role} {r} waits for the end of call {k} on rank {r}")
            elif self.cfg.graph and not self._gate(w, r, item):
                idx, preds = self.graph_nodes[r][k][item]
                missing = [it for it, (i, _) in self.graph_nodes[r][k].items()
                           if preds >> i & 1 and not self._graph_done(w, r) >> i & 1]
                why = f"it follows {missing}, not finished" if missing else "the executor runs another item"
                lines.append(f"{role} {r} call {k}: {item[0]} {c} is not started: {why}")
            elif self.cfg.serial and not self._gate(w, r, item):
                lines.append(f"{role} {r} call {k} chunk {c} is queued behind "
                             f"{self.stream_items[r][w[self.o_stream + r]]} on rank {r}'s stream")
            elif role == "producer":
                s = protocol.slot_of(c, self.S)
                mask = w[self._slot(r, s) + 2]
                lines.append(f"producer {r} call {k} chunk {c} waits to acquire slot {s}: mask {mask:#b}, "
                             f"required {self.required[r][0]:#b}")
            elif self.windowed:
                lines += self._window_blocked(w, r, k, c)
            else:
                s = protocol.slot_of(c, self.S)
                gen = protocol.generation(w[self.o_base + r], c)
                for p in range(self.P):
                    phase = w[o + 2 + p]
                    if phase < len(self.consumer_steps) and self.consumer_steps[phase][0] == OP_WAIT:
                        m = self._slot(p, s)
                        lines.append(f"consumer {r} call {k} chunk {c} waits for source {p} slot {s} "
                                     f"gen {gen}: "
                                     f"route_ready={w[m]} layout_ready={w[m + 1]}")
        return lines

    def _window_blocked(self, w: bytes, q: int, k: int, first: int) -> List[str]:
        o = self.o_cons + self.cons_words * q
        last, stages = self.windows[q][k][first]
        step, done = stages[w[o + 2]], w[o + 3]
        where = f"consumer {q} call {k} window [{first}, {last}]"
        base = w[self.o_base + q]
        if step[0] == "reduce":
            gen = protocol.generation(base, last)
            signals = [w[self.o_comb + q * self.Q + r] for r in range(self.Q)]
            return [f"{where} waits to reduce: combine signals {signals}, needs >= {gen} from every consumer"]
        if step[0] not in ("route", "layout"):
            return []
        c = step[1]
        s, gen = protocol.slot_of(c, self.S), protocol.generation(base, c)
        field = 0 if step[0] == "route" else 1
        return [f"{where} waits for the {step[0]} of chunk {c} of source {p} slot {s} gen {gen}: "
                f"{step[0]}_ready={w[self._slot(p, s) + field]}" for p in range(self.P) if not done >> p & 1]

    def describe(self, label: Label) -> str:
        """One line of a counterexample trace (a coarse step's operations joined by ``; ``)."""
        if isinstance(label[0], tuple):
            return "; ".join(self.describe(part) for part in label)
        kind = label[0]
        if kind in ("acquire", "acquire_part", "write", "publish", "late_reset"):
            _, p, k, c, s, *rest = label
            return f"producer {p} call {k} chunk {c}: {self._producer_text(kind, s, rest)}"
        if kind in ("wait", "read", "combine_reread", "ack", "combine", "wroute", "wlayout"):
            _, q, p, k, c, *rest = label
            return f"consumer {q} call {k} chunk {c}: {self._consumer_text(kind, p, rest)}"
        if kind == "drain":
            _, p, s, field, tag = label
            return (f"store buffer of producer {p}: {_FIELD_NAMES[field]} payload {self.tag_text(tag)} of "
                    f"slot {s} becomes visible")
        if kind == "advance":
            _, r, k, base, new_base = label
            return f"rank {r}: end of call {k}, generation base {base} -> {new_base}"
        if kind == "start":
            _, r, item = label
            what = f"produce chunk {item[2]}" if item[0] == "produce" else f"consume the window from chunk {item[2]}"
            return f"rank {r}: the executor starts call {item[1]}'s {what}"
        if kind == "wcombine":
            _, q, p, k, first, last, gen, acked = label
            text = (f"consumer {q} call {k} window [{first}, {last}]: writes its results of source {p}'s "
                    f"chunks, signals combine_ready = {gen} to owner {p}")
            return text + (", acknowledges the window's chunks of source {}".format(p) if acked else "")
        if kind == "reduce":
            _, q, k, first, last, gen, signals = label
            return (f"owner {q} call {k} window [{first}, {last}]: every consumer's combine signal "
                    f"{list(signals)} >= {gen}, reduces its rows")
        return repr(label)

    def _producer_text(self, kind: str, s: int, rest: List[int]) -> str:
        """What a producer's step on slot ``s`` does (`describe`); ``rest``: the label's fields after the slot."""
        if kind == "acquire":
            mask, reset = rest
            what = "resets mask to 0b0" if reset else "does NOT reset the mask"
            return f"acquires slot {s} (mask {mask:#b} accepted), {what}"
        if kind == "acquire_part":
            field, mask, free = rest
            why = f"mask {mask:#b} complete" if free else f"its {_FIELD_NAMES[1 - field]} part is published"
            return f"{_FIELD_NAMES[field]} part acquires slot {s} ({why})"
        if kind == "write":
            field, tag, buffered = rest
            where = "into its store buffer (not yet visible)" if buffered else "(visible)"
            return f"writes {_FIELD_NAMES[field]} payload {self.tag_text(tag)} of slot {s} {where}"
        if kind == "publish":
            field, gen = rest
            return f"publishes {_FIELD_NAMES[field]}_ready[{s}] = {gen}"
        (mask,) = rest  # late_reset
        return f"resets mask of slot {s} ({mask:#b} -> 0b0) after publish"

    def _consumer_text(self, kind: str, p: int, rest: List) -> str:
        """What a consumer's step on source ``p`` does (`describe`); ``rest``: the label's fields after the
        chunk (the slot first, except for a combine)."""
        if kind == "combine":
            return f"writes combine result of source {p} to its output"
        s, *rest = rest
        if kind == "wait":
            route_gen, layout_gen, gen = rest
            return (f"wait on source {p} slot {s} satisfied (route_ready={route_gen}, layout_ready={layout_gen}, "
                    f"expected gen {gen})")
        if kind == "ack":
            (mask,) = rest
            return f"acknowledges source {p} slot {s} (mask now {mask:#b})"
        if kind in ("wroute", "wlayout"):
            observed, gen, seen, tag = rest
            what = "counts its route" if kind == "wroute" else "pulls its layout (and route)"
            reads = ", ".join(f"{self.tag_text(t)} {'ok' if t == tag else 'WRONG'}" for t in seen)
            return (f"{kind[1:]} wait on source {p} slot {s} satisfied ({kind[1:]}_ready={observed}, "
                    f"expected gen {gen}), {what}: {reads}")
        if kind == "read":
            field, seen, tag = rest
            what = f"reads {_FIELD_NAMES[field]} payload"
        else:  # combine_reread
            seen, tag = rest
            what = "combine re-reads route metadata"
        ok = "ok" if seen == tag else f"WRONG, expected {self.tag_text(tag)}"
        return f"{what} of source {p} slot {s}: {self.tag_text(seen)} {ok}"
