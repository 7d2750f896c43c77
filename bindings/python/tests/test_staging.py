"""Staging through real Mooncake on 127.0.0.1: the producer gathers scattered
blocks into its source staging (`orbitkv.staging`, torch), the runtime writes
them into the consumer's staging grant as a few large ranges, the consumer
scatters the grant into its pages. Bytes must equal the producer's blocks;
pages outside the authorization and staging outside the grant stay as they
were; every grant goes back on release; a producer that does not stage (or a
consumer that grants nothing) falls back to writing pages, and the consumer
then scatters only the heads of producers that staged."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import torch
from _util import wait_event

import orbitkv
from orbitkv.staging import StagingCopier

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM = 3, 24, 4, 16, 8
GUARD, STAGE_GUARD = -7.0, -3.0
CAP = "0123456789abcdef" * 4
STAGE_FLOATS = 1 << 18  # 1 MiB of staging per rank


def layout_of(caches: list[torch.Tensor], tp: tuple[int, int]) -> dict:
    """One plane each for K and V: `caches[l]` is `[2, BLOCKS, heads, BLOCK, HEAD_DIM]`."""
    es = caches[0].element_size()
    return {
        "num_blocks": BLOCKS,
        "block_size": BLOCK,
        "total_kv_heads": HEADS,
        "tp_rank": tp[0],
        "tp_size": tp[1],
        "head_major": True,
        "layers": [
            {
                "planes": [
                    {"base": t[kv].data_ptr(), "block_stride": t.stride(1) * es, "block_bytes": t[kv][0].numel() * es}
                    for kv in (0, 1)
                ]
            }
            for t in caches
        ],
    }


class Rank:
    def __init__(self, fill: float | None, tp: tuple[int, int] = (0, 1), *, grants: bool, sources: bool,
                 source_floats: int = STAGE_FLOATS, later: bool = False, whole: bool = False,
                 gather: bool = False) -> None:
        heads = HEADS // tp[1]
        shape = (2, BLOCKS, heads, BLOCK, HEAD_DIM)
        self.caches = [torch.randn(shape) if fill is None else torch.full(shape, fill) for _ in range(LAYERS)]
        self.grants = torch.full((STAGE_FLOATS,), STAGE_GUARD)
        self.sources = torch.full((source_floats,), STAGE_GUARD)
        self.engine = orbitkv.MooncakeTransferEngine()
        for t in [*self.caches, self.grants, self.sources]:
            self.engine.register_memory(t)
        self.layout = layout_of(self.caches, tp)
        region = lambda t: (t.data_ptr(), t.numel() * t.element_size())  # noqa: E731
        self.runtime = orbitkv.Runtime(
            self.engine,
            json.dumps(self.layout),
            consumer_timeout_s=20.0,
            staging_region=region(self.grants) if grants else None,
            source_staging_region=region(self.sources) if sources else None,
            source_staging_later=later,
            staging_min_ranges=4,
            pieces_whole_requests=whole,
            gather_in_writer=gather,
        )
        units = self.runtime.staged_layout(1)["units"]
        self.copier = StagingCopier(self.layout, units, [*self.caches, self.grants, self.sources])
        self.arena = orbitkv.StagingArena(*region(self.sources))

    def open_staged(self, rid: str, src: list[int], consumer_tp: int = 1) -> tuple[int, int, list, int]:
        """`producer_open` with a source staging for `len(src)` blocks, in the
        order the runtime picks for `consumer_tp` (its `staging_group`)."""
        cap = len(src)
        sl = self.runtime.staged_layout(cap)
        base = self.arena.alloc(sl["bytes"])
        assert base is not None
        group = self.runtime.staging_group(consumer_tp)
        self.runtime.producer_open(rid, src, CAP, consumer_tp, staging_base=base, staging_blocks=cap,
                                   staging_group=group)
        return base, cap, sl["slots"], group

    def close(self) -> None:
        self.runtime.shutdown()
        self.engine.close()


@pytest.fixture
def pair() -> Iterator[tuple[Rank, Rank]]:
    p, c = Rank(None, grants=False, sources=True), Rank(GUARD, grants=True, sources=False)
    yield p, c
    p.close()
    c.close()


def scatter_completed(c: Rank, ev: orbitkv.RuntimeEvent, dst: list[int]) -> None:
    assert ev.kind == "consumer_completed", ev
    if ev.staged is not None:
        base, n, units, group = ev.staged
        assert n == len(dst)
        slots = c.runtime.staged_layout(n)["slots"]
        c.copier.scatter(c.copier.index(dst), base, units, slots, group)


def check_pages(p: Rank, c: Rank, src: list[int], dst: list[int], heads: slice = slice(None)) -> None:
    for layer in range(LAYERS):
        for s, d in zip(src, dst):
            assert torch.equal(c.caches[layer][:, d, heads], p.caches[layer][:, s]), (layer, s, d)
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert bool((c.caches[layer][:, untouched] == GUARD).all()), f"layer {layer}: unauthorized block written"


def finished_into_pages(p: Rank, c: Rank, rid: str, src: list[int], dst: list[int]) -> dict:
    """Finishes `rid` on the producer: released done, the consumer completed
    with nothing to scatter, its pages equal the producer's blocks and
    nothing else written. The producer's stats after."""
    p.runtime.producer_finish(rid)
    assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_completed" and ev.staged is None, ev
    check_pages(p, c, src, dst)
    return p.runtime.stats()


def test_scattered_blocks_go_through_staging_as_few_ranges(pair: tuple[Rank, Rank]) -> None:
    p, c = pair
    src = [3, 17, 5, 9, 21, 0, 12, 7, 14, 2]
    dst = [20, 1, 11, 6, 15, 22, 4, 9, 18, 13]  # no two consecutive: 10 ranges per plane direct
    hs = c.runtime.consumer_open("st", CAP, 0, dst, 1)
    grant = json.loads(hs)["staging"]
    assert grant is not None and grant["len"] >= 2 * LAYERS * len(dst) * HEADS * BLOCK * HEAD_DIM * 4
    base, cap, slots, group = p.open_staged("st", src)
    assert group == HEADS, "equal TP stages whole blocks (the pages' order)"
    p.runtime.producer_handshake(hs)
    # two chunks, as chunked prefill computes them
    for lo, hi in ((0, 6), (6, 10)):
        # into a grant: the request's order
        assert p.runtime.producer_gather_order("st", lo, hi) is None
        idx = p.copier.index(src[lo:hi])
        for layer in range(LAYERS):
            p.copier.gather(layer, idx, lo, base, cap, slots, group)
            assert p.runtime.layers_ready(layer, [("st", lo, hi)]) == []
    p.runtime.producer_finish("st")
    assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.staged is not None and ev.staged[0] == grant["base"] and ev.staged[2] == [(0, HEADS)]
    # nothing in the pages before the scatter: every byte went to the grant
    for layer in range(LAYERS):
        assert bool((c.caches[layer] == GUARD).all())
    scatter_completed(c, ev, dst)
    check_pages(p, c, src, dst)
    stats = p.runtime.stats()
    assert stats["layers_staged"] == 2 * LAYERS
    assert stats["layers_staged_to_pages"] == 0
    # per chunk and layer: one range per plane (a whole-block grant), against 2 x blocks direct
    assert stats["write_ranges"] == 2 * LAYERS * 2
    # staging outside the grant untouched
    g0 = (grant["base"] - c.grants.data_ptr()) // 4
    g1 = g0 + grant["len"] // 4
    assert bool((c.grants[:g0] == STAGE_GUARD).all()) and bool((c.grants[g1:] == STAGE_GUARD).all())
    assert c.runtime.staging_in_use()[1] == 1
    c.runtime.consumer_release("st")
    wait_event(c.runtime, {"consumer_released"})
    assert c.runtime.staging_in_use() == (0, 0)
    p.arena.free(base)
    assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))


def test_a_producer_that_does_not_stage_writes_pages_and_nothing_is_scattered(pair: tuple[Rank, Rank]) -> None:
    p, c = pair
    src, dst = [1, 8, 4, 19, 10], [2, 9, 16, 5, 23]
    hs = c.runtime.consumer_open("direct", CAP, 0, dst, 1)
    assert json.loads(hs)["staging"] is not None
    p.runtime.producer_open("direct", src, CAP)
    p.runtime.producer_handshake(hs)
    for layer in range(LAYERS):
        p.runtime.layer_ready("direct", layer, 0, len(src))
    p.runtime.producer_finish("direct")
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_completed" and ev.staged is None
    check_pages(p, c, src, dst)
    assert p.runtime.stats()["layers_staged"] == 0
    c.runtime.consumer_release("direct")
    wait_event(c.runtime, {"consumer_released"})
    assert c.runtime.staging_in_use() == (0, 0)


def test_contiguous_blocks_get_no_grant_and_a_consumer_without_staging_gets_pages(pair: tuple[Rank, Rank]) -> None:
    p, c = pair
    # contiguous: 2 ranges per layer direct, under staging_min_ranges
    hs = json.loads(c.runtime.consumer_open("contig", CAP, 0, [4, 5, 6, 7], 1))
    assert hs.get("staging") is None
    c.runtime.consumer_release("contig")
    # a producer that stages, a consumer that grants nothing: pages directly
    c2 = Rank(GUARD, grants=False, sources=False)
    try:
        src, dst = [2, 11, 6], [7, 0, 14]
        hs2 = c2.runtime.consumer_open("nogrant", CAP, 0, dst, 1)
        assert json.loads(hs2).get("staging") is None
        base, cap, slots, group = p.open_staged("nogrant", src)
        p.runtime.producer_handshake(hs2)
        idx = p.copier.index(src)
        for layer in range(LAYERS):
            p.copier.gather(layer, idx, 0, base, cap, slots, group)
            p.runtime.layer_ready("nogrant", layer, 0, 3)
        p.runtime.producer_finish("nogrant")
        ev = wait_event(c2.runtime, {"consumer_completed", "consumer_failed"})
        assert ev.kind == "consumer_completed" and ev.staged is None
        check_pages(p, c2, src, dst)
        wait_event(p.runtime, {"producer_released"})
        p.arena.free(base)
    finally:
        c2.close()


def test_a_chunk_gathered_in_decode_order_goes_into_its_pages_as_one_range_per_run() -> None:
    """The default (decode grants nothing): prefill's blocks ascending,
    decode's descending — page to page a range per block. The runtime names
    the order to gather each chunk in (decode's block IDs sorted); the chunk
    then goes from the source staging into decode's pages as one range per
    plane and run of consecutive decode IDs, and the pages hold exactly the
    producer's blocks, nothing written elsewhere."""
    p, c = Rank(None, grants=False, sources=True), Rank(GUARD, grants=False, sources=False)
    try:
        src = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
        dst = [19, 18, 17, 16, 15, 14, 13, 12, 11, 3]  # one descending run and a stray block
        hs = c.runtime.consumer_open("sorted", CAP, 0, dst, 1)
        assert json.loads(hs).get("staging") is None
        base, cap, slots, group = p.open_staged("sorted", src)
        p.runtime.producer_handshake(hs)
        # chunked prefill: the first chunk ended inside block 4, which the
        # second gathers again; the shared block stays in its slot (pinned)
        for lo, hi, first_chunk, last_chunk in ((0, 5, True, False), (4, 10, False, True)):
            order = p.runtime.producer_gather_order("sorted", lo, hi, pin_first=not first_chunk, pin_last=not last_chunk)
            assert order is not None and sorted(order) == list(range(lo, hi))
            assert order[4 - lo] == 4, order
            free = [dst[i] for i in order if i != 4]
            assert free == sorted(free), order
            idx = p.copier.index([src[i] for i in order])
            for layer in range(LAYERS):
                p.copier.gather(layer, idx, lo, base, cap, slots, group)
                assert p.runtime.layers_ready(layer, [("sorted", lo, hi)]) == []
        stats = finished_into_pages(p, c, "sorted", src, dst)
        assert stats["layers_staged"] == stats["layers_staged_to_pages"] == 2 * LAYERS
        assert stats["chunks_reordered"] == 2
        # chunk 0..5: decode 16..19 and the pinned 15; chunk 4..10: the pinned
        # 15, the stray 3 and 11..14; per plane (page to page: 10 + 12)
        assert stats["write_ranges"] == LAYERS * 2 * (2 + 3), stats
        # a request the runtime does not know: refused, nothing recorded
        with pytest.raises(orbitkv.UnknownRequestError):
            p.runtime.producer_gather_order("nobody", 0, 4)
        c.runtime.consumer_release("sorted")
        wait_event(c.runtime, {"consumer_released"})
        p.arena.free(base)
        assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))
    finally:
        p.close()
        c.close()


def all_back(p: Rank) -> None:
    """Waits until the runtime gave every layer piece back (10 s at most)."""
    deadline = time.monotonic() + 10
    while p.runtime.source_staging_in_use() != (0, 0):
        assert time.monotonic() < deadline, p.runtime.source_staging_in_use()
        time.sleep(0.005)


@pytest.mark.parametrize("short", [False, True])
def test_layers_staged_by_chunk_go_into_decode_pages_and_their_pieces_come_back_at_once(short: bool) -> None:
    """The default (staged by layer): each layer of each chunk is gathered
    into a piece the runtime gives, in decode's block order with nothing
    pinned, written into decode's pages as one range per plane and run of
    the chunk's sorted decode IDs, and the piece is back in the region as
    soon as its write ended, before the request is even finished. With room
    for a layer of the first chunk only (5 blocks), the second chunk's
    layers (6 blocks) are given no piece and written from the pages: the
    same bytes either way, nothing written elsewhere."""
    piece5 = 2 * 5 * HEADS * BLOCK * HEAD_DIM  # floats of a layer piece of 5 blocks
    floats = piece5 + 64 if short else STAGE_FLOATS  # 64 floats: the region's alignment
    p = Rank(None, grants=False, sources=True, source_floats=floats)
    c = Rank(GUARD, grants=False, sources=False)
    try:
        src = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
        dst = [19, 18, 17, 16, 15, 14, 13, 12, 11, 3]  # one descending run and a stray block
        hs = c.runtime.consumer_open("layers", CAP, 0, dst, 1)
        group = p.runtime.staging_group(1)
        p.runtime.producer_open("layers", src, CAP, 1, staging_group=group, stage_by_layer=True)
        p.runtime.producer_handshake(hs)
        given = none = 0
        # chunked prefill: the first chunk ended inside block 4, which the second gathers again
        for lo, hi in ((0, 5), (4, 10)):
            # nothing pinned: decode's IDs of the chunk fully sorted
            order = p.runtime.producer_gather_order("layers", lo, hi)
            assert order is not None and [dst[i] for i in order] == sorted(dst[lo:hi]), order
            idx = p.copier.index([src[i] for i in order])
            for layer in range(LAYERS):
                got = p.runtime.producer_stage_layer("layers", layer, lo, hi)
                if got is None:
                    none += 1
                else:
                    given += 1
                    base, slots = got
                    p.copier.gather_piece(layer, idx, base, slots, group)
                assert p.runtime.layers_ready(layer, [("layers", lo, hi)]) == []
                if short:
                    # its write ends before the next layer: the room is given again
                    all_back(p)
        # every piece back while the request is still open
        all_back(p)
        stats = finished_into_pages(p, c, "layers", src, dst)
        assert stats["chunks_reordered"] == 2
        assert stats["layers_staged_to_pages"] == given
        if not short:
            assert (given, none) == (2 * LAYERS, 0)
            assert stats["source_staging_full"] == 0
            # chunk 0..5: decode 15..19; chunk 4..10: 3 and 11..15; per plane
            # (page to page: 10 + 12; a whole staging with pinned blocks: 2 + 3)
            assert stats["write_ranges"] == LAYERS * 2 * (1 + 2), stats
        else:
            # the first chunk's layers one after the other, the second's from the pages
            assert (given, none) == (LAYERS, LAYERS)
            assert stats["source_staging_full"] == LAYERS, "each layer given no piece, counted"
        assert p.runtime.source_staging_in_use() == (0, 0)
        with pytest.raises(orbitkv.UnknownRequestError):
            p.runtime.producer_stage_layer("layers", 0, 0, 5)
        c.runtime.consumer_release("layers")
        wait_event(c.runtime, {"consumer_released"})
        assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))
    finally:
        p.close()
        c.close()


def stage_chunks(p: Rank, rid: str, src: list[int], chunks: list[tuple[int, int]]) -> None:
    """Gathers every layer of each chunk of `rid` into the piece the runtime
    gives (each must be given) and hands it over."""
    group = p.runtime.staging_group(1)
    for lo, hi in chunks:
        order = p.runtime.producer_gather_order(rid, lo, hi) or list(range(lo, hi))
        idx = p.copier.index([src[i] for i in order])
        for layer in range(LAYERS):
            got = p.runtime.producer_stage_layer(rid, layer, lo, hi)
            assert got is not None, (rid, layer, lo, hi)
            p.copier.gather_piece(layer, idx, got[0], got[1], group)
            assert p.runtime.layers_ready(layer, [(rid, lo, hi)]) == []


def a_decode_that_takes_pieces(p: Rank, c: Rank) -> None:
    """A first request staged by layer, decode authorizing first, written
    and released: `p` has seen a decode that takes layer pieces (so pages
    may go back before decode authorized). Decode's blocks 22 and 23 are
    reset to the guard."""
    hs = c.runtime.consumer_open("first", CAP, 0, [22, 23], 1)
    p.runtime.producer_open("first", [0, 1], CAP, 1, staging_group=p.runtime.staging_group(1),
                            stage_by_layer=True)
    p.runtime.producer_handshake(hs)
    stage_chunks(p, "first", [0, 1], [(0, 2)])
    p.runtime.producer_finish("first")
    assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
    assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"
    c.runtime.consumer_release("first")
    wait_event(c.runtime, {"consumer_released"})
    for t in c.caches:
        t[:, 22:].fill_(GUARD)


def test_pages_go_back_before_decode_authorized_and_decode_gets_the_kv_they_held() -> None:
    """The prefill's pages go back to vLLM once every layer of every chunk is
    in a layer piece and vLLM finished the request, before decode even
    authorized (once a decode that takes pieces was seen): then the pages
    are overwritten (vLLM reused them) and decode authorizes; what lands in
    its pages is the KV the prefill computed, nothing is written elsewhere,
    and every piece is back at the release."""
    p = Rank(None, grants=False, sources=True)
    c = Rank(GUARD, grants=False, sources=False)
    try:
        a_decode_that_takes_pieces(p, c)

        src = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
        dst = [19, 18, 17, 16, 15, 14, 13, 12, 11, 3]
        p.runtime.producer_open("early", src[:5], CAP, 1, staging_group=p.runtime.staging_group(1),
                                stage_by_layer=True)
        stage_chunks(p, "early", src, [(0, 5)])
        assert p.runtime.producer_give_back_pages("early") == "not_yet", "vLLM may hand more over"
        p.runtime.producer_add_blocks("early", src[5:])
        stage_chunks(p, "early", src, [(4, 10)])
        p.runtime.producer_finish("early")
        deadline = time.monotonic() + 10
        while (back := p.runtime.producer_give_back_pages("early")) != "now":
            assert back == "not_yet" and time.monotonic() < deadline, f"pages never given back: {back}"
            time.sleep(0.002)
        assert p.runtime.producer_give_back_pages("early") == "before"
        assert p.runtime.stats()["producer_pages_given_back"] == 1
        computed = [t.clone() for t in p.caches]
        for t in p.caches:
            t.fill_(123.0)  # vLLM gave the blocks to other requests
        hs = c.runtime.consumer_open("early", CAP, 0, dst, 1)
        p.runtime.producer_handshake(hs)
        assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
        ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
        assert ev.kind == "consumer_completed", ev
        for layer in range(LAYERS):
            for s_, d in zip(src, dst):
                assert torch.equal(c.caches[layer][:, d], computed[layer][:, s_]), (layer, s_, d)
            untouched = [b for b in range(BLOCKS) if b not in dst]
            assert bool((c.caches[layer][:, untouched] == GUARD).all()), f"layer {layer}: unauthorized block written"
        assert p.runtime.source_staging_in_use() == (0, 0)
        c.runtime.consumer_release("early")
        wait_event(c.runtime, {"consumer_released"})
        assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))
    finally:
        p.close()
        c.close()


@pytest.mark.parametrize("whole", [False, True])
def test_two_requests_in_one_forward_share_a_short_region_by_layer_or_one_is_staged_whole(whole: bool) -> None:
    """Two requests computed in one forward (their layers gathered in turn)
    before decode authorized either, in a region with room for one
    request's layers. By layer (the default) both get some layers and
    neither can give its pages back. Staged whole (``pieces_whole_requests``,
    ``orbitkv.pd.staging_pieces`` ``request``), ``b`` misses first and gives
    back its untaken piece, which ``a`` then gathers its last layer into:
    ``a`` is staged whole and its pages go back (vLLM overwrites them), ``b``
    is written from its pages. Decode gets each request's computed KV
    either way, and nothing lands outside what it authorized."""
    piece5 = 2 * 5 * HEADS * BLOCK * HEAD_DIM
    p = Rank(None, grants=False, sources=True, source_floats=LAYERS * piece5 + 64, whole=whole)
    c = Rank(GUARD, grants=False, sources=False)
    try:
        a_decode_that_takes_pieces(p, c)

        src = {"a": [2, 3, 4, 5, 6], "b": [7, 8, 9, 10, 11]}
        dst = {"a": [19, 18, 17, 16, 15], "b": [3, 4, 5, 6, 7]}
        group = p.runtime.staging_group(1)
        idx = {}
        for rid in src:
            p.runtime.producer_open(rid, src[rid], CAP, 1, staging_group=group, stage_by_layer=True)
            order = p.runtime.producer_gather_order(rid, 0, 5) or list(range(5))
            idx[rid] = p.copier.index([src[rid][i] for i in order])
        given: dict[str, list[int]] = {"a": [], "b": []}
        for layer in range(LAYERS):
            for rid in src:
                got = p.runtime.producer_stage_layer(rid, layer, 0, 5)
                if got is not None:
                    given[rid].append(layer)
                    p.copier.gather_piece(layer, idx[rid], got[0], got[1], group)
                assert p.runtime.layers_ready(layer, [(rid, 0, 5)]) == []
        for rid in src:
            p.runtime.producer_finish(rid)
        stats = p.runtime.stats()
        computed = [t.clone() for t in p.caches]

        def pages_back(rid: str) -> str:
            deadline = time.monotonic() + 0.3  # the finish reaches the producer on its own thread
            while (back := p.runtime.producer_give_back_pages(rid)) == "not_yet" and time.monotonic() < deadline:
                time.sleep(0.002)
            return back

        if whole:
            # a.l0, b.l0, a.l1; b.l1 misses and gives back b.l0; a.l2 gets it
            assert given == {"a": [0, 1, 2], "b": [0]}
            assert (stats["source_staging_full"], stats["source_pieces_given_up"]) == (LAYERS - 1, 1)
            assert pages_back("a") == "now"
            assert pages_back("b") == "not_yet", "b's layers are on its pages only"
            for t in p.caches:
                t[:, src["a"]] = 123.0  # vLLM gave a's blocks to other requests
        else:
            assert given == {"a": [0, 1], "b": [0]}
            assert (stats["source_staging_full"], stats["source_pieces_given_up"]) == (3, 0)
            assert (pages_back("a"), pages_back("b")) == ("not_yet", "not_yet")
        assert p.runtime.source_staging_in_use()[1] == LAYERS
        # decode authorizes both only now
        for rid in src:
            p.runtime.producer_handshake(c.runtime.consumer_open(rid, CAP, 0, dst[rid], 1))
        for _ in src:
            assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
            assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"
        every = [d for rid in src for d in dst[rid]]
        for layer in range(LAYERS):
            for rid in src:
                for s_, d in zip(src[rid], dst[rid]):
                    assert torch.equal(c.caches[layer][:, d], computed[layer][:, s_]), (rid, layer, s_, d)
            untouched = [b for b in range(BLOCKS) if b not in every]
            assert bool((c.caches[layer][:, untouched] == GUARD).all()), f"layer {layer}: unauthorized block written"
        assert p.runtime.source_staging_in_use() == (0, 0)
        for rid in src:
            c.runtime.consumer_release(rid)
            wait_event(c.runtime, {"consumer_released"})
        assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))
    finally:
        p.close()
        c.close()


@pytest.mark.parametrize("staging_ranks", [(0, 1), (1,)])
def test_tp2_to_tp1_scatters_only_the_heads_of_producers_that_staged(staging_ranks: tuple[int, ...]) -> None:
    c = Rank(GUARD, grants=True, sources=False)
    ps = [Rank(None, (r, 2), grants=False, sources=True) for r in range(2)]
    try:
        src, dst = [5, 0, 13, 8, 19, 2], [21, 3, 10, 17, 6, 12]
        hs = c.runtime.consumer_open("tp", CAP, 0, dst, 2)
        assert json.loads(hs)["staging"] is not None
        bases = {}
        for r, p in enumerate(ps):
            if r in staging_ranks:
                bases[r] = p.open_staged("tp", src)
            else:
                p.runtime.producer_open("tp", src, CAP)
            p.runtime.producer_handshake(hs)
            idx = p.copier.index(src)
            for layer in range(LAYERS):
                if r in bases:
                    base, cap, slots, group = bases[r]
                    p.copier.gather(layer, idx, 0, base, cap, slots, group)
                p.runtime.layer_ready("tp", layer, 0, len(src))
            p.runtime.producer_finish("tp")
        ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
        assert ev.staged is not None
        half = HEADS // 2
        # the staged heads, adjacent ones merged
        assert ev.staged[2] == ([(0, HEADS)] if len(staging_ranks) == 2 else [(half, HEADS)])
        scatter_completed(c, ev, dst)
        for r, p in enumerate(ps):
            check_pages(p, c, src, dst, slice(r * half, (r + 1) * half))
        c.runtime.consumer_release("tp")
        wait_event(c.runtime, {"consumer_released"})
        assert c.runtime.staging_in_use() == (0, 0)
    finally:
        for p in ps:
            p.close()
        c.close()


def test_tp1_to_tp2_stages_by_decode_heads_into_pages_or_a_whole_block_grant() -> None:
    """A TP 1 prefill gathers grouped by the heads of a decode rank (2 of
    4): to the rank whose blocks are consecutive (it takes no grant: one run
    of whole blocks is two ranges a layer) it writes straight into the
    pages, no scatter; to the one whose blocks are scattered into a grant of
    whole blocks, which that rank scatters."""
    p = Rank(None, grants=False, sources=True)
    cs = [Rank(GUARD, (r, 2), grants=True, sources=False) for r in range(2)]
    try:
        src = [5, 0, 13, 8, 19, 2, 11, 22, 16, 7]
        dsts = [list(range(6, 16)), [21, 3, 10, 17, 6, 12, 0, 14, 8, 19]]
        hss = [c.runtime.consumer_open("g", CAP, 0, dst, 1) for c, dst in zip(cs, dsts)]
        grants = [json.loads(h).get("staging") for h in hss]
        assert grants[0] is None and grants[1] is not None and grants[1].get("group") == HEADS // 2, grants
        base, cap, slots, group = p.open_staged("g", src, consumer_tp=2)
        assert group == HEADS // 2
        for h in hss:
            p.runtime.producer_handshake(h)
        for lo, hi in ((0, 4), (4, 10)):
            idx = p.copier.index(src[lo:hi])
            for layer in range(LAYERS):
                p.copier.gather(layer, idx, lo, base, cap, slots, group)
                assert p.runtime.layers_ready(layer, [("g", lo, hi)]) == []
        p.runtime.producer_finish("g")
        assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
        evs = [wait_event(c.runtime, {"consumer_completed", "consumer_failed"}) for c in cs]
        assert evs[0].kind == "consumer_completed" and evs[0].staged is None, evs[0]
        assert evs[1].staged == (grants[1]["base"], len(src), [(0, HEADS // 2)], HEADS // 2), evs[1]
        scatter_completed(cs[1], evs[1], dsts[1])
        half = HEADS // 2
        for r, (c, dst) in enumerate(zip(cs, dsts)):
            for layer in range(LAYERS):
                for s_, d in zip(src, dst):
                    want = p.caches[layer][:, s_, r * half : (r + 1) * half]
                    assert torch.equal(c.caches[layer][:, d], want), (r, layer, s_, d)
                untouched = [b for b in range(BLOCKS) if b not in dst]
                assert bool((c.caches[layer][:, untouched] == GUARD).all()), f"rank {r}: unauthorized block written"
        # rank 0's staging was never written; rank 1's outside its grant neither
        assert bool((cs[0].grants == STAGE_GUARD).all())
        g0 = (grants[1]["base"] - cs[1].grants.data_ptr()) // 4
        g1 = g0 + grants[1]["len"] // 4
        assert bool((cs[1].grants[:g0] == STAGE_GUARD).all()) and bool((cs[1].grants[g1:] == STAGE_GUARD).all())
        stats = p.runtime.stats()
        assert stats["layers_staged"] == 2 * 2 * LAYERS
        # rank 0's (consecutive blocks) went into its pages, rank 1's into its grant
        assert stats["layers_staged_to_pages"] == 2 * LAYERS
        # one range per plane, chunk and layer to each rank
        assert stats["write_ranges"] == 2 * 2 * 2 * LAYERS, stats
        for c in cs:
            c.runtime.consumer_release("g")
            wait_event(c.runtime, {"consumer_released"})
            assert c.runtime.staging_in_use() == (0, 0)
        p.arena.free(base)
    finally:
        p.close()
        for c in cs:
            c.close()


def test_bad_staging_is_refused_and_changes_nothing(pair: tuple[Rank, Rank]) -> None:
    p, c = pair
    # source staging outside the region
    with pytest.raises(orbitkv.InvalidArgumentError):
        p.runtime.producer_open("bad", [1, 2], CAP, staging_base=p.caches[0].data_ptr(), staging_blocks=2)
    # capacity beyond the region
    with pytest.raises(orbitkv.InvalidArgumentError):
        p.runtime.producer_open("bad", [1, 2], CAP, staging_base=p.sources.data_ptr(), staging_blocks=10_000)
    # a group that does not divide the block's heads
    with pytest.raises(orbitkv.InvalidArgumentError, match="group"):
        p.runtime.producer_open("bad", [1, 2], CAP, 2, staging_base=p.sources.data_ptr(), staging_blocks=2,
                                staging_group=3)
    # staged by layer: pieces come from the runtime, never from the caller
    with pytest.raises(orbitkv.InvalidArgumentError, match="staging_base"):
        p.runtime.producer_open("bad", [1, 2], CAP, stage_by_layer=True, staging_base=p.sources.data_ptr(),
                                staging_blocks=2)
    with pytest.raises(orbitkv.InvalidArgumentError, match="group"):
        p.runtime.producer_open("bad", [1, 2], CAP, stage_by_layer=True, staging_group=3)
    # a runtime without a source region stages nothing by layer
    with pytest.raises(orbitkv.InvalidArgumentError, match="source staging region"):
        c.runtime.producer_open("bad", [1, 2], CAP, stage_by_layer=True)
    assert p.runtime.live_requests() == (0, 0) and c.runtime.live_requests() == (0, 0)
    # pieces for a request staged by layer: only its own layers and blocks
    p.runtime.producer_open("layers", [1, 2], CAP, stage_by_layer=True)
    for layer, lo, hi in ((LAYERS, 0, 2), (0, 0, 3), (0, 2, 2), (0, 1, 0)):
        with pytest.raises(orbitkv.GeometryError):
            p.runtime.producer_stage_layer("layers", layer, lo, hi)
    # one not staged by layer has no pieces to give; an unknown one is unknown
    p.runtime.producer_open("plain", [3, 4], CAP)
    with pytest.raises(orbitkv.GeometryError):
        p.runtime.producer_stage_layer("plain", 0, 0, 2)
    with pytest.raises(orbitkv.UnknownRequestError):
        p.runtime.producer_stage_layer("nobody", 0, 0, 2)
    assert p.runtime.source_staging_in_use() == (0, 0), "nothing given to a bad call"
    for rid in ("layers", "plain"):
        p.runtime.producer_abort(rid, "test over")
        wait_event(p.runtime, {"producer_released"})
    # a grant shorter than its blocks stage to: the producer refuses the handshake
    hs = json.loads(c.runtime.consumer_open("short", CAP, 0, [1, 9, 3, 20, 7], 1))
    hs["staging"]["len"] -= 1
    with pytest.raises(orbitkv.HandshakeError, match="smaller than"):
        p.runtime.producer_handshake(json.dumps(hs))
    hs["staging"] = {"base": 0, "len": 1 << 20}
    with pytest.raises(orbitkv.HandshakeError, match="overflow"):
        p.runtime.producer_handshake(json.dumps(hs))
    hs["staging"] = {"base": 1, "len": 1 << 20, "extra": 1}
    with pytest.raises(orbitkv.HandshakeError):
        p.runtime.producer_handshake(json.dumps(hs))
    hs["staging"] = {"base": 1, "len": 1 << 20, "group": 3}
    with pytest.raises(orbitkv.HandshakeError, match="group"):
        p.runtime.producer_handshake(json.dumps(hs))
    # released by vLLM, but no producer ended: like its pages, the grant
    # stays held (until the quarantine after the deadline)
    c.runtime.consumer_release("short")
    assert c.runtime.staging_in_use()[1] == 1
    # overlapping staging regions are refused at start
    with pytest.raises(orbitkv.InvalidArgumentError):
        orbitkv.Runtime(
            p.engine,
            json.dumps(p.layout),
            staging_region=(p.sources.data_ptr(), 4096),
            source_staging_region=(p.sources.data_ptr() + 1024, 4096),
        )


def test_a_full_staging_region_writes_pages_directly() -> None:
    c = Rank(GUARD, grants=True, sources=False)
    try:
        # each grant of 20 blocks: 3 layers x 2 planes x 20 x 2 KiB = 240 KiB; 1 MiB holds 4
        ids = [[(k * 5 + i * 7) % BLOCKS for i in range(20)] for k in range(5)]
        got = [json.loads(c.runtime.consumer_open(f"r{k}", CAP, 0, x, 1)).get("staging") for k, x in enumerate(ids)]
        assert [g is not None for g in got] == [True] * 4 + [False]
        spans = sorted((g["base"], g["base"] + g["len"]) for g in got if g)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "grants overlap"
        assert c.runtime.stats()["staging_exhausted"] == 1
        for k in range(5):
            c.runtime.consumer_release(f"r{k}")
    finally:
        c.close()


def test_layer_pieces_cut_from_the_producers_own_kv_blocks() -> None:
    """``staging_memory`` ``kv_cache``: the runtime starts with no source
    staging and is handed the bytes of KV blocks the scheduler took out of
    vLLM's pool (``kv_staging.segments``). Before that every layer goes from
    the pages; after, each piece lies inside one segment (one plane's
    stripe of 5 blocks, less up to 255 bytes where the tensor is not
    256-byte aligned: a layer of a chunk of 3 blocks, 6 blocks' planes,
    never fits, though the segments hold 5 times as much in all), decode
    gets the same bytes, and nothing of the producer's KV outside the taken
    blocks changes."""
    from orbitkv.vllm.kv_staging import segments

    p = Rank(None, grants=False, sources=False, later=True)
    c = Rank(GUARD, grants=False, sources=False)
    try:
        taken = (1, 6)  # from block 1, as vLLM's pool gives them (0 is its null block)
        storages = [(t.data_ptr(), t.numel() * t.element_size()) for t in p.caches]
        segs = segments(p.layout, [taken], storages)
        p.copier.keep_out(taken[1])
        plane = HEADS * BLOCK * HEAD_DIM * 4
        assert len(segs) == 2 * LAYERS and all(n == 5 * plane for _, n in segs)
        before = [t.clone() for t in p.caches]
        group = p.runtime.staging_group(1)
        # before the segments: opened by layer, every layer from the pages
        src0, dst0 = [8, 9], [8, 9]
        hs = c.runtime.consumer_open("early", CAP, 0, dst0, 1)
        p.runtime.producer_open("early", src0, CAP, 1, staging_group=group, stage_by_layer=True)
        p.runtime.producer_handshake(hs)
        p.runtime.producer_gather_order("early", 0, 2)
        for layer in range(LAYERS):
            assert p.runtime.producer_stage_layer("early", layer, 0, 2) is None
            assert p.runtime.layers_ready(layer, [("early", 0, 2)]) == []
        p.runtime.producer_finish("early")
        assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"
        assert p.runtime.stats()["source_staging_full"] == LAYERS

        assert p.runtime.add_source_staging(segs) == (2 * LAYERS, 10 * LAYERS * plane)
        src, dst = [10, 11, 12, 13, 16, 17], [12, 13, 14, 15, 16, 17]
        hs = c.runtime.consumer_open("kv", CAP, 0, dst, 1)
        p.runtime.producer_open("kv", src, CAP, 1, staging_group=group, stage_by_layer=True)
        p.runtime.producer_handshake(hs)
        given = 0
        for lo, hi in ((0, 2), (2, 4), (4, 6)):
            order = p.runtime.producer_gather_order("kv", lo, hi) or list(range(lo, hi))
            idx = p.copier.index([src[i] for i in order])
            for layer in range(LAYERS):
                got = p.runtime.producer_stage_layer("kv", layer, lo, hi)
                if got is not None:
                    given += 1
                    base, slots = got
                    assert any(a <= base and base + 2 * 2 * plane <= a + n for a, n in segs), hex(base)
                    p.copier.gather_piece(layer, idx, base, slots, group)
                assert p.runtime.layers_ready(layer, [("kv", lo, hi)]) == []
        assert given >= LAYERS
        p.runtime.producer_finish("kv")
        ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
        assert ev.kind == "consumer_completed", ev
        check_pages(p, c, [*src0, *src], [*dst0, *dst])
        all_back(p)
        # a layer of 3 blocks needs 6 blocks' planes in one stripe of 5: never given
        p.runtime.producer_open("wide", [10, 11, 12], CAP, 1, staging_group=group, stage_by_layer=True)
        p.runtime.producer_gather_order("wide", 0, 3)
        assert p.runtime.producer_stage_layer("wide", 0, 0, 3) is None
        p.runtime.producer_abort("wide", "test over")
        # the copier refuses a taken block as a request's
        with pytest.raises(ValueError, match="below 6"):
            p.copier.index([7, 5])
        for t, b in zip(p.caches, before):
            keep = [i for i in range(BLOCKS) if not taken[0] <= i < taken[1]]
            assert torch.equal(t[:, keep], b[:, keep]), "a piece was written outside the taken blocks"
        # all or nothing: an overlapping segment adds none; a runtime that
        # was not started for it takes none
        with pytest.raises(orbitkv.InvalidArgumentError, match="overlaps"):
            p.runtime.add_source_staging([(p.caches[0][0, 20].data_ptr(), plane), (segs[0][0] - 4096, 8192)])
        assert p.runtime.add_source_staging([]) == (2 * LAYERS, 10 * LAYERS * plane), "a segment was added"
        with pytest.raises(orbitkv.InvalidArgumentError, match="source_staging_later"):
            c.runtime.add_source_staging(segs)
        for rid in ("early", "kv"):
            c.runtime.consumer_release(rid)
    finally:
        p.close()
        c.close()


@pytest.mark.parametrize("room", ["enough", "none"])
def test_the_writer_gathers_scattered_pages_into_a_piece_for_the_write_alone(room: str) -> None:
    """``staging_pieces`` ``write``: nothing is gathered at the layer's
    launch; a writer lane about to send a layer write whose source blocks
    are scattered copies them (memcpy here) into one piece of the source
    region in decode's order and writes one range per plane and run of
    decode blocks, then gives the piece back. Two chunks sharing block 4
    (chunked prefill), decode's blocks one run. Decode's pages equal the
    prefill's blocks either way, nothing is written outside them, and a
    region without room for a layer writes from the pages."""
    piece = 2 * 6 * HEADS * BLOCK * HEAD_DIM  # floats of the larger chunk's layer (6 blocks)
    p = Rank(None, grants=False, sources=True, gather=True,
             source_floats=STAGE_FLOATS if room == "enough" else piece // 2)
    c = Rank(GUARD, grants=False, sources=False)
    try:
        assert not p.runtime.writer_gathers()
        with pytest.raises(orbitkv.InvalidArgumentError):
            p.runtime.set_writer_gather("gpu")
        with pytest.raises(orbitkv.InvalidArgumentError):
            c.runtime.set_writer_gather("host")  # no gather_in_writer there
        for gpu in ("cuda", "cuda-copy-engines"):
            # no CUDA driver here (CI): a typed error, and the lanes keep on
            # writing from the pages
            with pytest.raises(orbitkv.CudaError, match="libcuda"):
                p.runtime.set_writer_gather(gpu)
            assert not p.runtime.writer_gathers()
        assert p.runtime.set_writer_gather("host") == "memcpy"
        assert p.runtime.writer_gathers()
        src = [2, 9, 4, 11, 6, 13, 8, 15, 10, 17]  # no two consecutive
        dst = list(range(5, 15))
        hs = c.runtime.consumer_open("gathered", CAP, 0, dst, 1)
        p.runtime.producer_open("gathered", src, CAP, 1)
        p.runtime.producer_handshake(hs)
        for lo, hi in ((0, 5), (4, 10)):
            for layer in range(LAYERS):
                assert p.runtime.layers_ready(layer, [("gathered", lo, hi)]) == []
        stats = finished_into_pages(p, c, "gathered", src, dst)
        writes = 2 * LAYERS  # two chunks, every layer
        if room == "enough":
            assert stats["writes_gathered"] == writes
            # per layer write: one range per plane (decode's blocks one run)
            assert stats["write_ranges"] == writes * 2, stats
            assert stats["gather_ranges_saved"] == LAYERS * 2 * (5 - 1 + 6 - 1)
            assert stats["gather_no_room"] == 0
        else:
            assert stats["writes_gathered"] == 0
            assert stats["gather_no_room"] == writes
            assert stats["write_ranges"] == LAYERS * 2 * (5 + 6), "a range per plane and block"
        assert stats["gather_failed"] == stats["gather_pieces_leaked"] == 0
        assert stats["layers_staged_to_pages"] == 0, "no layer piece was given at launch"
        assert p.runtime.source_staging_in_use() == (0, 0), "every piece back"
        c.runtime.consumer_release("gathered")
        wait_event(c.runtime, {"consumer_released"})
        assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))
        # off: the next request writes from the pages
        assert p.runtime.set_writer_gather("off") == "off"
        assert not p.runtime.writer_gathers()
    finally:
        p.close()
        c.close()
