"""The ``kv_transfer_params`` keys OrbitKV reads on a request.

The proxy (``python -m orbitkv.proxy``) sets them; anyone driving vLLM
directly can set them too. Imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

ROLE = "orbitkv_role"
REQUEST = "orbitkv_request"
PREFILL_KV = "orbitkv_prefill_kv"
PREFILL_TP = "orbitkv_prefill_tp"

PRODUCER = "producer"
CONSUMER = "consumer"


class RequestParamsError(ValueError):
    """A request's ``kv_transfer_params`` are malformed."""


@dataclass(frozen=True)
class PdParams:
    """OrbitKV's part of one request's ``kv_transfer_params``."""

    role: str
    request: str
    prefill_kv: str | None = None
    prefill_tp: int = 1

    @staticmethod
    def parse(params: Mapping[str, Any] | None) -> "PdParams | None":
        """``None`` when the request is not an OrbitKV P/D request."""
        if not params or ROLE not in params:
            return None
        role = params.get(ROLE)
        if role not in (PRODUCER, CONSUMER):
            raise RequestParamsError(f"{ROLE} must be {PRODUCER!r} or {CONSUMER!r}, got {role!r}")
        request = params.get(REQUEST)
        if not isinstance(request, str) or not request:
            raise RequestParamsError(f"{REQUEST} must be a non-empty string, got {request!r}")
        prefill_kv = params.get(PREFILL_KV)
        tp = params.get(PREFILL_TP, 1)
        if role == CONSUMER:
            if not isinstance(prefill_kv, str) or ":" not in prefill_kv:
                raise RequestParamsError(
                    f"{PREFILL_KV} must be the prefill's side channel 'host:port', got {prefill_kv!r}"
                )
            if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
                raise RequestParamsError(f"{PREFILL_TP} must be a positive integer, got {tp!r}")
        return PdParams(role=role, request=request, prefill_kv=prefill_kv, prefill_tp=int(tp))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {ROLE: self.role, REQUEST: self.request}
        if self.prefill_kv is not None:
            out[PREFILL_KV] = self.prefill_kv
            out[PREFILL_TP] = self.prefill_tp
        return out
