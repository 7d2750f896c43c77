"""A P/D cluster on loopback: a prefill vLLM server, a decode vLLM server
(both with OrbitKV's ``PdConnector``) and ``orbitkv.proxy`` in front.

Used by the demo (``python -m orbitkv.demo``), the end-to-end tests
(``bindings/python/tests/e2e``) and the time-to-first-token benchmark
(``benches/ttft.py``)::

    from orbitkv.testing.cluster import Cluster, complete
    from orbitkv.testing.tiny_model import make_tiny_model

    with Cluster(make_tiny_model("/tmp/tiny"), run_dir="/tmp/run") as c:
        print(complete(c.proxy_url, [5, 6, 7], max_tokens=8).text)

Each process runs in a process group of its own (vLLM's engine core and
worker are children of its API server) and writes one log file under the run
directory. Every wait is bounded and polls the processes, so a server that
dies fails the wait at once, naming its log. :meth:`Cluster.stop` (also on
``with`` exit, and at interpreter exit for clusters still running) sends the
groups SIGTERM, then SIGKILL after a grace period.

Only the standard library is used on the client side (``http.client``), so a
client can drop a connection at a moment of its choosing (aborts).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BYTES",
    "COMPLETED",
    "FAILED",
    "RELEASED",
    "SERVED_MODEL",
    "SUCCESS",
    "Cluster",
    "ClusterError",
    "Completion",
    "Proc",
    "complete",
    "free_port",
    "metrics",
    "prompt_source",
    "wait_until",
]

HOST = "127.0.0.1"
SERVED_MODEL = "tiny"
# vLLM's KV cache per instance: 256 blocks of 128 tokens for the tiny model.
KV_CACHE_BYTES = 128 << 20


# Prometheus series the tests read (``metrics`` sums each over its labels).
SUCCESS = "vllm:request_success_total"
COMPLETED = "vllm:orbitkv_transfers_completed_total"
FAILED = "vllm:orbitkv_transfers_failed_total"
RELEASED = "vllm:orbitkv_producers_released_total"
BYTES = "vllm:orbitkv_bytes_written_total"


def prompt_source(seed: int) -> Callable[[int], list[int]]:
    """A source of fresh prompts: each call returns ``n`` token ids from a
    new seed (``seed``, ``seed + 1``, ...), so no two prompts share a prefix
    (no prefix-cache hit flatters a result). Give each test module its own
    ``seed`` range."""
    seeds = iter(range(seed, seed + 10**6))

    def fresh_prompt(n: int) -> list[int]:
        rng = random.Random(next(seeds))
        return [rng.randrange(3, 1024) for _ in range(n)]

    return fresh_prompt


class ClusterError(RuntimeError):
    """A process of the cluster failed to start, died, or a wait ran out."""


# Ports handed out: below the kernel's ephemeral range (32768+ by default),
# so no outgoing connection takes one between our check and the server's
# bind, and away from Mooncake's (12001, 15000-17000).
_PORTS = (20000, 32000)
_taken: set[int] = set()
_ports_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, with the
    ``span - 1`` ports after it free too (a TP instance's side channels),
    outside the ephemeral range and never handed out twice by this process."""
    rng = random.Random()
    with _ports_lock:
        for _ in range(500):
            p = rng.randrange(_PORTS[0], _PORTS[1] - span)
            ports = range(p, p + span)
            if not _taken.intersection(ports) and all(_bindable(q) for q in ports):
                _taken.update(ports)
                return p
    raise ClusterError(f"no {span} free port(s) in {_PORTS[0]}..{_PORTS[1]}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text[-lines:])


class Proc:
    """One process of the cluster, in its own process group, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab", buffering=0)
        self._log.write(f"# {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
        self.popen = subprocess.Popen(
            self.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killpg reaches vLLM's children
        )
        self.pgid = self.popen.pid
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check(self) -> None:
        """Raises :class:`ClusterError` (with the log's tail) if the process ended."""
        rc = self.popen.poll()
        if rc is not None:
            raise ClusterError(
                f"{self.name} (pid {self.pid}) exited with {rc}; log {self.log_path}:\n{_tail(self.log_path)}"
            )

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False

    def group_alive(self) -> bool:
        """Whether any process of its group is left (vLLM's children included)."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def kill(self) -> None:
        """SIGKILL to the whole group, now (a crash, as far as peers can tell)."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process (vLLM's API server then shuts its engine
        down), after half of ``grace_s`` SIGTERM to the whole group, and
        SIGKILL to what is left after ``grace_s``."""
        if self.group_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            group_term = time.monotonic() + grace_s / 2
            while time.monotonic() < deadline and self.group_alive():
                if self.popen.poll() is not None or time.monotonic() >= group_term:
                    if group_term < float("inf"):
                        self._signal_group(signal.SIGTERM)
                        group_term = float("inf")
                time.sleep(0.1)
            self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        with contextlib.suppress(OSError):
            self._log.close()


def wait_until(
    pred: Any, timeout_s: float, what: str | Any, procs: Sequence[Proc] = (), every_s: float = 0.1
) -> Any:
    """Polls ``pred()`` until it returns something truthy (returned), checking
    that ``procs`` are alive between polls. Raises :class:`ClusterError` when
    a process died or ``timeout_s`` passed (``what``, a string or a callable
    giving one, says what was awaited)."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        for p in procs:
            p.check()
        try:
            got = pred()
            if got:
                return got
        except (OSError, http.client.HTTPException, ValueError) as e:
            last_exc = e
        if time.monotonic() >= deadline:
            extra = f" (last error: {type(last_exc).__name__}: {last_exc})" if last_exc else ""
            desc = what() if callable(what) else what
            raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {desc}{extra}")
        time.sleep(every_s)


# ---- HTTP client helpers ---------------------------------------------------


def _split(url: str) -> tuple[str, int]:
    assert url.startswith("http://"), url
    host, port = url[len("http://") :].rstrip("/").rsplit(":", 1)
    return host, int(port)


def http_get(url: str, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_post_json(
    url: str, path: str, body: dict[str, Any], timeout_s: float = 120.0
) -> tuple[int, Any, dict[str, str]]:
    """POST JSON, read the whole answer: (status, parsed JSON or text, headers)."""
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        headers = {k.lower(): v for k, v in r.getheaders()}
        try:
            return r.status, json.loads(data), headers
        except ValueError:
            return r.status, data.decode(errors="replace"), headers
    finally:
        conn.close()


def healthy(url: str) -> bool:
    status, _ = http_get(url, "/health", timeout_s=2.0)
    return status == 200


def metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A server's Prometheus metrics, each name summed over its label sets
    (``_created`` series left out)."""
    status, body = http_get(url, "/metrics", timeout_s)
    if status != 200:
        raise ClusterError(f"{url}/metrics answered {status}")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Completion:
    """One completion: what came back and when."""

    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # request sent -> first token (streaming only)
    total_s: float = 0.0
    request_id: str | None = None  # the proxy's P/D request id (X-Request-Id)
    error: Any = None
    body: Any = None
    finish_reason: str | None = None  # the choice's, as vLLM sent it ("length", "error", ...)

    def failed(self, max_tokens: int) -> bool:
        """Whether the request did not produce its ``max_tokens`` (with
        ``ignore_eos``): an error status, ``finish_reason: error``, or a
        stream that ended early. vLLM 0.26 ends the stream of a request
        whose KV failed to load with a bare ``data: [DONE]`` (status 200)."""
        return self.status != 200 or self.finish_reason == "error" or len(self.token_ids) < max_tokens


def completion_body(
    prompt: str | list[int], max_tokens: int, stream: bool = False, **extra: Any
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request that returns the token ids."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    body.update(extra)
    return body


def complete(
    url: str,
    prompt: str | list[int],
    max_tokens: int = 16,
    stream: bool = False,
    timeout_s: float = 120.0,
    **extra: Any,
) -> Completion:
    """Sends one greedy completion to ``url`` (a vLLM server or the proxy).
    Streaming requests measure the time to the first token."""
    body = completion_body(prompt, max_tokens, stream, **extra)
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        rid = r.getheader("X-Request-Id")
        if r.status != 200:
            raw = r.read()
            try:
                err: Any = json.loads(raw)
            except ValueError:
                err = raw.decode(errors="replace")
            return Completion(r.status, total_s=time.monotonic() - t0, request_id=rid, error=err)
        if not stream:
            data = json.loads(r.read())
            ch = data["choices"][0]
            return Completion(
                200,
                text=ch.get("text", ""),
                token_ids=list(ch.get("token_ids") or []),
                total_s=time.monotonic() - t0,
                request_id=rid,
                body=data,
                finish_reason=ch.get("finish_reason"),
            )
        out = Completion(200, request_id=rid)
        pieces: list[str] = []
        for event in _sse_events(r):
            if event == "[DONE]":
                break
            data = json.loads(event)
            if "error" in data:
                out.status = int(data["error"].get("code") or 500)
                out.error = data["error"]
                break
            for ch in data.get("choices", ()):
                ids = ch.get("token_ids") or []
                if (ids or ch.get("text")) and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
                pieces.append(ch.get("text") or "")
                out.token_ids.extend(ids)
                out.finish_reason = ch.get("finish_reason") or out.finish_reason
        out.text = "".join(pieces)
        out.total_s = time.monotonic() - t0
        return out
    finally:
        conn.close()


def _sse_events(r: http.client.HTTPResponse) -> Iterator[str]:
    while True:
        line = r.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip().decode()


class Abandoned:
    """A completion request whose client walks away: :meth:`drop` closes the
    connection (vLLM, or the proxy, then aborts the request)."""

    def __init__(self, url: str, prompt: str | list[int], max_tokens: int = 16, stream: bool = True, **extra: Any):
        host, port = _split(url)
        self.sock = socket.create_connection((host, port), timeout=30)
        body = json.dumps(completion_body(prompt, max_tokens, stream, **extra)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + body)
        self.sent = time.monotonic()

    def drop(self) -> None:
        # RST rather than FIN: the server sees the disconnect at once.
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        with contextlib.suppress(OSError):
            self.sock.close()


# ---- the cluster -------------------------------------------------------------

_RUNNING: set[Cluster] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _RUNNING_LOCK:
        left = list(_RUNNING)
    for c in left:
        with contextlib.suppress(Exception):
            c.stop()


# A TP > 1 instance's workers re-check vLLM's step ring at least this often
# when parked (vLLM 0.26.0 bug, fixed upstream by vllm-project/vllm#45224;
# 0 leaves vLLM as it is).
SHM_RECHECK_MS = int(os.environ.get("ORBITKV_TESTING_SHM_RECHECK_MS", "100"))
SHM_SPIN_S = os.environ.get("ORBITKV_TESTING_SHM_SPIN_S", "0")
SHIMS_DIR = Path(__file__).parent / "vllm_shims"


def vllm_env(omp_bind: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a vLLM CPU server runs in here (docs: vllm-cpu.md)."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_HOST_IP": HOST,
            "TORCHDYNAMO_DISABLE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "1"),
        }
    )
    env.update(extra or {})
    return env


@dataclass
class InstanceSpec:
    """One vLLM instance of the cluster."""

    name: str
    port: int
    side_channel_port: int
    omp_bind: str
    extra_config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"
    tp: int = 1
    # Where its API listens, and where its Mooncake engine and side channel
    # listen (both loopback unless the instance runs in a network namespace).
    host: str = HOST
    data_host: str = HOST
    # ``NetnsLink`` it runs inside, or None.
    netns: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Cluster:
    """Prefill + decode vLLM servers with the PdConnector and the proxy.

    ``model``: a model directory (``make_tiny_model``). ``run_dir``: where
    the logs (``prefill.log``, ``decode.log``, ``proxy.log``) and traces go.
    ``side_channel_ports``: the ``orbitkv.pd.side_channel_port`` bases of
    prefill and decode (``None``: free ports). ``timeout_s``:
    ``orbitkv.pd.timeout_s`` of both. ``kv_load_failure_policy``: decode's.
    ``trace``: sets ``ORBITKV_TRACE`` so each instance's worker writes a
    Chrome trace (``trace.prefill.json``, ``trace.decode.json``).
    ``prefill_env``/``decode_env``: extra environment (test hooks).
    ``vllm_args``: extra arguments for both servers. ``connector=False``
    starts both servers without a connector (and no proxy).
    ``prefill_netns``: a created :class:`orbitkv.testing.netns.NetnsLink`;
    the prefill then runs inside it, its API on the control link and its
    Mooncake engine and side channel on the data link, and decode's Mooncake
    engine listens on the data link's outer address (fault tests).
    ``more_prefills``: further prefill instances (``prefill2``, ...; TP 1, the
    prefill's configuration and environment) behind the same proxy.
    """

    def __init__(
        self,
        model: str,
        run_dir: str | os.PathLike[str],
        *,
        ports: tuple[int, int, int] | None = None,
        side_channel_ports: tuple[int | None, int | None] = (None, None),
        timeout_s: float | None = None,
        kv_load_failure_policy: str = "fail",
        trace: bool = False,
        prefill_env: dict[str, str] | None = None,
        decode_env: dict[str, str] | None = None,
        prefill_config: dict[str, Any] | None = None,
        decode_config: dict[str, Any] | None = None,
        vllm_args: Sequence[str] = (),
        connector: bool = True,
        start_timeout_s: float = 300.0,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_netns: Any = None,
        more_prefills: int = 0,
    ):
        self.model = str(model)
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.connector = connector
        self.vllm_args = list(vllm_args)
        self.start_timeout_s = start_timeout_s
        self.trace = trace
        self.timeout_s = timeout_s  # orbitkv.pd.timeout_s (None: the default, 120 s)
        pp, dp, xp = ports or (free_port(), free_port(), free_port())
        sc_p, sc_d = side_channel_ports
        common: dict[str, Any] = {}
        if timeout_s is not None:
            common["orbitkv.pd.timeout_s"] = timeout_s
        # A TP instance binds one core per rank ("0|1"); its side channel
        # ports are base + rank, so keep a gap of the TP size.
        self.prefill = InstanceSpec(
            "prefill",
            pp,
            sc_p or free_port(prefill_tp),
            "|".join(str(r % 2) for r in range(prefill_tp)),
            {**common, **(prefill_config or {})},
            dict(prefill_env or {}),
            tp=prefill_tp,
        )
        self.decode = InstanceSpec(
            "decode",
            dp,
            sc_d or free_port(decode_tp),
            "|".join(str((r + 1) % 2) for r in range(decode_tp)),
            {**common, **(decode_config or {})},
            dict(decode_env or {}),
            kv_load_failure_policy,
            tp=decode_tp,
        )
        self.more_prefills = [
            InstanceSpec(
                f"prefill{i + 2}",
                free_port(),
                free_port(),
                str(i % 2),
                dict(self.prefill.extra_config),
                dict(self.prefill.env),
            )
            for i in range(more_prefills)
        ]
        if prefill_netns is not None:
            ns = prefill_netns
            self.prefill.netns = ns
            self.prefill.host, self.prefill.data_host = ns.ctl_inside, ns.data_inside
            self.decode.data_host = ns.data_outside
            self.decode.extra_config.setdefault("orbitkv.pd.allowed_prefill", [ns.data_inside])
        self.proxy_port = xp
        self.procs: dict[str, Proc] = {}

    # ---- addresses ---------------------------------------------------------

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def proxy_url(self) -> str:
        return f"http://{HOST}:{self.proxy_port}"

    @property
    def prefill_kv(self) -> str:
        return f"{self.prefill.data_host}:{self.prefill.side_channel_port}"

    @property
    def prefills(self) -> list[InstanceSpec]:
        return [self.prefill, *self.more_prefills]

    @property
    def servers(self) -> list[str]:
        """Names of the vLLM servers (prefills first, then decode)."""
        return [p.name for p in self.prefills] + ["decode"]

    def spec(self, name: str) -> InstanceSpec:
        for sp in (*self.prefills, self.decode):
            if sp.name == name:
                return sp
        raise KeyError(name)

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def trace_path(self, name: str) -> Path:
        return self.run_dir / f"trace.{name}.json"

    # ---- commands ----------------------------------------------------------

    def kv_transfer_config(self, spec: InstanceSpec) -> dict[str, Any]:
        return {
            "kv_connector": "PdConnector",
            "kv_connector_module_path": "orbitkv.vllm.pd",
            "kv_role": "kv_both",
            "engine_id": spec.name,
            "kv_load_failure_policy": spec.kv_load_failure_policy,
            "kv_connector_extra_config": {
                "orbitkv.pd.mooncake.bind_host": spec.data_host,
                "orbitkv.pd.side_channel_port": spec.side_channel_port,
                **spec.extra_config,
            },
        }

    def server_argv(self, spec: InstanceSpec) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            SERVED_MODEL,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--host",
            spec.host,
            "--port",
            str(spec.port),
            *(["--tensor-parallel-size", str(spec.tp)] if spec.tp > 1 else []),
            *self.vllm_args,
        ]
        if self.connector:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(spec))]
        return spec.netns.wrap(argv) if spec.netns is not None else argv

    def server_env(self, spec: InstanceSpec) -> dict[str, str]:
        extra = dict(spec.env)
        if self.trace:
            extra.setdefault("ORBITKV_TRACE", str(self.trace_path(spec.name)))
        env = vllm_env(spec.omp_bind, extra)
        env["VLLM_HOST_IP"] = spec.data_host
        if SHM_RECHECK_MS:
            # vLLM 0.26.0 can lose a worker's step wake-up (fixed upstream in
            # vllm-project/vllm#45224): see vllm_shims/sitecustomize.py.
            # A TP 1 instance runs its one worker behind the same ring.
            env.setdefault("ORBITKV_TESTING_SHM_RECHECK_MS", str(SHM_RECHECK_MS))
            # ... and its readers busy-wait for a second after each read,
            # which on two cores starves everything else: see the same file.
            env.setdefault("ORBITKV_TESTING_SHM_SPIN_S", SHM_SPIN_S)
        # The shims are inert unless their ORBITKV_TESTING_* variables are set.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIMS_DIR), env.get("PYTHONPATH", "")) if p)
        return env

    def proxy_argv(self) -> list[str]:
        prefills: list[str] = []
        for sp in self.prefills:
            prefills += ["--prefill", sp.url, "--prefill-kv", f"{sp.data_host}:{sp.side_channel_port}"]
        return [
            sys.executable,
            "-m",
            "orbitkv.proxy",
            *prefills,
            "--decode",
            self.decode_url,
            "--decode-tp",
            str(self.decode.tp),
            "--host",
            HOST,
            "--port",
            str(self.proxy_port),
        ]

    # ---- life --------------------------------------------------------------

    def start(self) -> Cluster:
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        try:
            for name in self.servers:
                self.start_server(name, wait=False)
            self.wait_healthy(self.servers)
            if self.connector:
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                self.procs["proxy"] = Proc("proxy", self.proxy_argv(), env, self.log("proxy"))
                self.wait_healthy(("proxy",), timeout_s=60)
        except BaseException:
            self.stop()
            raise
        return self

    def start_server(self, name: str, wait: bool = True) -> Proc:
        """(Re)starts the prefill or decode server."""
        spec = self.spec(name)
        old = self.procs.get(name)
        if old is not None:
            old.stop()
        p = Proc(name, self.server_argv(spec), self.server_env(spec), self.log(name))
        self.procs[name] = p
        if wait:
            self.wait_healthy((name,))
        return p

    def url_of(self, name: str) -> str:
        return self.proxy_url if name == "proxy" else self.spec(name).url

    def wait_healthy(self, names: Sequence[str], timeout_s: float | None = None) -> None:
        procs = [self.procs[n] for n in names]
        for n in names:
            wait_until(
                lambda n=n: healthy(self.url_of(n)),
                timeout_s or self.start_timeout_s,
                f"{n} at {self.url_of(n)} to be healthy (log {self.log(n)})",
                procs,
                every_s=0.5,
            )

    def check_alive(self, names: Sequence[str] = ("prefill", "decode", "proxy")) -> None:
        for n in names:
            if n in self.procs:
                self.procs[n].check()

    def kill(self, name: str) -> None:
        """SIGKILL a process group of the cluster (prefill, decode or proxy)."""
        self.procs[name].kill()

    def stop(self) -> None:
        for name in ("proxy", *reversed(self.servers)):
            p = self.procs.get(name)
            if p is not None:
                p.stop()
        with _RUNNING_LOCK:
            _RUNNING.discard(self)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- conveniences --------------------------------------------------------

    def wait_for_traces(self, request_ids: Sequence[str], timeout_s: float = 20.0) -> bool:
        """With ``trace=True``: waits until both instances' trace files name
        every one of ``request_ids`` (the workers rewrite them every 5 s while
        something new was recorded; do not count on a flush at shutdown).
        Returns whether they do."""

        def has_all() -> bool:
            for name in ("prefill", "decode"):
                try:
                    text = self.trace_path(name).read_text(errors="replace")
                except OSError:
                    return False
                if not all(i in text for i in request_ids):
                    return False
            return True

        try:
            wait_until(has_all, timeout_s, "the traces to name every request", list(self.procs.values()), every_s=0.5)
            return True
        except ClusterError:
            return False

    def metrics(self, name: str) -> dict[str, float]:
        return metrics(self.url_of(name))

    def idle(self, name: str) -> bool:
        """No request running or waiting and no KV block held on that server."""
        m = self.metrics(name)
        return (
            m.get("vllm:num_requests_running", -1) == 0
            and m.get("vllm:num_requests_waiting", -1) == 0
            and m.get("vllm:kv_cache_usage_perc", -1) == 0
        )

    def wait_idle(self, names: Sequence[str] = ("prefill", "decode"), timeout_s: float = 60.0) -> None:
        """Waits until each server holds no request and no block (see :meth:`idle`)."""
        for n in names:
            wait_until(
                lambda n=n: self.idle(n),
                timeout_s,
                lambda n=n: f"{n} to hold no request and no KV block (now: {self._usage(n)})",
                [self.procs[k] for k in ("prefill", "decode") if k in self.procs and self.procs[k].alive()],
                every_s=0.25,
            )

    def _usage(self, name: str) -> str:
        try:
            m = self.metrics(name)
        except Exception as e:  # noqa: BLE001 - only for a message
            return f"unavailable: {e}"
        keys = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        return ", ".join(f"{k}={m.get(k)}" for k in keys)
