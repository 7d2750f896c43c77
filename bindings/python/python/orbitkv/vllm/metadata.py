"""What the scheduler side tells the worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ConsumerOpen:
    """Decode: authorize these blocks and send the handshake to the producers."""

    req_id: str
    pd_id: str
    capability: str
    first_block: int
    block_ids: list[int]
    prefill_kv: str
    prefill_tp: int
    # The request's tokens decode loads, from its start (its prompt length):
    # what a prefill of another block size writes up to.
    tokens: int = 0


@dataclass
class ProducerChunk:
    """Prefill: this step computes request blocks ``[start_block, end_block)``."""

    req_id: str
    pd_id: str
    capability: str
    consumer_tp: int
    opens: bool
    new_block_ids: list[int]
    start_block: int
    end_block: int
    last: bool
    # Blocks of the whole prompt (a staging request holds this many).
    prompt_blocks: int = 0


@dataclass
class RequestEnd:
    """vLLM finished a P/D request (``aborted`` when it did not complete).

    ``report``: the scheduler delayed freeing the blocks, so the worker
    must report the request once no transfer can touch them any more.
    ``after_load``: decode only; the load failed and vLLM ran the request on
    (recompute policy), so the worker had already reported it: it reports it
    again once the runtime frees the blocks (a producer that never ended may
    still write into them).
    """

    req_id: str
    pd_id: str
    aborted: bool
    reason: str
    report: bool
    after_load: bool = False


@dataclass
class ConsumerCancel:
    """Decode: vLLM finished the request before it was authorized; tell the
    producers no handshake will come, so they free their source blocks."""

    pd_id: str
    capability: str
    prefill_kv: str
    prefill_tp: int
    reason: str


@dataclass
class ProducerDiscard:
    """Prefill: vLLM finished the request before scheduling it; tell its
    consumer now that nothing will come."""

    pd_id: str
    capability: str
    reason: str


@dataclass
class ProducerUnclaimed:
    """Prefill: vLLM finished the request and holds its blocks for a decode
    that has not claimed it (past the claim deadline, or beyond the
    unclaimed cap): give it up unless a handshake came meanwhile."""

    pd_id: str
    reason: str


@dataclass
class PdConnectorMetadata(KVConnectorMetadata):
    consumers_open: list[ConsumerOpen] = field(default_factory=list)
    producer_chunks: list[ProducerChunk] = field(default_factory=list)
    consumers_end: list[RequestEnd] = field(default_factory=list)
    producers_end: list[RequestEnd] = field(default_factory=list)
    consumers_cancel: list[ConsumerCancel] = field(default_factory=list)
    producers_discard: list[ProducerDiscard] = field(default_factory=list)
    producers_unclaimed: list[ProducerUnclaimed] = field(default_factory=list)
    # Requests served plainly since the last step because their params were
    # refused (the worker counts them: `params_refused`).
    refused: int = 0
    # The blocks the scheduler took out of vLLM's pool for the source
    # staging (orbitkv.pd.staging_memory "kv_cache"), as runs [start, end):
    # in every step's metadata, taken by each worker the first time.
    staging_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Set in every step's metadata once the scheduler gave those blocks back
    # to vLLM (a kv_both instance that only decoded): the workers stage no
    # more (they never gathered into the blocks, as no request prefilled).
    staging_released: bool = False
