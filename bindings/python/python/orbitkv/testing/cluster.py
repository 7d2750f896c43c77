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

The processes live in ``orbitkv.testing.processes``, the client side
(standard library only, so a client can drop a connection at a moment of its
choosing) in ``orbitkv.testing.client``; this module re-exports what the
tests use.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbitkv.testing.client import (
    SERVED_MODEL,
    Abandoned,
    Completion,
    complete,
    completion_body,
    healthy,
    http_get,
    http_post_json,
    metrics,
    prompt_source,
)
from orbitkv.testing.processes import HOST, ClusterError, Proc, free_port, wait_until

__all__ = [
    "BLOCK",
    "IDLE_TIMEOUT_S",
    "REQ_TIMEOUT_S",
    "SERVED_MODEL",
    "Abandoned",
    "Cluster",
    "ClusterError",
    "Completion",
    "Metric",
    "Proc",
    "complete",
    "completion_body",
    "free_port",
    "healthy",
    "http_get",
    "http_post_json",
    "metrics",
    "prompt_source",
    "wait_until",
]

# vLLM's KV cache per instance: 256 blocks of 128 tokens for the tiny model.
KV_CACHE_BYTES = 128 << 20


# vLLM's CPU block size in tokens (the test servers do not set --block-size).
BLOCK = 128
# How long a test waits for one completion, and for every instance to hold
# no request and no KV block (the cluster's orbitkv.pd.timeout_s bounds every
# wait for a peer).
REQ_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 45.0


class Metric:
    """The Prometheus series the tests read (``metrics`` sums each over its
    labels)."""

    SUCCESS = "vllm:request_success_total"
    COMPLETED = "vllm:orbitkv_transfers_completed_total"
    FAILED = "vllm:orbitkv_transfers_failed_total"
    RELEASED = "vllm:orbitkv_producers_released_total"
    BYTES = "vllm:orbitkv_bytes_written_total"


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


# Every instance's workers re-check vLLM's step ring at least this often
# when parked (vLLM 0.26.0 can lose a step wake-up, fixed upstream by
# vllm-project/vllm#45224; 0 leaves vLLM as it is). With the busy-wait off
# (below) a CPU worker often misses its wake-up and waits for this re-check:
# at 100 ms every decode step took ~100 ms (benches/itl.py's finding), at
# 5 ms the P/D end-to-end module ran in 124 s instead of 250 s.
SHM_RECHECK_MS = int(os.environ.get("ORBITKV_TESTING_SHM_RECHECK_MS", "5"))
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


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
    # Extra vLLM arguments of this instance alone (after the cluster's).
    args: list[str] = field(default_factory=list)
    # vLLM's kv_role: kv_both (what the README deploys), or kv_producer /
    # kv_consumer (a prefill-only / decode-only instance).
    kv_role: str = "kv_both"

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
    ``vllm_args``: extra arguments for both servers; ``prefill_args``,
    ``decode_args``: for one of them (after ``vllm_args``: e.g. another
    ``--block-size`` on each). ``connector=False``
    starts both servers without a connector (and no proxy).
    ``prefill_netns``: a created :class:`orbitkv.testing.netns.NetnsLink`;
    the prefill then runs inside it, its API on the control link and its
    Mooncake engine and side channel on the data link, and decode's Mooncake
    engine listens on the data link's outer address (fault tests).
    ``more_prefills``: further prefill instances (``prefill2``, ...; TP 1, the
    prefill's configuration and environment) behind the same proxy.
    ``vllm_router``: vllm-router (``--vllm-pd-disaggregation``, its default
    ``nixl`` mode: the two-stage flow) in front of the same instances;
    ``mooncake_router``: another one in its ``--kv-connector mooncake`` mode,
    each prefill's bootstrap port being its side channel port (the instances
    need ``orbitkv.pd.dialects: ["mooncake"]``).
    ``kv_roles``: vLLM's ``kv_role`` of the prefill (and ``more_prefills``)
    and of decode (``kv_both`` each by default; ``kv_producer`` /
    ``kv_consumer`` for a prefill-only / decode-only instance).
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
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        connector: bool = True,
        start_timeout_s: float = 300.0,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_netns: Any = None,
        more_prefills: int = 0,
        vllm_router: bool = False,
        mooncake_router: bool = False,
        kv_roles: tuple[str, str] = ("kv_both", "kv_both"),
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
            args=list(prefill_args),
            kv_role=kv_roles[0],
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
            args=list(decode_args),
            kv_role=kv_roles[1],
        )
        self.more_prefills = [
            InstanceSpec(
                f"prefill{i + 2}",
                free_port(),
                free_port(),
                str(i % 2),
                dict(self.prefill.extra_config),
                dict(self.prefill.env),
                args=list(prefill_args),
                kv_role=kv_roles[0],
            )
            for i in range(more_prefills)
        ]
        if prefill_netns is not None:
            ns = prefill_netns
            self.prefill.netns = ns
            self.prefill.host, self.prefill.data_host = ns.ctl_inside, ns.data_inside
            self.decode.data_host = ns.data_outside
        # Decode may post only to declared side channels: every prefill rank's.
        self.decode.extra_config.setdefault(
            "orbitkv.pd.allowed_prefill",
            [f"{_bracket(sp.data_host)}:{sp.side_channel_port}-{sp.side_channel_port + sp.tp - 1}"
             for sp in self.prefills],
        )
        self.proxy_port = xp
        # vllm-router (vLLM's own router, --vllm-pd-disaggregation: the
        # two-stage nixl flow) in front of the same instances, beside the
        # proxy; its Prometheus port must be free too.
        self.router_ports = (free_port(), free_port()) if vllm_router else None
        self.mooncake_router_ports = (free_port(), free_port()) if mooncake_router else None
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
    def router_url(self) -> str:
        """vllm-router's address (a cluster started with ``vllm_router=True``)."""
        assert self.router_ports is not None, "no vllm-router in this cluster"
        return f"http://{HOST}:{self.router_ports[0]}"

    @property
    def mooncake_router_url(self) -> str:
        """vllm-router's address in its mooncake mode (``mooncake_router=True``)."""
        assert self.mooncake_router_ports is not None, "no vllm-router in mooncake mode in this cluster"
        return f"http://{HOST}:{self.mooncake_router_ports[0]}"

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
            "kv_role": spec.kv_role,
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
            *spec.args,
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

    def router_argv(self, mooncake: bool = False) -> list[str]:
        """vllm-router in its P/D mode: ``--kv-connector nixl`` (the default:
        the two-stage flow every vLLM connector understands), or with
        ``mooncake`` its ``mooncake`` mode, each prefill given with its side
        channel port as its Mooncake bootstrap port (``--prefill URL
        PORT``: the router asks ``GET /query`` there for the engine ID)."""
        ports = self.mooncake_router_ports if mooncake else self.router_ports
        assert ports is not None
        prefills: list[str] = []
        for sp in self.prefills:
            prefills += ["--prefill", sp.url, *([str(sp.side_channel_port)] if mooncake else [])]
        return [
            sys.executable,
            "-m",
            "vllm_router.launch_router",
            "--vllm-pd-disaggregation",
            *prefills,
            "--decode",
            self.decode_url,
            *(["--kv-connector", "mooncake"] if mooncake else []),
            "--host",
            HOST,
            "--port",
            str(ports[0]),
            "--prometheus-host",
            HOST,
            "--prometheus-port",
            str(ports[1]),
        ]

    # ---- life --------------------------------------------------------------

    def start(self) -> Cluster:
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        try:
            for name in self.servers:
                self.start_server(name, wait=False)
            self._wait_servers_healthy()
            if self.connector:
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                self.procs["proxy"] = Proc("proxy", self.proxy_argv(), env, self.log("proxy"))
                self.wait_healthy(("proxy",), timeout_s=60)
            if self.router_ports is not None:
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                self.procs["vllm-router"] = Proc("vllm-router", self.router_argv(), env, self.log("vllm-router"))
                self.wait_healthy(("vllm-router",), timeout_s=60)
            if self.mooncake_router_ports is not None:
                name = "vllm-router-mooncake"
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                self.procs[name] = Proc(name, self.router_argv(mooncake=True), env, self.log(name))
                self.wait_healthy((name,), timeout_s=60)
        except BaseException:
            self.stop()
            raise
        return self

    # vLLM picks a free port for its own torch.distributed rendezvous and binds
    # it a moment later; another process starting then (several vLLM servers
    # start at once here) may take it first, and that server exits at start
    # with EADDRINUSE. Such a server is started again, this many times at most.
    RENDEZVOUS_RETRIES = 2

    def _wait_servers_healthy(self) -> None:
        """``wait_healthy`` of every server, starting again a server that lost
        its rendezvous port at start (``RENDEZVOUS_RETRIES``); any other
        failure is raised as it is."""
        for attempt in range(self.RENDEZVOUS_RETRIES + 1):
            try:
                self.wait_healthy(self.servers)
                return
            except ClusterError:
                lost = [n for n in self.servers if self.procs[n].popen.poll() is not None and _lost_rendezvous(self.log(n))]
                if attempt == self.RENDEZVOUS_RETRIES or not lost:
                    raise
                for name in lost:
                    print(f"cluster: {name} lost vLLM's rendezvous port at start (EADDRINUSE): starting it again",
                          file=sys.stderr, flush=True)
                    self.log(name).rename(self.log(name).with_suffix(f".eaddrinuse{attempt}.log"))
                    self.start_server(name, wait=False)

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
        if name == "vllm-router":
            return self.router_url
        if name == "vllm-router-mooncake":
            return self.mooncake_router_url
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

    def wait_proxy_sees_healthy(self, timeout_s: float = 30.0) -> None:
        """Until the proxy counts every instance it fronts healthy (its
        ``/health`` checks them all; between its own checks it keeps leaving
        out an instance it found unhealthy, e.g. a prefill stopped and
        resumed a moment ago)."""

        def all_healthy() -> bool:
            status, body = http_get(self.proxy_url, "/health", timeout_s=5.0)
            states = json.loads(body or b"{}")
            # one prefill and one decode: {role: health}, 200 only when both are
            return status == 200 and all(v.get("healthy") for v in states.values() if isinstance(v, dict))

        wait_until(all_healthy, timeout_s, "the proxy to count every instance healthy",
                   [self.procs[n] for n in ("proxy", *self.servers) if n in self.procs], every_s=0.5)

    def check_alive(self, names: Sequence[str] = ("prefill", "decode", "proxy")) -> None:
        for n in names:
            if n in self.procs:
                self.procs[n].check()

    def kill(self, name: str) -> None:
        """SIGKILL a process group of the cluster (prefill, decode or proxy)."""
        self.procs[name].kill()

    def wait_running(self, name: str, watch: Sequence[str] | None = None) -> None:
        """Waits (up to 60 s, looking every 10 ms) until instance ``name``
        runs a request; the processes of ``watch`` (default: ``name``) must
        stay alive meanwhile."""
        wait_until(
            lambda: self.metrics(name).get("vllm:num_requests_running", 0) >= 1,
            60,
            f"the {name} instance to run a request",
            [self.procs[n] for n in (watch or [name])],
            every_s=0.01,
        )

    def wait_finished(self, before: dict[str, float], name: str = "prefill") -> None:
        """Waits (up to 60 s, looking every 10 ms) until instance ``name``
        finished more requests than ``before`` (its ``metrics`` earlier)
        says; prefill and decode must stay alive meanwhile."""
        wait_until(
            lambda: self.metrics(name)[Metric.SUCCESS] > before[Metric.SUCCESS],
            60,
            f"the {name} instance to finish the request",
            [self.procs["prefill"], self.procs["decode"]],
            every_s=0.01,
        )

    def drop_mid_transfer(self, prompt: list[int], max_tokens: int, delay_s: float = 0.5) -> None:
        """A client that walks away while the KV still moves: slows prefill's
        writes (the ``write-delay`` hook: start prefill with
        ``ORBITKV_TESTING_WRITE_DELAY`` at ``run_dir / "write-delay"``),
        streams ``prompt`` through the proxy, drops the connection once
        prefill finished its half, then waits until neither instance holds
        a block and checks that every process still lives."""
        delay = self.run_dir / "write-delay"
        before = self.metrics("prefill")
        delay.write_text(str(delay_s))
        try:
            req = Abandoned(self.proxy_url, prompt, max_tokens, stream=True)
            try:
                self.wait_finished(before)
            finally:
                req.drop()
        finally:
            delay.unlink(missing_ok=True)
        self.wait_idle(timeout_s=IDLE_TIMEOUT_S)
        self.check_alive()

    def stop_when_running(self, name: str) -> float:
        """Waits until instance ``name`` runs a request (``wait_running``),
        then stops its whole process group (SIGSTOP), also when the wait
        fails. Returns the ``time.monotonic()`` of the stop; ``resume``
        undoes it."""
        try:
            self.wait_running(name)
        finally:
            os.killpg(self.procs[name].pgid, signal.SIGSTOP)
        return time.monotonic()

    def holds_blocks_of_failed_load(self, before: dict[str, float]) -> float:
        """Decode, after a load that failed while its prefill was stopped:
        no transfer completed since ``before`` (its ``metrics`` earlier), no
        request running, and the request's blocks still held (the stopped
        prefill may yet write into them). Returns the KV cache share held."""
        now = self.metrics("decode")
        assert now[Metric.COMPLETED] == before[Metric.COMPLETED], "decode completed a transfer of a stopped prefill"
        assert now.get("vllm:num_requests_running", 0) == 0
        held = now.get("vllm:kv_cache_usage_perc", 0)
        assert held > 0, "decode gave back the blocks of a request whose stopped prefill may still write into them"
        return held

    def resume(self, name: str) -> float:
        """SIGCONT to the process group of ``name``; returns the time of it."""
        os.killpg(self.procs[name].pgid, signal.SIGCONT)
        return time.monotonic()

    def stop(self) -> None:
        for name in ("vllm-router-mooncake", "vllm-router", "proxy", *reversed(self.servers)):
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
        """With ``trace=True``: waits until both instances' trace files hold
        every one of ``request_ids`` with its request span closed (the
        workers rewrite them every 5 s while something new was recorded, so
        a file written while a request was still in flight holds its span as
        ``open``, its end unknown: that file is waited past; do not count on
        a flush at shutdown). Returns whether they do."""

        def has_all() -> bool:
            for name in ("prefill", "decode"):
                try:
                    doc = json.loads(self.trace_path(name).read_text(errors="replace"))
                except (OSError, ValueError):  # not written yet, or being rewritten
                    return False
                roots = [
                    e for e in doc.get("traceEvents", []) if e.get("name") == "request" and e.get("ph") == "X"
                ]
                for rid in request_ids:
                    mine = [e for e in roots if e.get("args", {}).get("request") == rid]
                    if not mine or any(e["args"].get("open") for e in mine):
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


def _lost_rendezvous(log: Path) -> bool:
    """Whether a vLLM server's log says it could not bind torch.distributed's
    rendezvous port (taken by another process between vLLM's pick and its bind)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    return "DistNetworkError" in text and "EADDRINUSE" in text
