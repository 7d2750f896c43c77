"""OrbitKV end to end on GPUs with real vLLM: correctness, load and TTFT,
side by side with one engine, with vLLM's MooncakeConnector and with vLLM's
NixlConnector, in one run.

Run by ``benches/gpu/e2e/run.sh`` on the device machine (two H200s: GPU 0
prefill and the single engine, GPU 1 decode; or one H200 with ``--one-gpu``),
or on CPU as a dry run of its logic (``--device cpu``, tiny sizes, no NIXL and
no MooncakeConnector, which needs CUDA: with ``--nixl-mock --mc-mock`` the
NIXL proxy's and mc_proxy.py's flows run against connector-less servers)::

    python benches/gpu/e2e/driver.py --device cuda --work /root/orbitkv-e2e/work \
        --out /root/orbitkv-e2e/results --deadline-s 1200

Stages, in this order (each bounded in time; each writes ``OUT/<stage>.json``
as soon as it ends, so a later time-out loses nothing; ``OUT/progress.log``
says what happened when):

``a-default``, ``a-eager``
    Correctness of OrbitKV P/D (``PdConnector`` on both instances,
    ``orbitkv.proxy`` in front, Mooncake's intra-node NVLink transport) against
    one engine, greedy, token for token, under vLLM's defaults (CUDA graphs,
    async scheduling, no ``VLLM_KV_CACHE_LAYOUT``), then with
    ``--enforce-eager``; for two small random-weight Llamas made here with
    transformers (8 KV heads x 128 like Llama-3-8B, 4 layers): fp32 (vLLM
    picks Triton attention) and bf16 (FlashAttention). Prompts at block
    boundaries, long prompts, a chunked prefill (longer than
    ``max_num_batched_tokens``), a prefix-cache hit on decode, a streamed
    request and 16 concurrent requests; then both instances must hold no KV
    block (``vllm:kv_cache_usage_perc`` back to 0), and OrbitKV's counters
    (``vllm:orbitkv_*``) must show the transfers.
``s-storm``
    A cancel storm through orbitkv.proxy in front of the Llama-3-8B-shaped
    OrbitKV pair: 48 streamed requests of 1.5k-6k fresh tokens, 16 in flight,
    half dropped by the client (RST) 0-400 ms after sending; then the time
    until both instances are idle (0 running, 0 waiting, KV usage 0; /metrics
    every 50 ms, 200 s at most), decode's fence and quarantine counters, and
    the next plain request against one engine. Cheap: run it first.
``b-default``
    Under load: ``vllm bench serve`` (random prompts of 1k-8k tokens, 64
    output tokens) at 1, 4, 8, 16 and 32 in flight against one engine, OrbitKV
    P/D, MooncakeConnector P/D (mc_proxy.py: both halves at once) and
    NixlConnector P/D (two GPUs); Llama-3-8B shape (32 layers, 32 heads, 8 KV heads,
    head_dim 128, hidden 4096, MLP 14336, vocabulary 128256, bf16, random
    weights: ``--load-format dummy``). The instances' KV usage and queues are
    sampled during each run.
``c-default``, ``c-eager``
    TTFT at 1k / 8k / 32k prompt tokens, a fresh random prompt for every
    request, medians after warm-up, one engine vs OrbitKV vs MooncakeConnector
    vs NIXL; vLLM's
    default mode, then ``--enforce-eager`` (the Llama-3-8B-shaped instances
    restarted).
``b-eager``
    The load runs again in eager mode, if time is left.

Three stages run only when named, before the others (issue 47):

``m-mla``
    MLA: a DeepSeek-V2-Lite-shaped model (random weights, made here: latent
    rank 512, rope 64, nope 128, v 128, no q LoRA, dense MLP, ``--mla-layers``)
    per MLA attention backend of ``--mla-backends`` (``--attention-backend``;
    optionally a KV dtype): one engine and an OrbitKV pair per mode
    (``direct``: staging off; ``staging``: every request through
    ``orbitkv.pd.staging_mb``), all of the cell on that backend; stage a's
    checks with ``--cell-concurrent`` prompts at once compared against the
    engine's one-by-one answers and its own answers to the same prompts at
    once; then prefill's KV compared with decode's byte for byte
    (``kv_digest.py``, a vLLM worker extension reached through the dev-mode
    ``/collective_rpc``).
``f-fp8``
    The same for the small bf16 Llama per KV cache dtype of
    ``--kv-cache-dtypes`` (``--kv-cache-dtype``; optionally a backend), with
    what vLLM's attention selector offers on the GPU per dtype.
``k-blocks``
    The same checks for prefill and decode of different ``--block-size``
    (and, for MLA, backends) per ``--block-pairs`` entry, the one engine on
    decode's backend and block size. In these three stages each request's
    KV is also compared token for token as decode loaded it and as prefill
    released it (the test hook ``ORBITKV_TESTING_KV_DIGEST``,
    :func:`release_digest_check`); ``--cell-stages-together`` runs them at
    once.

With ``--router`` the systems of stages b and c gain ``orbit-router``: the
same OrbitKV prefill + decode pair as ``orbit`` (no other instances), fronted
by vllm-router (``--vllm-pd-disaggregation``, its default ``nixl`` mode: the
two-stage flow, the prefill half with ``do_remote_decode`` and one output
token, then the decode half with the prefill's ``kv_transfer_params``)
instead of orbitkv.proxy. With ``--router-mc`` they also gain
``orbit-router-mc``: the same pair behind vllm-router ``--kv-connector
mooncake`` (the pair then serves OrbitKV's ``mooncake`` dialect; the router
asks the prefill side channel's ``GET /query`` for the engine id, mints a
``transfer_id``, and sends the decode half once the prefill answered).

The Llama-3-8B-shaped instances get the KV that fits the fullest GPU
(``plan_big``); systems that would not fit beside one engine, OrbitKV and
MooncakeConnector run in a later group, after those are stopped (``plan.json``).

Also ``--report DIR``: (re)writes ``DIR/summary.md`` from the stage files.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_client import parse_runs  # noqa: E402  (the client's own run syntax; imports no vLLM)

HOST = "127.0.0.1"
T0 = time.monotonic()
GIB = 1 << 30

# ---- small helpers ---------------------------------------------------------------------------


class Ctx:
    """Run-wide settings and the progress log."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = args.device == "cuda"
        self.out = Path(args.out)
        self.work = Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.deadline = T0 + args.deadline_s
        self._log = open(self.out / "progress.log", "a", buffering=1)
        self.rng = random.Random(args.seed)
        self.used_ports: set[int] = set()
        self._port_lock = threading.Lock()
        self.plan: dict[str, Any] = {}
        self.router_info: dict[str, Any] | None = None  # how vllm-router runs here (find_router)

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S', time.gmtime())} +{time.monotonic() - T0:6.1f}s] {msg}"
        print(line, flush=True)
        self._log.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, name: str, obj: Any) -> None:
        tmp = self.out / f".{name}.json.tmp"
        tmp.write_text(json.dumps(obj, indent=1, default=str))
        tmp.rename(self.out / f"{name}.json")

    def port(self) -> int:
        with self._port_lock:  # the m-/f- stages' cells start proxies from threads
            return self._port()

    def _port(self) -> int:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((HOST, 0))
                p = s.getsockname()[1]
            if p not in self.used_ports and p + 1 not in self.used_ports:
                self.used_ports.update((p, p + 1))
                return p


def error_excerpt(log: Path | None, lines: int = 60) -> str:
    """The last Python traceback in a log (or its last lines)."""
    if log is None:
        return "(no log)"
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    starts = [i for i, ln in enumerate(text) if "Traceback (most recent call last)" in ln]
    if starts:
        i = starts[-1]
        # the first traceback of the last burst is usually the cause
        while starts and len(starts) > 1 and starts[-2] > i - 120 and starts[-2] != i:
            starts.pop()
            i = starts[-1]
        return "\n".join(text[max(0, i - 3) : i + lines])
    return "\n".join(text[-lines:])


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


# ---- models ---------------------------------------------------------------------------------

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<unk>"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    max_pos: int
    dtype: str  # float32 | bfloat16
    weights: bool  # False: config and tokenizer only (vLLM --load-format dummy)
    init_range: float = 0.05
    seed: int = 20261130
    # "llama", or "deepseek_v2" (MLA: one latent plane per layer, kv_lora_rank +
    # qk_rope_head_dim wide; no q LoRA; every layer a dense MLP)
    arch: str = "llama"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0


def make_model(spec: ModelSpec, root: Path) -> str:
    """A Llama made here (no hub): a word-level tokenizer whose words are
    ``t<id>`` (text and token ids convert both ways exactly, so vLLM's random
    benchmark prompts keep their lengths), and random weights (seeded) or
    only the config."""
    out = root / spec.name
    marker = out / "orbitkv-e2e-model.json"
    want = json.dumps(spec.__dict__, sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return str(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), spec.vocab):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A {SPECIALS[0]} $B", special_tokens=[(SPECIALS[0], 0)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[1],
        pad_token=SPECIALS[2],
        unk_token=SPECIALS[3],
        model_max_length=spec.max_pos,
    )
    hf_tok.save_pretrained(out)
    if spec.arch == "deepseek_v2":
        make_mla_model(spec, out)
        marker.write_text(want)
        return str(out)
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.inter,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_pos,
        rope_theta=500000.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=spec.init_range,
        dtype=spec.dtype,
    )
    if spec.weights:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
        model.save_pretrained(out)
    else:
        config.save_pretrained(out)
    marker.write_text(want)
    return str(out)


def make_mla_model(spec: ModelSpec, out: Path) -> None:
    """A DeepSeek-V2-shaped model (MLA) with random weights, written by hand
    (config.json and one safetensors file, the tensor names vLLM's
    DeepseekV2ForCausalLM loads), so that it does not depend on how a
    transformers version builds or names that model: no q LoRA (``q_proj``),
    ``kv_a_proj_with_mqa`` to the latent (``kv_lora_rank``) and the rope key
    (``qk_rope_head_dim``), ``kv_b_proj`` up from the latent, and a dense MLP
    in every layer (``first_k_dense_replace`` = the layer count: the MoE
    kernels are not in the device bundle). Weights normal(0, init_range),
    norms one, seeded."""
    import torch
    from safetensors.torch import save_file

    dt = getattr(torch, spec.dtype)
    g = torch.Generator().manual_seed(spec.seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * spec.init_range).to(dt)  # noqa: E731
    one = lambda n: torch.ones(n, dtype=dt)  # noqa: E731
    H, nh, inter = spec.hidden, spec.heads, spec.inter
    rank, rope, nope, v = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim
    t = {"model.embed_tokens.weight": rnd(spec.vocab, H), "model.norm.weight": one(H), "lm_head.weight": rnd(spec.vocab, H)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": one(H),
            p + "post_attention_layernorm.weight": one(H),
            p + "self_attn.q_proj.weight": rnd(nh * (nope + rope), H),
            p + "self_attn.kv_a_proj_with_mqa.weight": rnd(rank + rope, H),
            p + "self_attn.kv_a_layernorm.weight": one(rank),
            p + "self_attn.kv_b_proj.weight": rnd(nh * (nope + v), rank),
            p + "self_attn.o_proj.weight": rnd(H, nh * v),
            p + "mlp.gate_proj.weight": rnd(inter, H),
            p + "mlp.up_proj.weight": rnd(inter, H),
            p + "mlp.down_proj.weight": rnd(H, inter),
        })
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": spec.vocab, "hidden_size": H, "intermediate_size": inter,
        "moe_intermediate_size": 1408, "num_hidden_layers": spec.layers,
        "num_attention_heads": nh, "num_key_value_heads": nh,
        "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "moe_layer_freq": 1, "first_k_dense_replace": spec.layers, "norm_topk_prob": False,
        "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True,
        "hidden_act": "silu", "max_position_embeddings": spec.max_pos, "initializer_range": spec.init_range,
        "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": 2, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0,
        "q_lora_rank": None, "kv_lora_rank": rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
        "v_head_dim": v, "torch_dtype": spec.dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}))


def mla_spec(ctx: Ctx) -> ModelSpec:
    """DeepSeek-V2-Lite's attention (16 heads, latent rank 512, rope 64, nope
    128, v 128, hidden 2048, dense MLP 10944) with ``--mla-layers`` layers and
    a small vocabulary; bf16 (the MLA backends take 16-bit KV or fp8)."""
    n = ctx.args.mla_layers
    return ModelSpec(f"dsv2-lite-shape-{n}l", n, 2048, 16, 1, 576, 10944, 8192, 16384, "bfloat16", True,
                     arch="deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def small_spec(ctx: Ctx, dtype: str) -> ModelSpec:
    if ctx.cuda:
        return ModelSpec(f"small-{dtype}", 4, 2048, 16, 8, 128, 4096, 8192, 16384, dtype, True)
    return ModelSpec(f"small-{dtype}", 2, 256, 4, 2, 64, 512, 2048, 4096, "float32", True, init_range=0.1)


def big_spec(ctx: Ctx) -> ModelSpec:
    if ctx.cuda:
        n = ctx.args.big_layers
        name = "llama3-8b-shape" if n == 32 else f"llama3-8b-shape-{n}l"
        return ModelSpec(name, n, 4096, 32, 8, 128, 14336, 128256, 40960, "bfloat16", False)
    return ModelSpec("llama3-8b-shape", 2, 256, 4, 2, 64, 512, 4096, 4096, "float32", False)


# ---- processes ------------------------------------------------------------------------------

from orbitkv.testing.cluster import (  # noqa: E402  (after the docstring on purpose)
    Abandoned,
    ClusterError,
    Proc,
    complete,
    healthy,
    metrics,
    vllm_env,
    wait_until,
)


@dataclass
class Server:
    name: str
    model: str
    spec: ModelSpec
    gpu: int
    connector: str  # none | orbit | nixl | mc
    eager: bool
    kv_bytes: int
    max_model_len: int
    port: int
    side_port: int
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    orbit_cfg: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config
    orbit_role: str = "kv_both"  # OrbitKV: vLLM's kv_role (allow_prefill splits a pair)
    mc_role: str = ""  # MooncakeConnector: kv_producer (prefill) | kv_consumer (decode)
    proc: Proc | None = None
    log: Path | None = None
    started_s: float | None = None
    ready_s: float | None = None
    error: str | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def server_argv(ctx: Ctx, s: Server) -> list[str]:
    dtype = s.spec.dtype if ctx.cuda else "float32"
    argv = [
        ctx.args.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", s.model, "--served-model-name", s.spec.name,
        "--dtype", dtype, "--host", HOST, "--port", str(s.port),
        "--max-model-len", str(s.max_model_len),
        "--kv-cache-memory-bytes", str(int(s.kv_bytes)),
        "--disable-uvicorn-access-log",
    ]
    if ctx.cuda:
        # several instances share a GPU: the KV size is fixed above, and this is
        # only the share vLLM checks is free when it starts
        argv += ["--gpu-memory-utilization", str(ctx.args.gpu_mem_util)]
    if not s.spec.weights:
        argv += ["--load-format", "dummy"]
    if s.eager or not ctx.cuda:
        argv += ["--enforce-eager"]
    if s.connector == "orbit":
        cfg = {
            "kv_connector": "PdConnector",
            "kv_connector_module_path": "orbitkv.vllm.pd",
            "kv_role": s.orbit_role,
            "engine_id": s.name,
            "kv_connector_extra_config": {
                "orbitkv.pd.mooncake.bind_host": HOST,
                "orbitkv.pd.side_channel_port": s.side_port,
                **s.orbit_cfg,
            },
        }
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    elif s.connector == "nixl" and not ctx.args.nixl_mock:
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
    elif s.connector == "mc" and not ctx.args.mc_mock:
        argv += ["--kv-transfer-config", json.dumps(mc_transfer_config(ctx, s))]
    return argv + s.extra_args


def mc_transfer_config(ctx: Ctx, s: Server) -> dict[str, Any]:
    """vLLM's MooncakeConnector: the prefill is ``kv_producer`` (it runs the
    bootstrap server on VLLM_MOONCAKE_BOOTSTRAP_PORT), decode ``kv_consumer``;
    ``engine_id`` is what the proxy names as ``remote_engine_id`` (it also asks
    the bootstrap server). Mooncake picks its transport itself (topology
    auto-discovery; MC_INTRANODE_NVLINK set: the intra-node NVLink transport);
    ``mooncake_protocol`` only chooses the allocator of Mooncake's own buffers
    (unused by vLLM), so it is left to vLLM's default unless --mc-protocol."""
    extra: dict[str, Any] = {}
    if ctx.args.mc_protocol:
        extra["mooncake_protocol"] = ctx.args.mc_protocol
    return {"kv_connector": "MooncakeConnector", "kv_role": s.mc_role, "engine_id": s.name,
            "kv_connector_extra_config": extra}


def server_env(ctx: Ctx, s: Server) -> dict[str, str]:
    if ctx.cuda:
        env = dict(os.environ)
        env.update({
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1", "VLLM_HOST_IP": HOST, "GLOG_minloglevel": env.get("GLOG_minloglevel", "1"),
            # both GPUs visible, this instance's first: vLLM (TP 1) runs on the first, and
            # CUDA IPC (Mooncake NVLink, UCX cuda_ipc) can open the peer's memory
            "CUDA_VISIBLE_DEVICES": "0" if ctx.args.one_gpu else ("0,1" if s.gpu == 0 else "1,0"),
        })
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # CUDA IPC shares whole cudaMalloc allocations
        # up to a dozen instances compile at once on 32 cores: fewer Inductor workers each
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    else:
        env = vllm_env(str(s.gpu % max(1, os.cpu_count() or 1)))
    if s.connector == "orbit":
        env["MC_INTRANODE_NVLINK"] = "1" if ctx.cuda else "0"
        if not ctx.cuda:
            env.pop("MC_INTRANODE_NVLINK")
    if s.connector == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(s.side_port)
    if s.connector == "mc":
        # each instance its own bootstrap port (only the producer serves one)
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(s.side_port)
        if ctx.cuda:
            env["MC_INTRANODE_NVLINK"] = "1"
            # Mooncake says at INFO which transport it installed: keep that line
            env["GLOG_minloglevel"] = "0"
        if ctx.args.mc_pythonpath:
            # a `mooncake` package of its own (empty __init__.py, the bundle's
            # engine.so and libraries): the bundle's slimmed __init__.py imports
            # a module the slimming dropped (run.sh builds it)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (ctx.args.mc_pythonpath, env.get("PYTHONPATH", "")) if p)
    env.update(s.extra_env)
    return env


def skip_layer_hook_env(ctx: Ctx) -> dict[str, str]:
    """The environment that makes a vLLM server's attention layers skip the
    connector's per-layer hooks: orbitkv.testing's vLLM shim, armed by a file
    that exists for the whole run."""
    import importlib.util

    found = importlib.util.find_spec("orbitkv.testing")
    assert found is not None and found.submodule_search_locations, "orbitkv.testing is not installed"
    shims = Path(next(iter(found.submodule_search_locations))) / "vllm_shims"
    flag = ctx.work / "skip-layer-hook"
    flag.touch()
    return {"ORBITKV_TESTING_SKIP_LAYER_HOOK": str(flag),
            "PYTHONPATH": os.pathsep.join(p for p in (str(shims), os.environ.get("PYTHONPATH", "")) if p)}


def start_server(ctx: Ctx, s: Server) -> None:
    s.log = ctx.work / "logs" / f"{s.name}.log"
    argv = server_argv(ctx, s)
    env = server_env(ctx, s)
    s.proc = Proc(s.name, argv, env, s.log)
    s.started_s = time.monotonic() - T0
    s.ready_s = None
    s.error = None
    shown = {k: env[k] for k in sorted(env) if k.startswith(("CUDA_VISIBLE", "MC_", "VLLM_", "ORBITKV_"))
             or (s.connector == "mc" and k in ("GLOG_minloglevel", "PYTHONPATH"))}
    ctx.log(f"start {s.name} (pid {s.proc.pid}, port {s.port}, GPU {s.gpu}) env {shown}")


def stop(ctx: Ctx, procs: list[Any]) -> None:
    """Stops servers (and proxies) at once: SIGTERM to all, then waits."""
    live = [p for p in procs if p is not None and getattr(p, "proc", p) is not None]
    threads = []
    for x in live:
        proc = x.proc if isinstance(x, Server) else x
        t = threading.Thread(target=proc.stop, kwargs={"grace_s": 15.0})
        t.start()
        threads.append(t)
    for t in threads:
        t.join(30)
    for x in live:
        if isinstance(x, Server):
            x.proc = None


def wait_ready(ctx: Ctx, servers: list[Server], timeout_s: float) -> dict[str, str]:
    """Waits until every server answers /health; a server whose process ends
    is marked failed at once (its traceback kept) and the others are still
    awaited. Returns {name: error} for the failed ones."""
    deadline = time.monotonic() + timeout_s
    pending = [s for s in servers if s.proc is not None and s.ready_s is None]
    failed: dict[str, str] = {}
    while pending and time.monotonic() < deadline:
        for s in list(pending):
            assert s.proc is not None
            if not s.proc.alive():
                s.error = f"exited with {s.proc.popen.returncode} during start-up:\n{error_excerpt(s.log)}"
                failed[s.name] = s.error
                ctx.log(f"FAILED to start: {s.name}: exit {s.proc.popen.returncode}; log {s.log}")
                pending.remove(s)
                continue
            try:
                ok = healthy(s.url)
            except Exception:  # noqa: BLE001 - not up yet
                ok = False
            if ok:
                s.ready_s = time.monotonic() - T0
                ctx.log(f"ready: {s.name} after {s.ready_s - s.started_s:.0f}s")
                pending.remove(s)
        time.sleep(0.5)
    for s in pending:
        s.error = f"not healthy after {timeout_s:.0f}s:\n{error_excerpt(s.log, 30)}"
        failed[s.name] = s.error
        ctx.log(f"FAILED to start: {s.name}: not healthy after {timeout_s:.0f}s")
    return failed


def start_proxy(ctx: Ctx, kind: str, name: str, pre: Server, dec: Server) -> tuple[Proc, str]:
    port = ctx.port()
    log = ctx.work / "logs" / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if kind == "orbit":
        argv = [ctx.args.python, "-m", "orbitkv.proxy", "--prefill", pre.url, "--decode", dec.url,
                "--prefill-kv", f"{HOST}:{pre.side_port}", "--host", HOST, "--port", str(port)]
    elif kind == "mc":
        # both halves at once, transfer_id minted there; the prefill's engine id
        # from its bootstrap server's /query, else its kv_transfer_config.engine_id
        argv = [ctx.args.python, str(HERE / "mc_proxy.py"), "--prefill", pre.url, "--decode", dec.url,
                "--bootstrap", f"http://{HOST}:{pre.side_port}", "--prefill-engine-id", pre.name,
                "--query-timeout-s", "1" if ctx.args.mc_mock else "20", "--host", HOST, "--port", str(port)]
    else:
        argv = [ctx.args.python, str(HERE / "nixl_proxy.py"), "--prefill", pre.url, "--decode", dec.url,
                "--host", HOST, "--port", str(port)]
    p = Proc(name, argv, env, log)
    url = f"http://{HOST}:{port}"
    wait_until(lambda: healthy(url), 60, f"{name} at {url}", [p], every_s=0.2)
    ctx.log(f"proxy {name} up at {url}")
    return p, url


# What the router's Python package says of itself, run by --python (the
# interpreter and PYTHONPATH the instances get: on the device, the bundle's
# site folder, where prepare.sh unpacked the vllm-router wheel).
ROUTER_PROBE = """
import json
import vllm_router, vllm_router.launch_router, vllm_router_rs
try:
    from importlib.metadata import version
    v = version("vllm-router")
except Exception:
    v = getattr(vllm_router, "__version__", "?")
print(json.dumps({"version": v, "package": vllm_router.__file__, "core": vllm_router_rs.__file__}))
"""


def find_router(ctx: Ctx) -> dict[str, Any]:
    """How to run vllm-router (once per run): ``--router-bin`` if given, else
    ``--python -m vllm_router.launch_router`` (what its ``vllm-router``
    console script runs; the wheel's Rust core is the module
    ``vllm_router_rs``, an abi3 extension, so the package on ``PYTHONPATH`` is
    all it needs, and the console script, whose first line names the
    interpreter that installed it, is not used), else ``vllm-router`` on
    ``PATH``. ``argv`` is None when none is found (``error`` says why)."""
    if ctx.router_info is not None:
        return ctx.router_info
    info: dict[str, Any] = {"argv": None}
    if ctx.args.router_bin:
        info.update(argv=[ctx.args.router_bin], how="--router-bin")
    else:
        try:
            r = subprocess.run([ctx.args.python, "-c", ROUTER_PROBE], capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                info.update(json.loads(r.stdout.strip().splitlines()[-1]))
                info.update(argv=[ctx.args.python, "-m", "vllm_router.launch_router"],
                            how=f"{ctx.args.python} -m vllm_router.launch_router")
            else:
                info["probe_error"] = r.stderr.strip()[-1500:]
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
            info["probe_error"] = f"{type(e).__name__}: {e}"
        if info["argv"] is None:
            exe = shutil.which("vllm-router")
            if exe:
                info.update(argv=[exe], how="vllm-router on PATH")
    if info["argv"] is None:
        info["error"] = ("vllm-router not found: the package vllm_router (and its core vllm_router_rs) is not "
                         f"importable by {ctx.args.python}, and no vllm-router on PATH: "
                         + str(info.get("probe_error", ""))[-800:])
    ctx.router_info = info
    ctx.log(f"vllm-router: {info.get('how') or info.get('error')}"
            + (f", version {info['version']} ({info.get('core')})" if info.get("version") else ""))
    return info


def start_router(ctx: Ctx, name: str, pre: Server, dec: Server, mooncake: bool = False) -> tuple[Proc, str, dict[str, Any]]:
    """vllm-router in its P/D mode in front of an OrbitKV pair: its default
    ``--kv-connector nixl``, the two-stage flow (the prefill half with
    ``do_remote_decode: true`` and ``max_tokens: 1``, not streamed; once it
    answered, the decode half with the ``kv_transfer_params`` of the prefill's
    response, verbatim). Its Prometheus port gets a free port of its own;
    ``--router-args`` adds flags. ``mooncake``: its ``--kv-connector
    mooncake`` mode instead, the prefill's side channel port given as its
    bootstrap port (``--prefill URL PORT``). Returns the process, its URL and what it
    ran (for the startup record)."""
    info = find_router(ctx)
    if info["argv"] is None:
        raise ClusterError(info["error"])
    port, prom = ctx.port(), ctx.port()
    log = ctx.work / "logs" / f"{name}.log"
    prefill = [pre.url, str(pre.side_port)] if mooncake else [pre.url]
    argv = [*info["argv"], "--vllm-pd-disaggregation", "--prefill", *prefill, "--decode", dec.url,
            "--host", HOST, "--port", str(port), "--prometheus-host", HOST, "--prometheus-port", str(prom),
            *(["--kv-connector", "mooncake"] if mooncake else []), *shlex.split(ctx.args.router_args)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rec = {"argv": argv, "log": str(log), "version": info.get("version"), "package": info.get("package"),
           "core": info.get("core"), "how": info.get("how")}
    p = Proc(name, argv, env, log)
    url = f"http://{HOST}:{port}"
    t0 = time.monotonic()
    wait_until(lambda: healthy(url), ctx.args.router_start_timeout_s, f"{name} at {url}", [p], every_s=0.2)
    rec["ready_after_s"] = round(time.monotonic() - t0, 1)
    ctx.log(f"router {name} (vllm-router {info.get('version')}) up at {url} after {rec['ready_after_s']}s")
    return p, url, rec


def reset_prefix_cache(ctx: Ctx, servers: list[Server], timeout_s: float = 60) -> dict[str, Any]:
    """Empties the instances' prefix caches (vLLM's ``POST /reset_prefix_cache``,
    served with ``VLLM_SERVER_DEV_MODE=1``), retrying while it answers
    ``success: false`` (blocks still held, e.g. by a transfer that is ending).
    Used where two systems share instances (``orbit`` and ``orbit-router``):
    each system's load runs see the same prompts, which the earlier system
    would otherwise have left cached on both instances."""
    out: dict[str, Any] = {}
    for s in servers:
        t0 = time.monotonic()
        res: Any = None
        while True:
            try:
                req = urllib.request.Request(s.url + "/reset_prefix_cache", data=b"", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    res = json.loads(r.read() or b"{}")
            except Exception as e:  # noqa: BLE001 - not served (no dev mode) or not answering: a few tries only
                res = {"error": f"{type(e).__name__}: {e}"}
            spent = time.monotonic() - t0
            if (isinstance(res, dict) and res.get("success")) or spent > timeout_s or ("error" in res and spent > 5):
                break
            time.sleep(0.5)
        out[s.name] = {"result": res, "after_s": round(time.monotonic() - t0, 2)}
    ctx.log(f"  prefix caches reset: {json.dumps(out)[:300]}")
    return out


def snapshot(url: str) -> dict[str, float]:
    try:
        return metrics(url)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)}  # type: ignore[dict-item]


KEEP_METRICS = ("vllm:orbitkv", "vllm:nixl", "vllm:prefix_cache", "vllm:kv_cache_usage_perc", "vllm:num_requests",
                "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in after.items():
        if not isinstance(v, (int, float)) or not k.startswith(KEEP_METRICS):
            continue
        if k.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests")):
            out[k] = v  # gauges: the value after
        else:
            out[k] = round(v - before.get(k, 0.0), 6)
    return out


def idle(url: str) -> bool:
    m = metrics(url)
    return (m.get("vllm:num_requests_running", -1) == 0 and m.get("vllm:num_requests_waiting", -1) == 0
            and m.get("vllm:kv_cache_usage_perc", -1) == 0)


def wait_idle(servers: list[Server], timeout_s: float) -> dict[str, Any]:
    out = {}
    for s in servers:
        t0 = time.monotonic()
        try:
            wait_until(lambda s=s: idle(s.url), timeout_s, f"{s.name} idle", [s.proc] if s.proc else [], every_s=0.25)
            out[s.name] = {"idle": True, "after_s": round(time.monotonic() - t0, 2)}
        except ClusterError as e:
            m = snapshot(s.url)
            out[s.name] = {"idle": False, "error": str(e)[:500],
                           "now": {k: m.get(k) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                         "vllm:kv_cache_usage_perc")}}
    return out


FACT_PATTERNS = (r"[Aa]sync[ _]schedul", r"Using \S+ (attention )?backend", r"[Aa]ttention backend", r"cudagraph_mode",
                 r"CUDA graph", r"KV cache layout|kv_cache_layout|VLLM_KV_CACHE_LAYOUT| HND| NHD",
                 r"max_num_batched_tokens", r"GPU KV cache size", r"Maximum concurrency", r"OrbitKV|orbitkv",
                 r"NIXL|Nixl", r"Mooncake|[Tt]ransport", r"torch.compile takes|Compil(ing|ation) .* took|init engine .* took",
                 r"Model loading took", r"Memory profiling takes|Available KV cache memory")


def log_facts(log: Path | None, limit: int = 40) -> list[str]:
    """The start-up lines of a server log that say how vLLM runs it (attention
    backend, CUDA graphs, async scheduling, KV layout, connector, sizes)."""
    if log is None:
        return []
    out: list[str] = []
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("# "):
                continue  # the command line, recorded as argv
            if any(re.search(p, line) for p in FACT_PATTERNS) and "Traceback" not in line:
                fact = line.strip()
                if fact not in out:
                    out.append(fact[:400])
            if len(out) >= limit:
                break
    return out


def parse_mnbt(log: Path | None) -> int | None:
    if log is None:
        return None
    with contextlib.suppress(OSError):
        for pat in (r"max_num_batched_tokens=(\d+)", r"max_num_batched_tokens['\"]?:\s*(\d+)"):
            m = re.findall(pat, log.read_text(errors="replace"))
            if m:
                return int(m[-1])
    return None


# ---- stage a: correctness ---------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    ids: list[int]
    tokens: list[str]
    top: list[dict[str, float]]
    error: Any = None
    total_s: float = 0.0


def ask(url: str, ids: list[int], n: int, model: str, stream: bool = False, timeout_s: float = 180) -> Answer:
    extra: dict[str, Any] = {"model": model}
    if not stream:
        extra["logprobs"] = 5
    r = complete(url, ids, n, stream=stream, timeout_s=timeout_s, **extra)
    if r.status != 200:
        return Answer(r.status, [], [], [], r.error, r.total_s)
    tokens, top = [], []
    if not stream and isinstance(r.body, dict):
        lp = r.body["choices"][0].get("logprobs") or {}
        tokens = list(lp.get("tokens") or [])
        top = [dict(x or {}) for x in (lp.get("top_logprobs") or [])]
    return Answer(200, list(r.token_ids), tokens, top, None, r.total_s)


def compare(ref: Answer, got: Answer, tol: float) -> dict[str, Any]:
    """equal; near-tie (at the first difference both tokens are among the
    reference's top-5 and their log-probabilities there differ by at most
    ``tol`` nats: a greedy tie that two kernels can break either way); or
    mismatch."""
    if got.status != 200:
        return {"verdict": "error", "error": str(got.error)[:800]}
    if ref.ids == got.ids:
        return {"verdict": "equal"}
    k = next((i for i, (a, b) in enumerate(zip(ref.ids, got.ids)) if a != b), min(len(ref.ids), len(got.ids)))
    out: dict[str, Any] = {"verdict": "mismatch", "first_diff": k, "ref": ref.ids[: k + 3], "got": got.ids[: k + 3]}
    if k < len(ref.top) and len(ref.top[k]) >= 2:
        top = ref.top[k]
        vals = sorted(top.values(), reverse=True)
        out["ref_top2_gap"] = round(vals[0] - vals[1], 5)
        out["ref_top"] = {t: round(v, 5) for t, v in top.items()}
        if k < len(got.top):
            out["got_top"] = {t: round(v, 5) for t, v in got.top[k].items()}
        tok = lambda a, i: a.tokens[i] if i < len(a.tokens) else (f"t{a.ids[i]}" if i < len(a.ids) else None)  # noqa: E731
        ref_tok, got_tok = tok(ref, k), tok(got, k)
        if ref_tok in top and got_tok in top:
            out["chosen_gap"] = round(top[ref_tok] - top[got_tok], 5)
            if out["chosen_gap"] <= tol:
                out["verdict"] = "near-tie"
    return out


def small_trio(ctx: Ctx, spec: ModelSpec, model: str, eager: bool, tag: str) -> list[Server]:
    kv = ctx.args.small_kv_gib * GIB
    mml = spec.max_pos
    extra = ["--max-num-batched-tokens", str(ctx.args.small_mnbt)] if ctx.args.small_mnbt else []
    mk = lambda name, gpu, conn: Server(  # noqa: E731
        f"{tag}-{name}", model, spec, gpu, conn, eager, kv, mml, ctx.port(), ctx.port(), {}, list(extra))
    trio = [mk("single", 0, "none"), mk("prefill", 0, "orbit"), mk("decode", 1, "orbit")]
    allow_prefill(ctx, trio[1], trio[2])
    if ctx.args.staging:
        # every request through staging (orbitkv.pd.staging_mb), gathered on
        # prefill, scattered on decode; the stage then requires it happened
        for s in trio[1:]:
            s.orbit_cfg.update(STAGING_CFG)
    return trio


def allow_prefill(ctx: Ctx, pre: Server, dec: Server) -> None:
    """OrbitKV's decode posts handshakes only to declared prefill side
    channels (``orbitkv.pd.allowed_prefill``; the default names only the
    default ports 17500-17563, and the driver's ports are random): without
    this every request would be served as a plain request on decode, and the
    prefill would hold its KV until the handshake deadline.

    The roles are the ones docs/configuration.md tells operators to use, and
    MooncakeConnector's pair runs: the prefill ``kv_producer``, the decode
    ``kv_consumer`` (as ``kv_both`` a decode gives a tenth of its KV cache
    to a source staging it never uses: runs up to 42 raced OrbitKV's decode
    that way against MC's whole cache). ``--orbit-roles both`` keeps
    ``kv_both`` on both."""
    dec.orbit_cfg["orbitkv.pd.allowed_prefill"] = [f"{HOST}:{pre.side_port}"]
    if ctx.args.orbit_roles == "split":
        pre.orbit_role, dec.orbit_role = "kv_producer", "kv_consumer"


# --staging: staging memory on both OrbitKV instances, and a threshold of one
# range per layer so that every request (fresh blocks are mostly contiguous) stages.
STAGING_CFG = {"orbitkv.pd.staging_mb": 8192, "orbitkv.pd.staging_min_ranges": 1}


def correctness(ctx: Ctx, spec: ModelSpec, trio: list[Server], proxy_url: str, tol: float, *,
                seed_extra: int = 0, boundary: list[int] | None = None, conc_n: int = 16,
                staged: bool | None = None, digest: bool = False, split_reps: int = 0,
                release: bool = False, in_kv_cache: bool = False) -> dict[str, Any]:
    """Stage a's checks of one OrbitKV pair against one engine (the cases
    below). The keywords serve the m-/f- stages: ``seed_extra`` other fresh
    prompts (two pairs that share one engine must not hit its prefix cache
    with each other's prompts), ``boundary`` the block-boundary lengths,
    ``conc_n`` the prompts sent at once, ``staged`` whether every P/D request
    must have had a staging grant (default ``--staging``), ``digest``: once
    both are idle, prefill's and decode's KV slots compared byte for byte
    (kv_digest.py); ``release``: each request's KV compared token for token
    as decode loaded it and as prefill held it when it released it (the
    test hook ``ORBITKV_TESTING_KV_DIGEST``, :func:`release_digest_check`),
    which then decides the pair's KV verdict; ``in_kv_cache``: the pair's
    source staging is in vLLM's KV cache (``orbitkv.pd.staging_memory``
    ``kv_cache``), and the pair passes only if the prefill's scheduler took
    blocks for it, its worker cut pieces out of them and layers went from
    those pieces into decode's pages."""
    single, pre, dec = trio
    rng = random.Random(ctx.args.seed + (1 if spec.dtype == "bfloat16" else 0) + (2 if single.eager else 0)
                        + seed_extra)
    V = spec.vocab
    fresh = lambda n: [rng.randrange(len(SPECIALS), V) for _ in range(n)]  # noqa: E731
    G = ctx.args.gen
    mnbt = parse_mnbt(pre.log) or ctx.args.fallback_mnbt
    chunk_len = min(mnbt + 1000, spec.max_pos - G - 8)
    res: dict[str, Any] = {"model": spec.__dict__, "eager": single.eager, "tolerance_nats": tol,
                           "max_num_batched_tokens": mnbt, "cases": []}
    before = {s.name: snapshot(s.url) for s in (pre, dec)}

    def case(label: str, ids: list[int], stream: bool = False, ref: Answer | None = None) -> dict[str, Any]:
        ref = ref or ask(single.url, ids, G, spec.name)
        got = ask(proxy_url, ids, G, spec.name, stream=stream)
        c = {"case": label, "prompt_tokens": len(ids), "stream": stream, **compare(ref, got, tol),
             "pd_s": round(got.total_s, 3)}
        if ref.status != 200:
            c["verdict"] = "reference error"
            c["error"] = str(ref.error)[:800]
        res["cases"].append(c)
        ctx.log(f"  {label} ({len(ids)} tokens): {c['verdict']}")
        return c

    n_pd = 0
    for n in (ctx.args.boundary_lengths if boundary is None else boundary):
        case(f"block boundary {n}", fresh(n))
        n_pd += 1
    for n in ctx.args.long_lengths:
        case(f"long {n}", fresh(n))
        n_pd += 1
    case(f"chunked prefill {chunk_len} (> max_num_batched_tokens {mnbt})", fresh(chunk_len))
    n_pd += 1
    # a prefix-cache hit on decode: A through P/D, then A + B
    a_ids = fresh(ctx.args.prefix_len)
    case("prefix A", a_ids)
    hits0 = snapshot(dec.url)
    ab = a_ids + fresh(96)
    c = case("prefix A + B (A cached on decode)", ab)
    hits1 = snapshot(dec.url)
    c["decode_prefix_cache_hit_tokens"] = hits1.get("vllm:prefix_cache_hits_total", 0) - hits0.get(
        "vllm:prefix_cache_hits_total", 0)
    c["decode_prefix_cache_query_tokens"] = hits1.get("vllm:prefix_cache_queries_total", 0) - hits0.get(
        "vllm:prefix_cache_queries_total", 0)
    n_pd += 2
    case("streamed", fresh(333), stream=True)
    n_pd += 1
    if digest:
        # the sequential cases' KV, before the prompts sent at once (whose
        # chunks share the prefill's steps) add theirs
        wait_idle([pre, dec], 30)
        res["kv_bytes_sequential"] = kv_bytes_check(ctx, pre, dec, n_pd)
    for r in range(split_reps):
        # a prompt's last block across two prefill steps, with another
        # request in the first: P0 (max_num_batched_tokens tokens) keeps the
        # prefill busy while P1 (mnbt - 100) and P2 (110) queue; the next step
        # takes P1 whole and P2's first 100 tokens, so P2's last chunk starts
        # inside its final block (slot 36 of 64, slot 4 of 16)
        trio_ids = [fresh(mnbt), fresh(max(1, mnbt - 100)), fresh(110)]
        srefs = [ask(single.url, x, G, spec.name) for x in trio_ids]

        def go(ix: tuple[int, list[int]]) -> Answer:
            time.sleep(0.01 * ix[0])
            return ask(proxy_url, ix[1], G, spec.name)

        with cf.ThreadPoolExecutor(3) as ex:
            sgots = list(ex.map(go, enumerate(trio_ids)))
        for i, (rf, g, x) in enumerate(zip(srefs, sgots, trio_ids)):
            c = {"case": f"chunk split {r + 1}/P{i}", "prompt_tokens": len(x), "stream": False, **compare(rf, g, tol),
                 "pd_s": round(g.total_s, 3)}
            res["cases"].append(c)
        ctx.log(f"  chunk split {r + 1}: {[c['verdict'] for c in res['cases'][-3:]]}")
        n_pd += 3
    if split_reps and digest:
        wait_idle([pre, dec], 30)
        res["kv_bytes_split"] = kv_bytes_check(ctx, pre, dec, n_pd)
    # conc_n at once: references one by one first
    conc = [fresh(rng.randrange(40, ctx.args.concurrent_max)) for _ in range(conc_n)]
    refs = [ask(single.url, ids, G, spec.name) for ids in conc]
    with cf.ThreadPoolExecutor(conc_n) as ex:
        gots = list(ex.map(lambda ids: ask(proxy_url, ids, G, spec.name), conc))
    verdicts = [compare(r, g, tol) for r, g in zip(refs, gots)]
    # control: the single engine itself, the same prompts at once, against its own one-by-one answers
    with cf.ThreadPoolExecutor(conc_n) as ex:
        ctrl = list(ex.map(lambda ids: ask(single.url, ids, G, spec.name), conc))
    ctrl_cmp = [compare(r, g, tol) for r, g in zip(refs, ctrl)]
    res["control_single_concurrent_vs_sequential"] = [c["verdict"] for c in ctrl_cmp]
    res["control_single_concurrent_details"] = [dict(c, i=i) for i, c in enumerate(ctrl_cmp) if c["verdict"] != "equal"]
    ctx.log(f"  control, single engine {conc_n} at once vs one by one: {res['control_single_concurrent_vs_sequential']}")
    # P/D at once against the single engine at once (the same prompts, both batched):
    # what batching alone does is then on both sides
    vs_conc = [compare(r, g, tol) for r, g in zip(ctrl, gots)]
    res["pd_concurrent_vs_single_concurrent"] = [v["verdict"] for v in vs_conc]
    res["pd_concurrent_vs_single_concurrent_details"] = [dict(v, i=i) for i, v in enumerate(vs_conc)
                                                         if v["verdict"] != "equal"]
    cc = {"case": f"{conc_n} concurrent", "prompt_tokens": [len(x) for x in conc],
          "verdicts": [v["verdict"] for v in verdicts],
          "details": [dict(v, i=i) for i, v in enumerate(verdicts) if v["verdict"] != "equal"]}
    cc["verdict"] = "equal" if all(v == "equal" for v in cc["verdicts"]) else (
        "near-tie" if all(v in ("equal", "near-tie") for v in cc["verdicts"]) else "mismatch")
    res["cases"].append(cc)
    ctx.log(f"  {conc_n} concurrent: {cc['verdicts']}; against the single engine's concurrent answers: "
            f"{res['pd_concurrent_vs_single_concurrent']}")
    n_pd += conc_n
    res["pd_requests"] = n_pd
    res["idle_after"] = wait_idle([pre, dec], 60)
    if digest:
        res["kv_bytes"] = kv_bytes_check(ctx, pre, dec, n_pd)
    if release:
        res["kv_release"] = release_digest_check(ctx, pre, dec, n_pd)
    after = {s.name: snapshot(s.url) for s in (pre, dec)}
    res["metrics_delta"] = {s.name: delta(before[s.name], after[s.name]) for s in (pre, dec)}
    flat = [c["verdict"] for c in res["cases"] if c is not cc] + cc["verdicts"]
    res["counts"] = {v: flat.count(v) for v in sorted(set(flat))}
    d = res["metrics_delta"][dec.name]
    p = res["metrics_delta"][pre.name]
    res["transfers_completed"] = d.get("vllm:orbitkv_transfers_completed_total")
    res["transfers_failed"] = d.get("vllm:orbitkv_transfers_failed_total")
    res["bytes_written"] = p.get("vllm:orbitkv_bytes_written_total")
    res["staging_granted"] = d.get("vllm:orbitkv_staging_granted_total")
    res["layers_staged"] = p.get("vllm:orbitkv_layers_staged_total")
    staged_ok = not (ctx.args.staging if staged is None else staged) or (res["staging_granted"] or 0) >= n_pd
    res["layers_staged_to_pages"] = p.get("vllm:orbitkv_layers_staged_to_pages_total")
    res["writes_gathered"] = p.get("vllm:orbitkv_writes_gathered_total")
    if in_kv_cache:
        res["kv_cache_staging"] = kv_cache_staging(pre.log)
        staged_ok = staged_ok and all(res["kv_cache_staging"].values())
        # layer pieces: some layer went from one into decode's pages; the
        # writer's gather (staging_pieces write) copies only where that saves
        # ranges, and a fresh pool may give it none (writes_gathered: 0)
        if pre.orbit_cfg.get("orbitkv.pd.staging_pieces") != "write":
            staged_ok = staged_ok and (res["layers_staged_to_pages"] or 0) > 0
    ok_tokens = all(v in ("equal", "near-tie") for v in flat)
    kvb = res.get("kv_release") or res.get("kv_bytes")
    bytes_ok = kvb is None or bool(kvb.get("ok"))
    # every P/D request must have had its KV over the connector (a request the
    # connector refuses is served as a plain request on decode: equal output,
    # nothing transferred)
    res["pass"] = bool(ok_tokens and all(x["idle"] for x in res["idle_after"].values())
                       and (res["transfers_completed"] or 0) >= n_pd and not res["transfers_failed"]
                       and (res["bytes_written"] or 0) > 0 and staged_ok and bytes_ok)
    return res


def kv_taken(log: Path | None) -> tuple[int, int] | None:
    """(blocks taken for the source staging, vLLM's blocks in all) from a
    prefill's log under ``orbitkv.pd.staging_memory`` ``kv_cache``; None
    when none were taken."""
    text = log.read_text(errors="replace") if log is not None and log.exists() else ""
    m = re.search(r"OrbitKV: (\d+) of vLLM's (\d+) KV cache blocks .* taken for the source staging", text)
    return (int(m[1]), int(m[2])) if m else None


def whole_cache_peak(peaks: dict[str, float] | None, taken: tuple[int, int] | None) -> None:
    """With blocks taken out of vLLM's pool for the staging, vLLM's usage
    gauge counts only the other ones (a share of ``n - r - 1`` blocks, not of
    the whole cache): adds ``kv_usage_peak_pages``, the requests' pages at
    that peak as a share of the whole cache (comparable with a pair that took
    nothing), ``kv_usage_peak_whole``, the same with every taken block
    counted in use (an upper bound: the staging is seldom full), and
    ``kv_taken``."""
    if not peaks or not taken or peaks.get("kv_usage_peak", -1) < 0:
        return
    r, n = taken
    used = peaks["kv_usage_peak"] * (n - r - 1)
    peaks["kv_usage_peak_pages"] = round(used / max(n - 1, 1), 4)
    peaks["kv_usage_peak_whole"] = round((used + r) / max(n - 1, 1), 4)
    peaks["kv_taken"] = [r, n]


def _with_whole(v: dict[str, Any]) -> dict[str, Any]:
    """``v`` with the whole-cache shares (re)derived from its ``kv_taken``
    (stage files written before ``kv_usage_peak_pages`` existed have
    ``kv_taken`` and the gauge)."""
    taken = v.get("kv_taken")
    if isinstance(taken, list) and len(taken) == 2:
        v = dict(v)
        whole_cache_peak(v, (int(taken[0]), int(taken[1])))
    return v


def peak_cell(v: dict[str, Any]) -> str:
    """A prefill's KV usage peak for the tables: vLLM's gauge and, where
    blocks were taken for the staging, the whole cache's share in request
    pages and with the taken blocks."""
    v = _with_whole(v)
    out = f"{v.get('kv_usage_peak', float('nan')):.1%}"
    if "kv_usage_peak_whole" in v:
        out += (f" (of the whole cache: {v['kv_usage_peak_pages']:.1%} in request pages, "
                if "kv_usage_peak_pages" in v else " (")
        out += f"{v['kv_usage_peak_whole']:.1%} with the taken blocks)"
    return out


def whole_cache_ratio(o: dict[str, Any], p: dict[str, Any]) -> str:
    """The first system's prefill KV peak over the whole cache ÷ the second's,
    in request pages / with the taken blocks (a pair that took none: its
    gauge is already over the whole cache); '-' where a peak is missing."""
    def pre(x: dict[str, Any]) -> dict[str, Any]:
        return _with_whole(next((v for k, v in x.get("servers", {}).items() if "prefill" in k), {}))
    a, b = pre(o), pre(p)

    def share(v: dict[str, Any], key: str) -> float | None:
        x = v.get(key, v.get("kv_usage_peak"))
        return x if isinstance(x, (int, float)) and x >= 0 else None
    cells = []
    for key in ("kv_usage_peak_pages", "kv_usage_peak_whole"):
        x, y = share(a, key), share(b, key)
        cells.append(f"{x / y:.2f}" if x is not None and y else "-")
    return " / ".join(cells)


def kv_cache_staging(log: Path | None) -> dict[str, bool]:
    """What a prefill's log says of ``orbitkv.pd.staging_memory``
    ``kv_cache``: its scheduler took blocks out of vLLM's pool, and its
    worker (rank 0 at least) cut the layer pieces out of them."""
    text = log.read_text(errors="replace") if log is not None and log.exists() else ""
    return {"taken": bool(re.search(r"OrbitKV: \d+ of vLLM's \d+ KV cache blocks .* taken for the source staging", text)),
            "cut": bool(re.search(r"source staging of \d+ MiB in \d+ KV blocks of vLLM's cache", text))}


def kv_digest(s: Server, timeout_s: float = 120, slots: list[int] | None = None) -> dict[str, Any]:
    """The instance's KV slot digests and their slots (kv_digest.py, through
    vLLM's dev-mode ``/collective_rpc``), with ``slots``: also those slots'
    per-layer digests; the first worker's answer, or {"error": ...}."""
    args = ["index"] + ([json.dumps(slots)] if slots else [])
    body = json.dumps({"method": "orbitkv_kv_digest", "timeout": timeout_s, "args": args}).encode()
    try:
        req = urllib.request.Request(s.url + "/collective_rpc", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s + 10) as r:
            res = json.loads(r.read())
        out = (res.get("results") or [None])[0]
        return out if isinstance(out, dict) else {"error": f"unexpected answer: {str(res)[:300]}"}
    except Exception as e:  # noqa: BLE001 - recorded
        return {"error": f"{type(e).__name__}: {e}"}


def kv_missing_detail(pidx: list[int], p: list[int], didx: list[int], d: list[int], missing: list[int], spb: int,
                      limit: int = 40) -> list[dict[str, Any]]:
    """Per prefill block with slots missing on decode (the first ``limit``):
    how many slots prefill wrote in it, which are missing, the decode block
    that holds its other slots (from the slots that matched, at the same
    offsets), and what decode holds at each missing slot there: ``unwritten``
    (zero: never written), ``differs`` (other bytes), or ``prefill B/S``
    (the bytes of another prefill slot: a block of another request or
    position)."""
    pmap = dict(zip(pidx, p))
    dmap = dict(zip(didx, d))
    dinv = {x: i for i, x in zip(didx, d)}
    pinv = {x: i for i, x in zip(pidx, p)}
    by_block: dict[int, list[int]] = {}
    for i in missing:
        by_block.setdefault(i // spb, []).append(i % spb)
    written: dict[int, int] = {}
    for i in pidx:
        written[i // spb] = written.get(i // spb, 0) + 1
    out = []
    for b in sorted(by_block)[:limit]:
        miss = by_block[b]
        cand: dict[int, int] = {}
        for s in range(spb):
            j = dinv.get(pmap.get(b * spb + s, 0)) if (b * spb + s) in pmap else None
            if j is not None and j % spb == s:
                cand[j // spb] = cand.get(j // spb, 0) + 1
        db = max(cand, key=cand.get) if cand else None
        state = {}
        for s in miss:
            if db is None:
                state[s] = "no decode block"
                continue
            x = dmap.get(db * spb + s)
            if x is None:
                state[s] = "unwritten"
            elif x in pinv:
                state[s] = f"prefill {pinv[x] // spb}/{pinv[x] % spb}"
            else:
                state[s] = "differs"
        out.append({"prefill_block": b, "prefill_written": written.get(b, 0), "missing": miss,
                    "decode_block": db, "decode_blocks_matched": cand, "decode_at_missing": state})
    return out


def kv_bytes_check(ctx: Ctx, pre: Server, dec: Server, requests: int) -> dict[str, Any]:
    """Whether decode holds, byte for byte, the KV that prefill computed.
    Every token slot prefill wrote (its digest over all layers) must be among
    decode's slots, but for the last token of each prompt: vLLM recomputes
    the last token of a fully loaded prompt on decode, in decode's own batch,
    so that token's KV may differ in the last bits. On GPU (a slot is a token
    in every vLLM CUDA layout) a missing slot is *explained* when it is the
    last one prefill wrote in its block (the next slot unwritten, or the
    block's last slot); the check passes with no unexplained slot and at most
    one explained per P/D request. A transfer that wrote wrong, stale or
    another request's bytes leaves whole blocks (or layers) of slots
    missing. On CPU vLLM's block layout mixes tokens within a block, so there
    the unit is the block: at most one block per request with a missing
    slot (its last)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from kv_digest import decode_digests

    t0 = time.monotonic()
    dp, dd = kv_digest(pre), kv_digest(dec)
    out: dict[str, Any] = {"requests": requests,
                           "prefill": {k: v for k, v in dp.items() if k not in ("digests", "index")},
                           "decode": {k: v for k, v in dd.items() if k not in ("digests", "index")}}
    if "error" in dp or "error" in dd:
        out["ok"] = None
        out["error"] = f"prefill: {dp.get('error')}; decode: {dd.get('error')}"
        ctx.log(f"  KV bytes: not compared ({out['error'][:300]})")
        return out
    p, d = decode_digests(dp), decode_digests(dd)
    pidx = decode_digests(dp, "index")
    spb = dp.get("slots_per_block") or 1
    written = set(pidx)
    have = set(d)
    missing = [i for i, x in zip(pidx, p) if x not in have]
    last = lambda i: (i + 1) % spb == 0 or (i + 1) not in written  # noqa: E731
    explained = [i for i in missing if last(i)]
    unexplained = [i for i in missing if not last(i)]
    blocks = sorted({i // spb for i in missing})
    out["missing_blocks"] = kv_missing_detail(pidx, p, decode_digests(dd, "index"), d, missing, spb)
    # per layer, for the missing slots not explained (at most 64): prefill's and decode's digests
    pairs = [(b["prefill_block"] * spb + s_, b["decode_block"] * spb + s_) for b in out["missing_blocks"]
             if b["decode_block"] is not None for s_ in b["missing"]][:64]
    if pairs:
        lp = kv_digest(pre, slots=[a for a, _ in pairs]).get("per_layer", {})
        ld = kv_digest(dec, slots=[b for _, b in pairs]).get("per_layer", {})
        out["missing_per_layer"] = [
            {"prefill": [a // spb, a % spb], "decode": [b // spb, b % spb],
             "layers": ["=" if x == y else ("decode 0" if y == "0" else ("prefill 0" if x == "0" else "differs"))
                        for x, y in zip(lp.get(str(a), []), ld.get(str(b), []))]}
            for a, b in pairs]
    out.update({"prefill_slots_written": len(p), "decode_slots_written": len(d),
                "prefill_slots_missing_on_decode": len(missing), "missing_last_in_block": len(explained),
                "missing_elsewhere": len(unexplained), "blocks_with_missing": len(blocks),
                "missing_elsewhere_first": [[i // spb, i % spb] for i in unexplained[:50]],
                "granularity": dp.get("slot_granularity"), "slots_per_block": spb,
                "seconds": round(time.monotonic() - t0, 2)})
    per_block = {b: sum(1 for i in missing if i // spb == b) for b in blocks}
    if ctx.cuda and dp.get("slot_granularity") == "token" and not unexplained:
        out["rule"] = "token: no missing slot but a block's last written one, at most one per request"
        out["ok"] = bool(p) and len(explained) <= requests
    elif ctx.cuda and dp.get("slot_granularity") == "token":
        # layouts that write every slot of a block they touch (fp8_per_token_head's
        # inline scales): the last prompt slot is not known, so one missing slot
        # per block, in at most one block per request
        out["rule"] = "token: at most one missing slot per block, in at most one block per request"
        out["ok"] = bool(p) and all(n == 1 for n in per_block.values()) and len(blocks) <= requests
    else:
        out["rule"] = "block: at most one block per request with a missing slot"
        out["ok"] = bool(p) and len(blocks) <= requests
    ctx.log(f"  KV bytes: {len(p)} slots written on prefill, {len(missing)} of them not on decode "
            f"({len(explained)} a block's last written slot, {len(unexplained)} elsewhere; {len(blocks)} blocks; "
            f"{requests} P/D requests): {'ok' if out['ok'] else 'NOT EQUAL'}")
    return out


def release_dir(ctx: Ctx, s: Server) -> Path:
    """Where an instance's test hook writes its per-request KV digests
    (``ORBITKV_TESTING_KV_DIGEST``)."""
    return ctx.work / "kv-release" / s.name


def read_release(d: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(d.glob("kvd-*.jsonl")):
        with contextlib.suppress(OSError):
            for line in f.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def release_digest_check(ctx: Ctx, pre: Server, dec: Server, requests: int) -> dict[str, Any]:
    """Per request, decode's KV as loaded (right after its load completed)
    against prefill's as it released it (right before its sending was
    reported finished), token for token over all layers: every token decode
    loaded must have prefill's digest at the same position of the prompt.
    Taken at those moments, no later reuse of a freed block on either side
    can touch it (unlike :func:`kv_bytes_check`, taken once both are idle).
    Per-token digests do not depend on the block size or layout, so a
    prefill and a decode of other block sizes compare."""
    from orbitkv.vllm._testing import decode_b64

    t0 = time.monotonic()
    pl, dl = read_release(release_dir(ctx, pre)), read_release(release_dir(ctx, dec))
    by_pd: dict[str, dict[str, Any]] = {}
    for x in pl:
        by_pd[x["pd"]] = x  # one release per request
    out: dict[str, Any] = {"requests": requests, "decode_records": len(dl), "prefill_records": len(pl)}
    compared = tokens = bad_tokens = 0
    bad_requests: list[dict[str, Any]] = []
    no_prefill: list[str] = []
    seen: set[str] = set()
    for d in dl:
        p = by_pd.get(d["pd"])
        if p is None:
            no_prefill.append(d["pd"])
            continue
        seen.add(d["pd"])
        dd, pd_ = decode_b64(d["digests"]), decode_b64(p["digests"])
        first = d["first_token"]
        dlay = [decode_b64(x) for x in d.get("per_layer", [])]
        play = [decode_b64(x) for x in p.get("per_layer", [])]
        miss = []
        for i, x in enumerate(dd):
            pos = first + i
            if pos >= len(pd_) or pd_[pos] != x:
                miss.append(pos)
        compared += 1
        tokens += len(dd)
        bad_tokens += len(miss)
        if miss:
            dbs, pbs = d["block_size"], p["block_size"]
            bad_requests.append({
                "pd": d["pd"], "decode_tokens": [first, d["end_token"]], "mismatched": len(miss),
                "first": [{"pos": pos, "decode": [d["blocks"][pos // dbs - first // dbs], pos % dbs],
                           "prefill": ([p["blocks"][pos // pbs], pos % pbs] if pos // pbs < len(p["blocks"])
                                       else None),
                           "layers": ["=" if pos < len(pl_) and pl_[pos] == dl_[pos - first] else "differs"
                                      for pl_, dl_ in zip(play, dlay)]}
                          for pos in miss[:8]],
                "last_position": d["end_token"] - 1 in miss})
    out.update({"requests_compared": compared, "tokens_compared": tokens, "tokens_mismatched": bad_tokens,
                "requests_mismatched": len(bad_requests), "mismatches": bad_requests[:40],
                "decode_without_prefill": no_prefill[:40], "prefill_without_decode": len(set(by_pd) - seen),
                "block_sizes": {"prefill": sorted({x["block_size"] for x in pl}),
                                "decode": sorted({x["block_size"] for x in dl})},
                "seconds": round(time.monotonic() - t0, 2)})
    out["ok"] = bool(compared >= requests and not bad_tokens and not no_prefill)
    ctx.log(f"  KV at release: {compared} requests, {tokens} tokens compared, {bad_tokens} differ "
            f"({len(bad_requests)} requests), {len(no_prefill)} loads without a prefill record: "
            f"{'ok' if out['ok'] else 'NOT EQUAL'}")
    return out


def load_digest_check(ctx: Ctx, pre: Server, dec: Server, sysres: dict[str, Any]) -> dict[str, Any]:
    """--load-kv-digest: :func:`release_digest_check` over every request a
    system's load runs completed (the warm-up too), with how many of them
    gave their prefill pages back before their writes (their prefill
    digest is taken at that report: the writes then read only the layer
    pieces, so a piece that differed from the pages shows here)."""
    requests = sum(int(r.get("completed") or 0) for r in sysres.get("runs", {}).values())
    out = release_digest_check(ctx, pre, dec, requests)
    md = sysres.get("metrics_delta", {}).get(pre.name, {})
    out["pages_given_back"] = md.get("vllm:orbitkv_producer_pages_given_back_total",
                                     md.get("vllm:orbitkv_producer_pages_given_back"))
    return out


def stage_a(ctx: Ctx, models: dict[str, tuple[ModelSpec, str]], eager: bool, on_ready: Callable[[dict], None] | None
            ) -> dict[str, Any]:
    name = "a-eager" if eager else "a-default"
    ctx.log(f"stage {name}: start")
    out: dict[str, Any] = {"stage": name, "started": time.time(), "models": {}}
    trios = {}
    for key, (spec, path) in models.items():
        trios[key] = small_trio(ctx, spec, path, eager, f"{key}{'-eager' if eager else ''}")
    if ctx.args.skip_layer_hook:
        # The fp32 model once more, its prefill's attention layers without
        # vLLM's per-layer connector hooks (as some model paths are): the
        # connector must send every layer at wait_for_save.
        key = next(iter(models))
        spec, path = models[key]
        nohook = f"{key}-nohook"
        trios[nohook] = small_trio(ctx, spec, path, eager, f"{nohook}{'-eager' if eager else ''}")
        trios[nohook][1].extra_env.update(skip_layer_hook_env(ctx))
        models = {**models, nohook: models[key]}
    allsrv = [s for t in trios.values() for s in t]
    for s in allsrv:
        start_server(ctx, s)
    failed = wait_ready(ctx, allsrv, ctx.args.start_timeout_s if not eager else ctx.args.start_timeout_s / 2)
    startup = {s.name: {"ready_after_s": None if s.ready_s is None else round(s.ready_s - s.started_s, 1),
                        "error": s.error, "argv": server_argv(ctx, s), "log_facts": log_facts(s.log)}
               for s in allsrv}
    out["startup"] = startup
    if on_ready:
        on_ready(failed)
    proxies = []
    try:
        for key, trio in trios.items():
            spec = models[key][0]
            r: dict[str, Any] = {"servers": [s.name for s in trio]}
            out["models"][key] = r
            if any(s.name in failed for s in trio):
                r["pass"] = False
                r["error"] = "did not start: " + "; ".join(f"{s.name}: {s.error}" for s in trio if s.error)
                ctx.log(f"  {key}: servers failed to start")
                continue
            if ctx.left() < 60:
                r["error"] = "skipped: out of time"
                continue
            try:
                proxy, purl = start_proxy(ctx, "orbit", f"{trio[0].name}-proxy", trio[1], trio[2])
                proxies.append(proxy)
                tol = ctx.args.tol_fp32 if spec.dtype == "float32" else ctx.args.tol_bf16
                ctx.log(f"  {key} ({spec.dtype}, {'eager' if eager else 'default mode'}):")
                r.update(correctness(ctx, spec, trio, purl, tol))
                if key.endswith("-nohook"):
                    # every layer of every P/D prefill step went at wait_for_save
                    late = r["metrics_delta"][trio[1].name].get("vllm:orbitkv_layers_saved_at_wait_total", 0)
                    r["layers_saved_at_wait"] = late
                    r["pass"] = bool(r["pass"] and late >= r["pd_requests"] * spec.layers)
            except Exception as e:  # noqa: BLE001
                r["pass"] = False
                r["error"] = f"{type(e).__name__}: {e}"
                r["traceback"] = traceback.format_exc()
                r["server_errors"] = {s.name: error_excerpt(s.log, 40) for s in trio}
                ctx.log(f"  {key}: ERROR {type(e).__name__}: {str(e)[:300]}")
            ctx.save(name, out)
    finally:
        stop(ctx, proxies + allsrv)
    out["ended"] = time.time()
    ctx.save(name, out)
    ctx.log(f"stage {name}: done")
    return out


# ---- stages m-mla and f-fp8: one P/D pair per attention backend or KV dtype ----------------------


# What vLLM 0.26 offers on this GPU, asked of its own selector: per model kind
# (MLA / MHA) and KV cache dtype, the valid backends in priority order (the
# first is vLLM's pick) and why the others are not valid.
BACKEND_PROBE = r"""
import json, sys, torch
out = {}
try:
    import contextlib
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig
    cap = current_platform.get_device_capability()
    out["capability"] = str(cap)
    # the MLA backends' checks read the current vLLM config (2026-12-04: without
    # one they raised "Current vLLM config is not set")
    ctx = contextlib.nullcontext()
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        ctx = set_current_vllm_config(VllmConfig())
    except Exception as e:
        out["config_context"] = f"{type(e).__name__}: {e}"
    ctx.__enter__()
    for mla, hs, nh in ((True, 576, 16), (False, 128, 16)):
        for kvd in json.loads(sys.argv[1]):
            cfg = AttentionSelectorConfig(head_size=hs, dtype=torch.bfloat16, kv_cache_dtype=kvd, block_size=None,
                                          use_mla=mla, use_kv_connector=True)
            key = ("mla" if mla else "mha") + ":" + kvd
            try:
                valid, invalid = current_platform.get_valid_backends(cap, cfg, num_heads=nh)
                out[key] = {"valid": [c.backend.name for c in valid],
                            "invalid": {k.name: v[1] for k, v in invalid.items()}}
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"}
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""

PROBE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "fp8_ds_mla"]


def backend_probe(ctx: Ctx) -> dict[str, Any]:
    try:
        r = subprocess.run([ctx.args.python, "-c", BACKEND_PROBE, json.dumps(PROBE_DTYPES)], capture_output=True,
                           text=True, timeout=240, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        if r.returncode == 0 and r.stdout.strip():
            return json.loads(r.stdout.strip().splitlines()[-1])
        return {"error": f"exit {r.returncode}: {r.stderr.strip()[-1500:]}"}
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


VLLM_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \[[^\]]*\] )?")
EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)\w*)(: .*)?$")


def exception_line(log: Path | None) -> str | None:
    """The last exception line of a log (``ValueError: ...``), vLLM's
    per-line prefix taken off: why a server did not start."""
    with contextlib.suppress(OSError, AttributeError):
        for line in reversed(log.read_text(errors="replace").splitlines()):  # type: ignore[union-attr]
            t = VLLM_PREFIX.sub("", line.strip()).strip()
            if EXC_LINE.match(t) and not t.startswith(("EngineCore failed", "RuntimeError: Engine core initialization")):
                return t[:600]
    return None


BACKEND_LINE = re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) (?:attention )?backend")


def backend_used(log: Path | None) -> str | None:
    """The attention backend vLLM says it uses (its selector's log line)."""
    with contextlib.suppress(OSError, AttributeError):
        m = BACKEND_LINE.findall(log.read_text(errors="replace"))  # type: ignore[union-attr]
        if m:
            return m[-1]
    return None


@dataclass
class Cell:
    """One engine and an OrbitKV pair per mode, started alike: ``backend``
    and ``dtype`` on all of them; ``sides``: more arguments per role
    (``single``, ``prefill``, ``decode``), e.g. a block size and backend per
    side; ``spec``/``model``: another model than the stage's."""

    backend: str | None
    dtype: str | None
    modes: list[str] | None
    key: str = ""
    sides: dict[str, list[str]] = field(default_factory=dict)
    spec: ModelSpec | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        self.key = self.key or cell_key(self.backend, self.dtype)


def parse_cells(text: str, first: str) -> list[Cell]:
    """``--mla-backends`` (``BACKEND[:KV_DTYPE[:MODES]]``) or
    ``--kv-cache-dtypes`` (``KV_DTYPE[:BACKEND[:MODES]]``), comma separated,
    as cells (backend, kv dtype, modes); ``auto`` or an empty backend:
    vLLM's pick; MODES (``direct+staging``, ``direct``): this cell's pairs
    (None: the stage's modes)."""
    out: list[Cell] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        a, b, m = (item.split(":") + ["", ""])[:3]
        backend, dtype = (a, b) if first == "backend" else (b, a)
        modes = [x for x in m.split("+") if x] or None
        out.append(Cell(None if backend in ("", "auto") else backend, dtype or None, modes))
    return out


def parse_block_pairs(text: str) -> list[tuple[str, str | None, int, str | None, int, list[str] | None]]:
    """``--block-pairs``: ``MODEL:PBACKEND/PBS>DBACKEND/DBS[:MODES]`` comma
    separated (MODEL ``dense`` or ``mla``; a backend ``auto``: vLLM's pick) as
    (model, prefill backend, prefill block size, decode backend, decode
    block size, modes)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        m = re.fullmatch(r"([^/>]+)/(\d+)>([^/>]+)/(\d+)", parts[1] if len(parts) > 1 else "")
        if parts[0] not in ("dense", "mla") or not m:
            raise SystemExit(f"--block-pairs: {item!r} is not MODEL:PBACKEND/PBS>DBACKEND/DBS[:MODES]")
        pb, pbs, db, dbs = m.groups()
        modes = [x for x in (parts[2] if len(parts) > 2 else "").split("+") if x] or None
        out.append((parts[0], None if pb == "auto" else pb, int(pbs), None if db == "auto" else db, int(dbs), modes))
    return out


def cell_key(backend: str | None, dtype: str | None) -> str:
    return "+".join(x for x in (backend or "auto", dtype) if x)


# direct: the shipped defaults (since e642ecd the layer pieces in blocks taken
# out of vLLM's KV cache); staging: every request through a staging of
# --cell-staging-mb (grants); kv-cache: orbitkv.pd.staging_memory kv_cache set
# by hand (the default's own setting); beside: the layer pieces in memory of
# their own beside vLLM's KV cache (orbitkv.pd.staging_memory beside, the
# default before e642ecd); write: orbitkv.pd.staging_pieces write (a writer
# lane gathers a computed layer's scattered pages into a piece for its write)
CELL_MODES = ("direct", "staging", "kv-cache", "beside", "write")
CELL_MODE_SUFFIX = {"direct": "", "staging": "-st", "kv-cache": "-kv", "beside": "-bs", "write": "-wr"}


def in_kv_cache(s: Server) -> bool:
    """Whether an OrbitKV instance's source staging is taken out of vLLM's
    KV cache: ``orbitkv.pd.staging_memory`` ``kv_cache``, set or (with no
    ``staging_mb`` set by hand) the shipped default since e642ecd. Such a
    prefill's taken blocks hold layer pieces, not KV slots, so the slot
    digest (kv_digest.py) would count them as prefill slots missing on
    decode: the per-request release digest checks those pairs."""
    cfg = s.orbit_cfg
    default = "beside" if "orbitkv.pd.staging_mb" in cfg else "kv_cache"
    return cfg.get("orbitkv.pd.staging_memory", default) == "kv_cache"


def stage_cells(ctx: Ctx, name: str, spec: ModelSpec, model: str, cells: list[Cell],
                modes: list[str], boundary: list[int], tol: float) -> dict[str, Any]:
    """One engine and an OrbitKV pair per mode (``direct``: no staging
    setting, the shipped default (layer pieces since 2026-12-04, cut out of
    vLLM's KV cache since e642ecd); ``staging``: every request through
    ``orbitkv.pd.staging_mb``; ``kv-cache`` / ``beside``: where the layer
    pieces live, set by hand)
    for each cell (an attention backend and/or a KV cache dtype, the same on
    all of the cell's instances), every instance started at once on GPU 0;
    then stage a's checks per pair (the cells in parallel, the pairs of one
    cell one after the other: they share its engine), with ``--cell-concurrent``
    prompts at once compared against the engine's one-by-one and its
    at-once answers, and prefill's KV compared with decode's byte for byte."""
    a = ctx.args
    ctx.log(f"stage {name}: start ({len(cells)} cells, model {spec.name}): "
            + ", ".join(f"{c.key} {c.modes or modes}" for c in cells))
    out: dict[str, Any] = {"stage": name, "started": time.time(), "model": spec.__dict__, "modes": modes,
                           "eager": a.cell_eager, "kv_gib": a.cell_kv_gib, "tolerance_nats": tol,
                           "concurrent": a.cell_concurrent, "cells": {}, "startup": {}}
    probe: dict[str, Any] = {}
    probe_t = threading.Thread(target=lambda: probe.update(backend_probe(ctx)), daemon=True)
    probe_t.start()
    tag = name.split("-", 1)[1]
    groups: dict[str, dict[str, Any]] = {}
    for cell in cells:
        key, backend, dtype, cell_modes = cell.key, cell.backend, cell.dtype, cell.modes
        cspec, cmodel = cell.spec or spec, cell.model or model
        extra = []
        if backend:
            extra += ["--attention-backend", backend]
        if dtype:
            extra += ["--kv-cache-dtype", dtype]
        if a.small_mnbt:
            extra += ["--max-num-batched-tokens", str(a.small_mnbt)]
        env = {"TORCHINDUCTOR_COMPILE_THREADS": str(a.cell_compile_threads)}
        if a.kv_digest:
            extra += ["--worker-extension-cls", "kv_digest.KvDigest"]
            env["VLLM_SERVER_DEV_MODE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        slug = re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-")

        def mk(role: str, conn: str, slug: str = slug, extra: list[str] = extra, env: dict[str, str] = env,
               cell: Cell = cell, cspec: ModelSpec = cspec, cmodel: str = cmodel) -> Server:
            s = Server(f"{tag}-{slug}-{role}", cmodel, cspec,
                       # (on CPU, a dry run: decode instances on core 1, the rest on core 0)
                       int(not ctx.cuda and "decode" in role), conn, a.cell_eager, a.cell_kv_gib * GIB,
                       cspec.max_pos, ctx.port(), ctx.port(), dict(env),
                       list(extra) + cell.sides.get(role.split("-")[0], []))
            if conn == "orbit" and a.release_digest:
                # the test hook: per request, decode's KV as loaded and prefill's as released
                s.extra_env["ORBITKV_TESTING_KV_DIGEST"] = str(release_dir(ctx, s))
            return s

        g: dict[str, Any] = {"backend": backend, "kv_cache_dtype": dtype, "single": mk("single", "none"), "pairs": {},
                             "spec": cspec, "sides": cell.sides}
        for mode in cell_modes or modes:
            sfx = CELL_MODE_SUFFIX[mode]
            pre, dec = mk("prefill" + sfx, "orbit"), mk("decode" + sfx, "orbit")
            allow_prefill(ctx, pre, dec)
            if mode == "staging":
                for s in (pre, dec):
                    s.orbit_cfg.update({"orbitkv.pd.staging_mb": a.cell_staging_mb, "orbitkv.pd.staging_min_ranges": 1})
            elif mode in ("kv-cache", "beside"):
                for s in (pre, dec):
                    s.orbit_cfg["orbitkv.pd.staging_memory"] = mode.replace("-", "_")
            elif mode == "write":
                for s in (pre, dec):
                    s.orbit_cfg["orbitkv.pd.staging_pieces"] = "write"
            g["pairs"][mode] = (pre, dec)
        groups[key] = g
    members = {k: [g["single"], *(x for p in g["pairs"].values() for x in p)] for k, g in groups.items()}
    servers = [s for m in members.values() for s in m]
    for s in servers:
        start_server(ctx, s)
    start_timeout = max(60, min(a.start_timeout_s, ctx.left() - 60))
    lock = threading.Lock()

    def save() -> None:
        with lock:
            if not probe_t.is_alive():
                out["backend_probe"] = probe
            ctx.save(name, out)

    def run_cell(key: str) -> None:
        g = groups[key]
        single = g["single"]
        # each cell starts its checks once its own instances are up (one
        # slow backend, e.g. a kernel compiled at start, holds up no other)
        failed = wait_ready(ctx, members[key], start_timeout)
        with lock:
            for s in members[key]:
                out["startup"][s.name] = {
                    "ready_after_s": None if s.ready_s is None else round(s.ready_s - s.started_s, 1),
                    "error": s.error, "argv": server_argv(ctx, s), "log_facts": log_facts(s.log),
                    "backend": backend_used(s.log), **({"why": exception_line(s.log)} if s.error else {})}
        c: dict[str, Any] = {"backend_asked": g["backend"], "kv_cache_dtype": g["kv_cache_dtype"],
                             "sides": g["sides"], "model": g["spec"].name,
                             "backend_used": {s.name: backend_used(s.log) for s in
                                              (single, *(x for p in g["pairs"].values() for x in p))},
                             "pairs": {}}
        with lock:
            out["cells"][key] = c
        if single.name in failed:
            c["error"] = f"one engine did not start: {single.error}"
            c["refused"] = exception_line(single.log) or True
        for i, (mode, (pre, dec)) in enumerate(g["pairs"].items()):
            r: dict[str, Any] = {"servers": [single.name, pre.name, dec.name]}
            c["pairs"][mode] = r
            bad = [s for s in (single, pre, dec) if s.name in failed]
            if bad:
                r["pass"] = False
                r["error"] = "did not start: " + "; ".join(f"{s.name}: {(s.error or '')[:4000]}" for s in bad)
                r["why"] = {s.name: exception_line(s.log) for s in bad}
                continue
            if ctx.left() < 60:
                r["error"] = "skipped: out of time"
                continue
            proxy = None
            try:
                proxy, purl = start_proxy(ctx, "orbit", f"{pre.name}-proxy", pre, dec)
                ctx.log(f"  {key} {mode}:")
                r.update(correctness(ctx, g["spec"], [single, pre, dec], purl, tol, seed_extra=100 * i,
                                     boundary=boundary, conc_n=a.cell_concurrent, staged=(mode == "staging"),
                                     # the taken blocks hold pieces in staged order, not KV slots:
                                     # the per-request release digest checks that pair's bytes
                                     digest=a.kv_digest and not in_kv_cache(pre), split_reps=a.chunk_split_reps,
                                     release=a.release_digest, in_kv_cache=in_kv_cache(pre)))
            except Exception as e:  # noqa: BLE001
                r["pass"] = False
                r["error"] = f"{type(e).__name__}: {e}"
                r["traceback"] = traceback.format_exc()
                r["server_errors"] = {s.name: error_excerpt(s.log, 40) for s in (single, pre, dec)}
                ctx.log(f"  {key} {mode}: ERROR {type(e).__name__}: {str(e)[:300]}")
            finally:
                if proxy is not None:
                    stop(ctx, [proxy])
            r["servers_alive"] = {s.name: bool(s.proc and s.proc.alive()) for s in (single, pre, dec)}
            save()

    try:
        with cf.ThreadPoolExecutor(max(1, a.cell_parallel)) as ex:
            list(ex.map(run_cell, list(groups)))
    finally:
        stop(ctx, servers)
    probe_t.join(timeout=max(1, min(120, ctx.left() - 30)))
    out["backend_probe"] = probe
    out["ended"] = time.time()
    save()
    ctx.log(f"stage {name}: done")
    return out


MODEL_LOCK = threading.Lock()  # stages run at once (--cell-stages-together) share models


def made(ctx: Ctx, spec: ModelSpec) -> str:
    with MODEL_LOCK:
        return make_model(spec, ctx.work / "models")


def stage_mla(ctx: Ctx) -> dict[str, Any]:
    spec = mla_spec(ctx)
    t = time.monotonic()
    model = made(ctx, spec)
    ctx.log(f"MLA model made in {time.monotonic() - t:.1f}s: {model}")
    modes = [m for m in ctx.args.cell_modes.split(",") if m]
    return stage_cells(ctx, "m-mla", spec, model, parse_cells(ctx.args.mla_backends, "backend"), modes,
                       ctx.args.mla_boundary_lengths, ctx.args.tol_bf16)


def stage_fp8(ctx: Ctx) -> dict[str, Any]:
    spec = small_spec(ctx, "bfloat16")
    model = made(ctx, spec)
    modes = [m for m in ctx.args.fp8_modes.split(",") if m]
    return stage_cells(ctx, "f-fp8", spec, model, parse_cells(ctx.args.kv_cache_dtypes, "dtype"), modes,
                       ctx.args.boundary_lengths, ctx.args.tol_fp8)


def stage_blocks(ctx: Ctx) -> dict[str, Any]:
    """``k-blocks``: prefill and decode of different ``--block-size`` (and,
    for MLA, backends), per ``--block-pairs`` entry; the one engine runs
    decode's backend and block size."""
    a = ctx.args
    dense, mla = small_spec(ctx, "bfloat16"), None
    cells = []
    for kind, pb, pbs, db, dbs, modes in parse_block_pairs(a.block_pairs):
        spec = dense
        if kind == "mla":
            mla = mla or mla_spec(ctx)
            spec = mla
        side = lambda b, n: (["--attention-backend", b] if b else []) + ["--block-size", str(n)]  # noqa: E731
        key = f"{kind} {pb or 'auto'}/{pbs} to {db or 'auto'}/{dbs}"
        cells.append(Cell(None, None, modes, key=key, spec=spec, model=made(ctx, spec),
                          sides={"prefill": side(pb, pbs), "decode": side(db, dbs), "single": side(db, dbs)}))
    modes = [m for m in a.block_modes.split(",") if m]
    tol = a.tol_bf16 if ctx.cuda else a.tol_fp32
    return stage_cells(ctx, "k-blocks", dense, made(ctx, dense), cells, modes, a.mla_boundary_lengths, tol)


# ---- the Llama-3-8B-shaped instances (stages b and c) -------------------------------------------


PD_SYSTEMS = ("orbit", "mc", "nixl")  # besides the A/B pair "orbit-<ab>"
# Systems that are another front on a pair of instances of another system
# (no instances of their own): orbit-router is the orbit pair behind vllm-router
# (nixl mode), orbit-router-mc the same pair behind it in its mooncake mode.
FRONTS = {"orbit-router": "orbit", "orbit-router-mc": "orbit"}
# The fronts that run vllm-router in its --kv-connector mooncake mode.
MOONCAKE_FRONTS = ("orbit-router-mc",)


def weights_gib(spec: ModelSpec) -> float:
    """The model's weights in GiB (bf16 on GPU), from its shape."""
    attn = spec.hidden * spec.heads * spec.head_dim * 2 + spec.hidden * spec.kv_heads * spec.head_dim * 2
    params = 2 * spec.vocab * spec.hidden + spec.layers * (attn + 3 * spec.hidden * spec.inter + 2 * spec.hidden)
    return params * (4 if spec.dtype == "float32" else 2) / GIB


def kv_token_bytes(spec: ModelSpec) -> int:
    return spec.layers * 2 * spec.kv_heads * spec.head_dim * (4 if spec.dtype == "float32" else 2)


def ab_config(text: str) -> dict[str, Any]:
    """--ab-config: a JSON object whose keys are all orbitkv.pd.* settings."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(cfg, dict) or not cfg:
        raise argparse.ArgumentTypeError("must be a non-empty JSON object")
    bad = [k for k in cfg if not k.startswith("orbitkv.pd.")]
    if bad:
        raise argparse.ArgumentTypeError(f"only orbitkv.pd.* settings, not {bad}")
    return cfg


# --ab-more NAME: the names --ab and the fronts take already
AB_MORE_TAKEN = {"none", "auto", "one-lane", "device-wait", "wide-ranges", "narrow-ranges", "lanes-16", "staging",
                 "control", "custom", "router", "python-gate", "py"}


def ab_more_name(name: str) -> bool:
    """Whether ``orbit-NAME`` is an --ab-more pair's system: NAME of 1-16
    lower-case letters and digits, not a name --ab or a front takes."""
    return bool(re.fullmatch(r"[a-z0-9]{1,16}", name)) and name not in AB_MORE_TAKEN


def ab_more(text: str) -> tuple[str, dict[str, Any]]:
    """--ab-more NAME=JSON: one more OrbitKV pair, the system ``orbit-NAME``
    (:func:`ab_more_name`), with the orbitkv.pd.* settings of JSON on both
    instances."""
    name, sep, cfg = text.partition("=")
    if not sep or not ab_more_name(name):
        raise argparse.ArgumentTypeError(
            f"NAME=JSON with NAME of 1-16 lower-case letters and digits, not one of {sorted(AB_MORE_TAKEN)}: {text!r}")
    return name, ab_config(cfg)


def wanted_systems(ctx: Ctx) -> list[str]:
    a = ctx.args
    out = ["single", "orbit"] if a.single else ["orbit"]
    if a.router:
        out.append("orbit-router")  # the orbit pair again, behind vllm-router
    if a.router_mc:
        out.append("orbit-router-mc")  # and behind vllm-router in its mooncake mode
    if a.ab != "none":
        out.append(f"orbit-{a.ab}")
    out += [f"orbit-{name}" for name, _ in a.ab_more]
    if a.mc:
        out.append("mc")
    if a.nixl == "yes" or (a.nixl == "auto" and not (a.one_gpu and ctx.cuda)):
        out.append("nixl")
    return out


def gpu_total_gib(smi: str = "nvidia-smi") -> float | None:
    """The memory of the smallest visible GPU, GiB, from nvidia-smi (no CUDA
    context in the driver); None where it cannot say."""
    try:
        r = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        mib = [float(x) for x in r.stdout.split() if x.strip()]
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    if r.returncode != 0 or not mib:
        return None
    return round(min(mib) / 1024, 2)


def plan_big(ctx: Ctx, spec: ModelSpec) -> dict[str, Any]:
    """How the Llama-3-8B-shaped instances fit the GPUs: the KV size of each
    instance (``--big-kv-gib``, or 0: the most that fits, at most
    ``--big-kv-cap-gib``) and the groups of systems that run together. The
    first group is one engine, OrbitKV and MooncakeConnector (the comparison
    of issue 33); the other P/D systems join it while every instance still gets
    at least the KV of the longest TTFT prompt and ``--min-kv-gib`` (else
    they run after it, in a later group of instances started once the first
    group is stopped: systems one after another, with the single engine of
    the first group as their reference)."""
    a = ctx.args
    systems = wanted_systems(ctx)
    w = weights_gib(spec) + a.instance_overhead_gib
    # the GPU's memory: as given, else as nvidia-smi says (an H100 is not an
    # H200: run 41 planned six instances for 139 GiB on 80 and two of them
    # ran out of memory), else an H200's
    detected = gpu_total_gib() if ctx.cuda and not a.gpu_gib else None
    gpu_gib = a.gpu_gib or detected or 139.0
    gpu_gib_source = "--gpu-gib" if a.gpu_gib else ("nvidia-smi" if detected else "an H200's (nothing detected)")
    tok = kv_token_bytes(spec)
    widest = max((r.concurrency for r in parse_runs(a.bench_runs)), default=1)
    # the floor: the longest TTFT prompt must fit (a load level wider than the KV
    # only makes requests wait for KV on decode: recorded, not avoided)
    need_tokens = max(a.ttft_lengths, default=0) + a.ttft_gen + 64
    floor_gib = max(a.min_kv_gib, need_tokens * tok / GIB)

    def count(grp: list[str]) -> int:
        """Instances on the fullest GPU: GPU 0 holds the single engine and every prefill."""
        pd = [x for x in grp if x not in ("single", *FRONTS)]  # a front has no instances of its own
        return (2 if a.one_gpu else 1) * len(pd) + (1 if "single" in grp else 0)

    def fit(grp: list[str]) -> float:
        if not ctx.cuda:
            return a.big_kv_gib or 0.25
        n = count(grp)
        return max(0.0, (gpu_gib - a.gpu_reserve_gib - n * w) / n)

    # what a system needs of the even share to join a group: the floor, and
    # the KV asked for (on one GPU a prefill per decode: their mean)
    need = floor_gib
    if a.big_kv_gib:
        need = max(need, a.big_kv_gib)
    if a.big_decode_kv_gib and a.one_gpu:
        need = max(need, ((a.big_kv_gib or floor_gib) + a.big_decode_kv_gib) / 2)
    first = [x for x in systems if x in ("single", "orbit", *FRONTS, "mc")]
    rest = [x for x in systems if x not in first]
    groups = [first]
    for x in rest:
        if fit(groups[-1] + [x]) >= need:
            groups[-1].append(x)
        else:
            groups.append([x])
    caps = [fit(g) for g in groups]
    if a.big_kv_gib:
        kv = a.big_kv_gib
    else:
        kv = min([a.big_kv_cap_gib] + caps)
        kv = max(0.25, int(kv * 4) / 4)  # quarter GiB steps
    plan = {"systems": systems, "groups": groups, "kv_gib": kv, "fit_kv_gib_per_group": [round(c, 2) for c in caps],
            "floor_kv_gib": round(floor_gib, 2), "weights_gib": round(weights_gib(spec), 2),
            "instance_overhead_gib": a.instance_overhead_gib, "gpu_gib": gpu_gib, "gpu_gib_source": gpu_gib_source,
            "kv_tokens_per_instance": int(kv * GIB // tok), "kv_token_bytes": tok,
            "widest_level_tokens": int(widest * (a.bench_input_len + a.bench_output_len)),
            "one_gpu": bool(a.one_gpu)}
    if ctx.cuda and a.big_kv_gib and any(c < a.big_kv_gib for c in caps):
        plan["warning"] = f"--big-kv-gib {a.big_kv_gib} is more than fits by the estimate ({plan['fit_kv_gib_per_group']})"
    if a.ab == "custom":
        plan["ab_config"] = a.ab_config  # the A/B pair's settings (orbit-custom)
    if a.ab_more:
        plan["ab_more"] = dict(a.ab_more)  # orbit-NAME's settings, by NAME
    if a.big_orbit_block_sizes:
        plan["orbit_block_sizes"] = dict(zip(("prefill", "decode"), a.big_orbit_block_sizes, strict=True))
    plan["orbit_roles"] = ({"prefill": "kv_producer", "decode": "kv_consumer"} if a.orbit_roles == "split"
                           else {"prefill": "kv_both", "decode": "kv_both"})
    if a.big_decode_kv_gib:
        # decode instances get their own KV size (prefill and single keep kv_gib)
        plan["decode_kv_gib"] = a.big_decode_kv_gib
        plan["decode_kv_tokens"] = int(a.big_decode_kv_gib * GIB // tok)
        if ctx.cuda and a.one_gpu and any((kv + a.big_decode_kv_gib) / 2 > c for c in caps):
            # one GPU holds a prefill per decode: their mean must fit the even share
            plan["warning"] = (f"--big-kv-gib {kv} and --big-decode-kv-gib {a.big_decode_kv_gib} are more than "
                               f"fits by the estimate ({plan['fit_kv_gib_per_group']})")
    dec_tokens = plan.get("decode_kv_tokens", plan["kv_tokens_per_instance"])
    if dec_tokens < plan["widest_level_tokens"]:
        plan["kv_bound_levels"] = (f"a decode instance holds {dec_tokens} tokens of KV, less than "
                                   f"the widest load level's in-flight requests on average ({plan['widest_level_tokens']}): "
                                   "there, requests wait for KV (see 'decode waiting peak')")
    return plan


def block_size_pair(text: str) -> tuple[int, int]:
    """--big-orbit-block-sizes P:D: two vLLM block sizes (powers of two,
    1-1024: what vLLM takes)."""
    p, sep, d = text.partition(":")
    try:
        sizes = (int(p), int(d))
    except ValueError:
        sizes = (0, 0)
    if not sep or any(n < 1 or n > 1024 or n & (n - 1) for n in sizes):
        raise argparse.ArgumentTypeError(f"want PREFILL:DECODE block sizes, powers of two up to 1024, not {text!r}")
    return sizes


def orbit_block_sizes(servers: list[Server], sizes: tuple[int, int]) -> None:
    """Gives every OrbitKV prefill (a server named ``...-prefill``) vLLM's
    ``--block-size`` sizes[0] and every OrbitKV decode sizes[1]; the other
    connectors' instances and the single engine keep vLLM's default."""
    for s in servers:
        if s.connector != "orbit":
            continue
        side = 0 if s.name.endswith("-prefill") else 1 if s.name.endswith("-decode") else None
        if side is not None:
            s.extra_args += ["--block-size", str(sizes[side])]


class Fleet:
    """The Llama-3-8B-shaped instances of one group of systems: single
    (GPU 0); OrbitKV prefill (GPU 0) + decode (GPU 1) + orbitkv.proxy (and the
    A/B pair; with --router, vllm-router in front of the same OrbitKV pair:
    the system ``orbit-router``); MooncakeConnector prefill (GPU 0) + decode
    (GPU 1) + mc_proxy.py; NIXL prefill (GPU 0) + decode (GPU 1) +
    nixl_proxy.py. With --one-gpu every instance is on GPU 0."""

    def __init__(self, ctx: Ctx, spec: ModelSpec, model: str, eager: bool, orbit_env: dict[str, str],
                 systems: list[str] | None = None, kv_gib: float | None = None, group: int = 0):
        self.ctx, self.spec, self.eager, self.model = ctx, spec, eager, model
        systems = systems or wanted_systems(ctx)
        self.group = group
        tag = ("big-eager" if eager else "big") + (f"-g{group + 1}" if group else "")
        kv_single = (kv_gib or ctx.args.big_kv_gib or 12) * GIB
        # --big-decode-kv-gib: every decode instance's own KV size
        kv_decode = ctx.args.big_decode_kv_gib * GIB or kv_single
        mml = ctx.args.big_max_model_len
        mk = lambda name, gpu, conn, env=None: Server(  # noqa: E731
            f"{tag}-{name}", model, spec, gpu, conn, eager, kv_decode if name.endswith("-decode") else kv_single,
            mml, ctx.port(), ctx.port(), dict(env or {}))
        self.single = mk("single", 0, "none") if "single" in systems else None
        self.orbit_env = orbit_env
        self.pairs: dict[str, list[Server]] = {}
        if self.single is not None:
            self.pairs["single"] = [self.single]
        if "orbit" in systems:
            self.opre = mk("orbit-prefill", 0, "orbit", orbit_env)
            self.odec = mk("orbit-decode", 1, "orbit", orbit_env)
            allow_prefill(ctx, self.opre, self.odec)
            if "orbit-router-mc" in systems:
                # vllm-router's mooncake mode speaks MooncakeConnector's
                # fields: the pair serves that dialect (requests from
                # orbitkv.proxy carry OrbitKV's own and are unchanged)
                for s in (self.opre, self.odec):
                    s.orbit_cfg["orbitkv.pd.dialects"] = ["mooncake"]
            self.pairs["orbit"] = [self.opre, self.odec]
        # fronts: another router in front of a pair above (its system's
        # servers are that pair's: pair(), metrics and peaks)
        self.fronts = {f: base for f, base in FRONTS.items() if f in systems and base in self.pairs}
        for base in set(self.fronts.values()):
            # the shared pair's prefix caches are emptied before each of its
            # systems' load runs (the same prompts for every system)
            for s in self.pairs[base]:
                s.extra_env["VLLM_SERVER_DEV_MODE"] = "1"
        # A/B: a second OrbitKV pair with one setting changed (--ab):
        #   one-lane     one writer per peer (orbitkv.pd.writer_lanes = 1), as before lanes
        #   device-wait  Mooncake's own submit-time wait on the writer's default stream
        #                (orbitkv.pd.mooncake_submit_wait = "device"), as before it was redirected
        #   wide-ranges  the per-peer cap of ranges in flight set to 8192
        #                (orbitkv.pd.max_inflight_ranges; 2048 per writer lane), the
        #                default on Mooncake's NVLink transport since it depends on the transport
        #   narrow-ranges  that cap set to 768 (192 per writer lane), the default on TCP and
        #                the cap on every transport before (runs 31-33's control)
        #   staging      requests through staging (orbitkv.pd.staging_mb 8192 on both
        #                instances, staging_min_ranges 1: every request; --ab-staging-mb and
        #                --ab-staging-min-ranges change both): gathered on prefill, written
        #                into decode's grant, scattered into decode's pages
        #   control      nothing: an identical second pair (A/A), the spread between two pairs
        #   custom       the orbitkv.pd.* settings of --ab-config (a JSON object) on both instances
        ab = ctx.args.ab
        if ab != "none" and f"orbit-{ab}" in systems:
            env = dict(orbit_env)
            self.opre_ab = mk("orbitab-prefill", 0, "orbit", env)
            self.odec_ab = mk("orbitab-decode", 1, "orbit", env)
            if ab == "one-lane":
                self.opre_ab.orbit_cfg["orbitkv.pd.writer_lanes"] = 1
            if ab == "lanes-16":
                self.opre_ab.orbit_cfg["orbitkv.pd.writer_lanes"] = 16
            if ab == "device-wait":
                self.opre_ab.orbit_cfg["orbitkv.pd.mooncake_submit_wait"] = "device"
            if ab == "wide-ranges":
                self.opre_ab.orbit_cfg["orbitkv.pd.max_inflight_ranges"] = 8192
            if ab == "narrow-ranges":
                self.opre_ab.orbit_cfg["orbitkv.pd.max_inflight_ranges"] = 768
            if ab == "staging":
                for s in (self.opre_ab, self.odec_ab):
                    s.orbit_cfg["orbitkv.pd.staging_mb"] = ctx.args.ab_staging_mb
                    s.orbit_cfg["orbitkv.pd.staging_min_ranges"] = ctx.args.ab_staging_min_ranges
            if ab == "custom":
                for s in (self.opre_ab, self.odec_ab):
                    s.orbit_cfg.update(ctx.args.ab_config)
            allow_prefill(ctx, self.opre_ab, self.odec_ab)
            self.pairs[f"orbit-{ab}"] = [self.opre_ab, self.odec_ab]
        # --ab-more NAME=JSON: one more pair each, with those settings
        for name, cfg in ctx.args.ab_more:
            if f"orbit-{name}" not in systems:
                continue
            pair = [mk(f"orbit{name}-prefill", 0, "orbit", dict(orbit_env)),
                    mk(f"orbit{name}-decode", 1, "orbit", dict(orbit_env))]
            for s in pair:
                s.orbit_cfg.update(cfg)
            allow_prefill(ctx, *pair)
            self.pairs[f"orbit-{name}"] = pair
        if "mc" in systems:
            self.mpre = mk("mc-prefill", 0, "mc")
            self.mpre.mc_role = "kv_producer"
            self.mdec = mk("mc-decode", 1, "mc")
            self.mdec.mc_role = "kv_consumer"
            self.pairs["mc"] = [self.mpre, self.mdec]
        if "nixl" in systems:
            self.npre = mk("nixl-prefill", 0, "nixl")
            self.ndec = mk("nixl-decode", 1, "nixl")
            self.pairs["nixl"] = [self.npre, self.ndec]
        self.servers = [s for p in self.pairs.values() for s in p]
        if ctx.args.big_orbit_block_sizes:
            orbit_block_sizes(self.servers, ctx.args.big_orbit_block_sizes)
        if ctx.args.load_kv_digest:
            # --load-kv-digest: per request, decode's KV as loaded and
            # prefill's as released or given back early (the test hook)
            for s in self.servers:
                if s.connector == "orbit":
                    s.extra_env["ORBITKV_TESTING_KV_DIGEST"] = str(release_dir(ctx, s))
        self.systems = [x for x in ["single", "orbit", *self.fronts,
                                    *(k for k in self.pairs if k.startswith("orbit-")), "mc", "nixl"]
                        if x in self.pairs or x in self.fronts]
        self.proxies: list[Proc] = []
        self.proxy_logs: dict[str, Path] = {}
        self.routers: dict[str, dict[str, Any]] = {}  # front -> what it ran (argv, version, log, ...)
        self.urls: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.mc_info: dict[str, Any] = {}

    def start(self) -> None:
        for s in self.servers:
            start_server(self.ctx, s)

    def wait(self, timeout_s: float) -> dict[str, str]:
        self.failed = wait_ready(self.ctx, self.servers, timeout_s)
        if self.single is not None and self.single.ready_s:
            self.urls["single"] = self.single.url
        for system, (pre, dec) in ((k, v) for k, v in self.pairs.items() if k != "single"):
            kind = system if system in ("nixl", "mc") else "orbit"
            if pre.ready_s and dec.ready_s:
                try:
                    pname = f"{pre.name.rsplit('-', 1)[0]}-proxy"
                    p, url = start_proxy(self.ctx, kind, pname, pre, dec)
                    self.proxies.append(p)
                    self.urls[system] = url
                    self.proxy_logs[system] = self.ctx.work / "logs" / f"{pname}.log"
                    if kind == "mc":
                        with contextlib.suppress(Exception):
                            import urllib.request

                            with urllib.request.urlopen(url + "/mc_info", timeout=5) as r:
                                self.mc_info = json.loads(r.read())
                            self.ctx.log(f"  mc proxy: prefill engine id {self.mc_info.get('engine_id')!r} from "
                                         f"{str(self.mc_info.get('engine_id_source'))[:200]}")
                except Exception as e:  # noqa: BLE001
                    self.failed[f"{kind}-proxy"] = f"{type(e).__name__}: {e}"
        for front, base in self.fronts.items():
            pre, dec = self.pairs[base]
            if not (pre.ready_s and dec.ready_s):
                continue
            mooncake = front in MOONCAKE_FRONTS
            name = f"{pre.name.rsplit('-', 1)[0]}-vllm-router" + ("-mc" if mooncake else "")
            try:
                p, url, rec = start_router(self.ctx, name, pre, dec, mooncake)
                self.proxies.append(p)
                self.urls[front] = url
                self.routers[front] = rec
            except Exception as e:  # noqa: BLE001
                self.failed[front] = f"{type(e).__name__}: {e}"
                self.routers[front] = {"error": self.failed[front], "log": str(self.ctx.work / "logs" / f"{name}.log"),
                                       "found": self.ctx.router_info}
                self.ctx.log(f"FAILED to start vllm-router for {front}: {self.failed[front][:300]}")
        return self.failed

    def shares_instances(self, system: str) -> bool:
        """Whether another system of this fleet runs on the same instances."""
        return system in self.fronts or system in self.fronts.values()

    def startup(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            s.name: {"ready_after_s": None if s.ready_s is None else round(s.ready_s - s.started_s, 1),
                     "error": s.error, "argv": server_argv(self.ctx, s), "log_facts": log_facts(s.log),
                     **({"mooncake_transport": mooncake_lines(s.log)} if s.connector in ("mc", "orbit") else {}),
                     **({"mc_env": {k: v for k, v in server_env(self.ctx, s).items()
                                    if k.startswith(("MC_", "VLLM_MOONCAKE", "GLOG", "PYTHONPATH"))}}
                        if s.connector == "mc" else {})}
            for s in self.servers}
        return out | {"orbit_env": self.orbit_env, "urls": self.urls, "group": self.group, "systems": self.systems,
                      "mc_proxy": self.mc_info, "proxy_errors": {
                          k: v for k, v in self.failed.items() if k.endswith("proxy")},
                      "routers": {f: {"in_front_of": b, **self.routers.get(f, {})} for f, b in self.fronts.items()}}

    def pair(self, system: str) -> list[Server]:
        return self.pairs[self.fronts.get(system, system)]

    def stop(self) -> None:
        stop(self.ctx, self.proxies + self.servers)
        self.proxies = []


MOONCAKE_LINE = re.compile(r"Using .*[Tt]ransport|[Ii]nstall(ing|ed)? .*[Tt]ransport|Topology discovery complete|"
                           r"Mooncake Transfer Engine is using|Selected .*allocator|malloc/free for protocol|"
                           r"Mooncake is not available|Transfer Engine initialization failed|MC_INTRANODE_NVLINK")


def mooncake_lines(log: Path | None, limit: int = 12) -> list[str]:
    """The lines where Mooncake (through vLLM's connector or OrbitKV) says
    which transport it installed."""
    out: list[str] = []
    if log is None:
        return out
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if MOONCAKE_LINE.search(line) and not line.startswith("# "):
                t = line.strip()[:300]
                if t not in out:
                    out.append(t)
            if len(out) >= limit:
                break
    return out


# OrbitKV's histograms of a request's phases after its prefill answered
# (docs/configuration.md, metrics): the prefill's and the decode's.
PHASES = ("written_after_finish", "pages_held_after_finish", "complete_to_taken", "handshake_after_finish",
          "sent_after_finish", "computed_after_finish", "ended_after_finish", "reported_after_finish")


def phase_buckets(m: dict[str, float]) -> dict[str, dict[float, float]]:
    """The cumulative bucket counts of each phase's histogram in ``m`` (a
    ``metrics()`` answer): {phase: {le: count}}; empty for a wheel without them."""
    out: dict[str, dict[float, float]] = {}
    for k, v in m.items():
        for ph in PHASES:
            head = f'vllm:orbitkv_{ph}_seconds_bucket{{le="'
            if k.startswith(head):
                le = k[len(head):-2]
                out.setdefault(ph, {})[float("inf") if le == "+Inf" else float(le)] = v
    return out


def bucket_quantile(cum: dict[float, float], q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative counts {le: count}:
    linear inside the bucket the quantile falls in (None without counts; the
    highest finite bound when it falls in +Inf)."""
    bounds = sorted(cum)
    total = cum[bounds[-1]] if bounds else 0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le in bounds:
        if cum[le] >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(cum[le] - below, 1e-12)
        lo, below = le, cum[le]
    return lo


def level(run: dict[str, Any]) -> str:
    """A load level as the summary names it: the requests in flight (a closed
    loop), or for an open loop its rate and the in-flight cap."""
    rate = run.get("request_rate", "inf")
    return str(run.get("concurrency")) if rate in ("inf", None) else f"{rate}/s (at most {run.get('concurrency')})"


def level_rows(stage: dict[str, Any], key: str, cells: Callable[[Any], str]) -> list[str]:
    """A summary row per system and load level (warm-ups left out) whose
    run has ``key``: ``| system | in flight | `` and ``cells(run[key])``."""
    return [f"| {system} | {level(x)} | {cells(x[key])}"
            for system, sr in stage.get("systems", {}).items()
            for tag, x in sr.get("runs", {}).items() if not tag.startswith("warm") and x.get(key)]


def phase_cells(ph: dict[str, Any]) -> str:
    """A level's phase quantiles (``Sampler.phases``) as summary cells."""
    def h(phase: str) -> str:
        q = ph.get(phase)
        return f"{q['p50_ms']:.0f} / {q['p90_ms']:.0f} ({q['n']:.0f})" if q else "-"
    return (f"{h('handshake_after_finish')} | {h('computed_after_finish')} | {h('sent_after_finish')} | "
            f"{h('written_after_finish')} | {h('ended_after_finish')} | {h('reported_after_finish')} | "
            f"{h('pages_held_after_finish')} | {h('complete_to_taken')} |")


def proxy_cells(pb: dict[str, Any]) -> str:
    """A level's proxy breakdown (``proxy_breakdown``) as summary cells."""
    def g(what: str) -> str:
        q = pb.get(what)
        return f"{q['p50']:.0f} / {q['p90']:.0f}" if q else "-"
    return f"{pb['requests']} | {g('prefill_answer_ms')} | {g('first_byte_ms')} | {g('first_byte_minus_prefill_ms')} |"


class Sampler(threading.Thread):
    """Polls the given servers' /metrics every ``every_s``: KV usage, running,
    waiting, and OrbitKV's phase histograms (for each level's quantiles)."""

    def __init__(self, servers: list[Server], every_s: float = 0.25):
        super().__init__(daemon=True)
        self.servers, self.every_s = servers, every_s
        self.samples: list[tuple[float, str, float, float, float]] = []
        self.phase_samples: list[tuple[float, str, dict[str, dict[float, float]]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for s in self.servers:
                with contextlib.suppress(Exception):
                    m = metrics(s.url, timeout_s=2)
                    self.samples.append((time.time(), s.name, m.get("vllm:kv_cache_usage_perc", -1),
                                         m.get("vllm:num_requests_running", -1),
                                         m.get("vllm:num_requests_waiting", -1)))
                    b = phase_buckets(m)
                    if b:
                        self.phase_samples.append((time.time(), s.name, b))
            self._halt.wait(self.every_s)

    def phases(self, t0: float, t1: float, grace_s: float = 1.0) -> dict[str, dict[str, float]]:
        """Each phase's requests and p50 / p90 (ms) between t0 and t1 (+
        ``grace_s``: a request's last observations reach /metrics a step
        after its answer), from the bucket counts sampled nearest before each."""
        out: dict[str, dict[str, float]] = {}
        for name in {n for _, n, _ in self.phase_samples}:
            mine = [(t, b) for t, n, b in self.phase_samples if n == name]
            start = [b for t, b in mine if t <= t0] or [{}]
            end = [b for t, b in mine if t <= t1 + grace_s]
            if not end:
                continue
            for ph, cum in end[-1].items():
                d = {le: c - start[-1].get(ph, {}).get(le, 0.0) for le, c in cum.items()}
                n = d.get(float("inf"), 0.0)
                if n > 0:
                    out[ph] = {"n": n, **{f"p{int(q * 100)}_ms": round(1e3 * (bucket_quantile(d, q) or 0.0), 1)
                                          for q in (0.5, 0.9)}}
        return out

    def finish(self) -> None:
        self._halt.set()
        self.join(5)

    def peaks(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for t, name, kv, run, wait in self.samples:
            if t0 <= t <= t1:
                d = out.setdefault(name, {"kv_usage_peak": 0.0, "running_peak": 0.0, "waiting_peak": 0.0, "n": 0})
                d["kv_usage_peak"] = max(d["kv_usage_peak"], kv)
                d["running_peak"] = max(d["running_peak"], run)
                d["waiting_peak"] = max(d["waiting_peak"], wait)
                d["n"] += 1
        return out


BENCH_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
              "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms",
              "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
              "median_itl_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
              "p99_e2el_ms")


PROXY_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*: decode=(\S+) prefill_s=(\S+) "
                        r"first_byte_s=(\S+) done_s=(\S+)")


# vLLM's MooncakeConnector logs its transfers every 10 s (metrics.py), e.g.
# "INFO 12-03 07:12:24 [metrics.py:103] KV Transfer metrics: Num successful
# transfers=64, Avg xfer time (ms)=129.684, ..., Avg MB per transfer=304.656,
# ..., Avg number of descriptors=4720.8, ...": each line covers the 10 s before it.
MC_XFER_LINE = re.compile(
    r".*INFO (\d\d-\d\d \d\d:\d\d:\d\d) .*KV Transfer metrics: Num successful transfers=(\d+), "
    r"Avg xfer time \(ms\)=([\d.]+),.*Avg MB per transfer=([\d.]+),.*Avg number of descriptors=([\d.]+)")


def mc_transfer_metrics(log: Path | None, t0: float, t1: float) -> dict[str, Any] | None:
    """MooncakeConnector's own account of its transfers (its prefill's log
    lines, each covering 10 s) between t0 and t1 + 10 s: transfers, and per
    transfer (one Mooncake batch holding every layer of a request) the
    descriptors, MB and ms, weighted by transfers. None if none were logged."""
    if log is None:
        return None
    n = 0
    ms = mb = descs = 0.0
    year = time.localtime(t0).tm_year
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            m = MC_XFER_LINE.match(line)
            if not m:
                continue
            t = time.mktime(time.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S"))
            if not t0 < t <= t1 + 10:
                continue
            k = int(m.group(2))
            n += k
            ms += k * float(m.group(3))
            mb += k * float(m.group(4))
            descs += k * float(m.group(5))
    if not n:
        return None
    return {"transfers": n, "ms_per_transfer": round(ms / n, 1), "mb_per_transfer": round(mb / n, 1),
            "descriptors_per_transfer": round(descs / n, 1),
            "kb_per_descriptor": round(1e3 * mb / descs, 1) if descs else None}


def proxy_breakdown(log: Path, t0: float, t1: float) -> dict[str, Any]:
    """From the proxies' per-request lines (orbitkv.proxy, nixl_proxy.py) of
    requests that ended in [t0, t1]: medians and p90 of when the prefill
    answered, decode's first byte came, and of the gap between the two (the
    hand-off as the client sees it), in ms after the proxy took the request."""
    pre: list[float] = []
    first: list[float] = []
    gap: list[float] = []
    n = 0
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            m = PROXY_LINE.match(line)
            if not m:
                continue
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            if not t0 <= t <= t1 + 1:
                continue
            n += 1
            p = None if m.group(4) == "-" else float(m.group(4)) * 1e3
            f = None if m.group(5) == "-" else float(m.group(5)) * 1e3
            if p is not None:
                pre.append(p)
            if f is not None:
                first.append(f)
            if p is not None and f is not None:
                gap.append(f - p)

    def stat(xs: list[float]) -> dict[str, float] | None:
        return {"p50": round(statistics.median(xs), 1), "p90": round(q(xs, 0.9), 1), "n": len(xs)} if xs else None

    return {"requests": n, "prefill_answer_ms": stat(pre), "first_byte_ms": stat(first),
            "first_byte_minus_prefill_ms": stat(gap)}


def group_record(fleet: Fleet) -> dict[str, Any]:
    return {"group": fleet.group + 1, "systems": fleet.systems, "urls": dict(fleet.urls), "mc_proxy": fleet.mc_info,
            "started": time.time()}


def stage_b(ctx: Ctx, fleet: Fleet, name: str, acc: dict[str, Any] | None = None) -> dict[str, Any]:
    """vllm bench serve against each system of the fleet, one system after
    another; ``acc``: the stage's result of an earlier group, extended."""
    ctx.log(f"stage {name}: start (group {fleet.group + 1}: {fleet.systems})")
    out: dict[str, Any] = acc or {
        "stage": name, "started": time.time(), "eager": fleet.eager, "startup": {},
        "config": {"input_len": ctx.args.bench_input_len, "input_range": ctx.args.bench_input_range,
                   "output_len": ctx.args.bench_output_len, "runs": ctx.args.bench_runs,
                   "warmup": ctx.args.bench_warmup}, "systems": {}, "groups": []}
    out["startup"].update(fleet.startup())
    out["groups"].append(group_record(fleet))
    if ctx.plan:
        out["plan"] = ctx.plan
    bdir = ctx.work / "bench" / name
    bdir.mkdir(parents=True, exist_ok=True)
    order = [s for s in fleet.systems if s in fleet.urls]
    for system in fleet.systems:
        if system not in fleet.urls:
            out["systems"][system] = {"error": "not running: " + ("; ".join(
                f"{s.name}: {(s.error or '')[:3000]}" for s in fleet.pair(system) if s.error)
                or str(fleet.failed.get(system, "proxy failed"))[:3000])}
    for system in order:
        per_run_s = ctx.args.bench_system_timeout_s
        if ctx.left() < 90:
            out["systems"][system] = {"error": "skipped: out of time"}
            continue
        servers = fleet.pair(system)
        reset = reset_prefix_cache(ctx, servers) if fleet.shares_instances(system) else None
        before = {s.name: snapshot(s.url) for s in servers}
        sampler = Sampler(servers)
        sampler.start()
        runs = ctx.args.bench_warmup + "," + ctx.args.bench_runs
        argv = [ctx.args.python, str(HERE / "bench_client.py"), "--base-url", fleet.urls[system],
                "--model", fleet.spec.name, "--tokenizer", fleet.model, "--out", str(bdir),
                "--label", system, "--runs", runs, "--input-len", str(ctx.args.bench_input_len),
                "--input-range", str(ctx.args.bench_input_range), "--output-len", str(ctx.args.bench_output_len)]
        log = ctx.work / "logs" / f"{name}-{system}-client.log"
        ctx.log(f"  {system}: vllm bench serve runs {runs}")
        t0 = time.time()
        rc = None
        try:
            with open(log, "w") as lf:
                rc = subprocess.run(argv, stdout=lf, stderr=subprocess.STDOUT,
                                    timeout=min(per_run_s, max(30, ctx.left() - 30))).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        sampler.finish()
        after = {s.name: snapshot(s.url) for s in servers}
        sysres: dict[str, Any] = {"rc": rc, "client_s": round(time.time() - t0, 1), "runs": {}}
        if reset is not None:
            sysres["prefix_cache_reset"] = reset
        if system in fleet.fronts:
            sysres["front"] = {"in_front_of": fleet.fronts[system], **fleet.routers.get(system, {})}
        with contextlib.suppress(OSError, ValueError):
            for entry in json.loads((bdir / f"{system}-runs.json").read_text()):
                r = {"status": entry["status"], "concurrency": entry["concurrency"],
                     "request_rate": entry.get("request_rate", "inf"),
                     "num_prompts": entry["num_prompts"], "seed": entry["seed"]}
                with contextlib.suppress(OSError, ValueError):
                    full = json.loads((bdir / f"{system}-{entry['tag']}.json").read_text())
                    r.update({k: full[k] for k in BENCH_KEYS if k in full})
                    if "input_lens" in full:
                        r["input_tokens_min_max"] = [min(full["input_lens"]), max(full["input_lens"])]
                if "traceback" in entry:
                    r["traceback"] = entry["traceback"][-3000:]
                r["servers"] = sampler.peaks(entry["start"], entry["end"])
                for srv in servers:
                    whole_cache_peak(r["servers"].get(srv.name), kv_taken(srv.log))
                if sampler.phase_samples:
                    r["orbit_phases"] = sampler.phases(entry["start"], entry["end"])
                if system in fleet.proxy_logs:
                    r["proxy_breakdown"] = proxy_breakdown(fleet.proxy_logs[system], entry["start"], entry["end"])
                sysres["runs"][entry["tag"]] = r
        if not sysres["runs"]:
            sysres["client_log_tail"] = error_excerpt(log, 40)
        sysres["metrics_delta"] = {s.name: delta(before[s.name], after[s.name]) for s in servers}
        mc_pre = next((s for s in servers if s.mc_role == "kv_producer"), None)
        if mc_pre is not None:
            sysres["mc_transfer_metrics"] = mc_transfer_metrics(mc_pre.log, t0, time.time())
        sysres["server_alive"] = {s.name: bool(s.proc and s.proc.alive()) for s in servers}
        for s in servers:
            if s.proc and not s.proc.alive():
                sysres.setdefault("server_errors", {})[s.name] = error_excerpt(s.log, 60)
        if "ORBITKV_TESTING_KV_DIGEST" in servers[0].extra_env and len(servers) == 2:
            sysres["kv_release"] = load_digest_check(ctx, servers[0], servers[1], sysres)
        out["systems"][system] = sysres
        ctx.log(f"  {system}: done in {sysres['client_s']}s, runs "
                + ", ".join(f"{t}: {r['status'][:40]}" for t, r in sysres["runs"].items()))
        ctx.save(name, out)
    out["ended"] = time.time()
    ctx.save(name, out)
    ctx.log(f"stage {name}: done")
    return out


def stage_c(ctx: Ctx, fleet: Fleet, name: str, acc: dict[str, Any] | None = None) -> dict[str, Any]:
    """TTFT, the fleet's systems in rotating order; ``acc``: the stage's
    result of an earlier group, extended (its systems were measured then)."""
    ctx.log(f"stage {name}: start (group {fleet.group + 1}: {fleet.systems})")
    lengths = ctx.args.ttft_lengths
    systems = [s for s in fleet.systems if s in fleet.urls]
    out: dict[str, Any] = acc or {"stage": name, "started": time.time(), "eager": fleet.eager, "startup": {},
                                  "lengths": lengths, "systems": [], "reps": ctx.args.ttft_reps,
                                  "warmup_rounds": ctx.args.ttft_warmup, "gen_tokens": ctx.args.ttft_gen,
                                  "ttft_s": {}, "errors": [], "metrics_delta": {}, "groups": []}
    out["startup"].update(fleet.startup())
    out["groups"].append(group_record(fleet))
    out["systems"] += [s for s in systems if s not in out["systems"]]
    for s in systems:
        out["ttft_s"][s] = {str(n): [] for n in lengths}
    rng = random.Random(ctx.args.seed + (100 if fleet.eager else 0) + 1000 * fleet.group)
    V = fleet.spec.vocab

    def one(system: str, n: int) -> float | None:
        ids = [rng.randrange(len(SPECIALS), V) for _ in range(n)]
        r = complete(fleet.urls[system], ids, ctx.args.ttft_gen, stream=True, timeout_s=120, model=fleet.spec.name)
        if r.status != 200 or r.ttft_s is None:
            out["errors"].append({"system": system, "tokens": n, "status": r.status, "error": str(r.error)[:800]})
            return None
        return r.ttft_s

    if not systems:
        out["errors"].append({"error": "no system is running"})
        ctx.save(name, out)
        ctx.log(f"stage {name}: no system is running")
        return out
    watched = [s for sys_ in systems for s in fleet.pair(sys_) if sys_ != "single"]
    before = {s.name: snapshot(s.url) for s in watched}
    for _ in range(ctx.args.ttft_warmup):
        for n in lengths:
            for system in systems:
                one(system, n)
    ctx.log(f"  warm-up done ({ctx.args.ttft_warmup} rounds)")
    for rep in range(ctx.args.ttft_reps):
        if ctx.left() < 20:
            out["errors"].append({"error": f"out of time after {rep} repetitions"})
            break
        for n in lengths:
            k = rep % len(systems)
            for system in systems[k:] + systems[:k]:
                t = one(system, n)
                if t is not None:
                    out["ttft_s"][system][str(n)].append(round(t, 5))
        ctx.save(name, out)
    after = {s.name: snapshot(s.url) for s in watched}
    out["metrics_delta"].update({s.name: delta(before[s.name], after[s.name]) for s in watched})
    med: dict[str, dict[str, Any]] = {}
    for system in out["systems"]:
        for n in lengths:
            xs = out["ttft_s"][system][str(n)]
            if xs:
                med.setdefault(system, {})[str(n)] = {"median_ms": round(statistics.median(xs) * 1e3, 2),
                                                      "p10_ms": round(q(xs, 0.1) * 1e3, 2),
                                                      "p90_ms": round(q(xs, 0.9) * 1e3, 2), "n": len(xs)}
    out["summary"] = med
    out["ended"] = time.time()
    ctx.save(name, out)
    ctx.log(f"stage {name}: done: " + "; ".join(
        f"{s} " + "/".join(f"{v['median_ms']:.0f}" for v in med.get(s, {}).values()) for s in out["systems"]))
    return out


# ---- stage s-storm: a cancel storm through orbitkv.proxy ---------------------------------------------

STORM_COUNTERS = ("vllm:orbitkv_fences_sent_total", "vllm:orbitkv_ranks_fenced_total",
                  "vllm:orbitkv_consumers_quarantine_expired_total")


def stage_storm(ctx: Ctx, fleet: Fleet, name: str = "s-storm") -> dict[str, Any]:
    """``--storm-requests`` streamed requests of fresh random prompts
    (``--storm-min-tokens`` .. ``--storm-max-tokens``), ``--storm-in-flight``
    at a time, through orbitkv.proxy in front of the fleet's OrbitKV pair;
    half of them (chosen at random) dropped by the client (RST) 0 ..
    ``--storm-drop-ms`` after sending. Then: how long after the last drop
    until both instances show 0 running, 0 waiting and KV usage 0 (polled
    every 50 ms, given up after ``--storm-idle-timeout-s``), the decode's fence
    and quarantine counters' changes, errors, and whether the next plain
    request equals the single engine's answer (greedy token ids)."""
    a = ctx.args
    ctx.log(f"stage {name}: start")
    out: dict[str, Any] = {"stage": name, "started": time.time(), "eager": fleet.eager,
                           "config": {"requests": a.storm_requests, "in_flight": a.storm_in_flight,
                                      "tokens": [a.storm_min_tokens, a.storm_max_tokens], "drop_ms": a.storm_drop_ms,
                                      "gen": a.storm_gen, "idle_timeout_s": a.storm_idle_timeout_s}}
    url = fleet.urls.get("orbit")
    if not url or "orbit" not in fleet.pairs:
        out["error"] = "the OrbitKV pair or its proxy is not running: " + "; ".join(
            f"{s.name}: {(s.error or '')[:2000]}" for s in fleet.pairs.get("orbit", []) if s.error)
        ctx.save(name, out)
        ctx.log(f"stage {name}: {out['error'][:200]}")
        return out
    pre, dec = fleet.pair("orbit")
    out["servers"] = {"prefill": pre.name, "decode": dec.name, "proxy": url}
    rng = random.Random(a.seed + 777 + (100 if fleet.eager else 0))
    V = fleet.spec.vocab
    n = a.storm_requests
    dropped = set(rng.sample(range(n), n // 2))
    plan = [(i, [rng.randrange(len(SPECIALS), V) for _ in range(rng.randint(a.storm_min_tokens, a.storm_max_tokens))],
             i in dropped, rng.uniform(0, a.storm_drop_ms / 1e3)) for i in range(n)]
    lock = threading.Lock()
    last_drop = [0.0]
    before = {s.name: snapshot(s.url) for s in (pre, dec)}

    def one(item: tuple[int, list[int], bool, float]) -> dict[str, Any]:
        i, ids, drop, delay = item
        t0 = time.monotonic()
        r: dict[str, Any] = {"i": i, "tokens": len(ids)}
        if drop:
            r["drop_after_ms"] = round(delay * 1e3, 1)
            try:
                req = Abandoned(url, ids, a.storm_gen, stream=True, model=fleet.spec.name)
                time.sleep(max(0.0, delay - (time.monotonic() - req.sent)))
                req.drop()
                with lock:
                    last_drop[0] = max(last_drop[0], time.monotonic())
                r["kind"] = "dropped"
            except OSError as e:
                r["kind"] = "error"
                r["error"] = f"{type(e).__name__}: {e}"
        else:
            c = complete(url, ids, a.storm_gen, stream=True, timeout_s=a.storm_request_timeout_s, model=fleet.spec.name)
            ok = c.status == 200 and len(c.token_ids) == a.storm_gen
            r["kind"] = "answered" if ok else "failed"
            r["status"] = c.status
            if not ok:
                r["error"] = str(c.error)[:500]
                r["got_tokens"] = len(c.token_ids)
        r["s"] = round(time.monotonic() - t0, 3)
        return r

    t_start = time.monotonic()
    with cf.ThreadPoolExecutor(a.storm_in_flight) as ex:
        results = list(ex.map(one, plan))
    t_end = time.monotonic()
    out["requests"] = results
    kinds = [r["kind"] for r in results]
    out["counts"] = {k: kinds.count(k) for k in sorted(set(kinds))}
    out["storm_s"] = round(t_end - t_start, 2)
    out["errors"] = [r for r in results if r["kind"] in ("error", "failed")]
    ctx.log(f"  storm: {out['counts']} in {out['storm_s']}s; waiting for both instances to be idle")
    # idle: 0 running, 0 waiting, KV usage 0 on both, polled every 50 ms
    t_last = last_drop[0] or t_end
    deadline = time.monotonic() + a.storm_idle_timeout_s
    last: dict[str, dict[str, float]] = {}
    first_idle: dict[str, float] = {}
    t_idle = None
    while time.monotonic() < deadline:
        ok = True
        for s in (pre, dec):
            try:
                m = metrics(s.url, timeout_s=2)
            except Exception as e:  # noqa: BLE001
                last[s.name] = {"error": str(e)}  # type: ignore[dict-item]
                ok = False
                continue
            last[s.name] = {k: m.get(k, -1) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                      "vllm:kv_cache_usage_perc")}
            this = all(v == 0 for v in last[s.name].values())
            if this:
                first_idle.setdefault(s.name, round(time.monotonic() - t_last, 3))
            ok = ok and this
        if ok:
            t_idle = time.monotonic()
            break
        time.sleep(0.05)
    out["idle"] = t_idle is not None
    out["idle_after_last_drop_s"] = None if t_idle is None else round(t_idle - t_last, 3)
    out["idle_after_storm_end_s"] = None if t_idle is None else round(t_idle - t_end, 3)
    out["last_drop_before_storm_end_s"] = round(t_end - t_last, 3)
    out["state_at_end_of_wait"] = last
    out["first_idle_after_last_drop_s"] = first_idle  # per instance (it may get busy again)
    after = {s.name: snapshot(s.url) for s in (pre, dec)}
    out["metrics_delta"] = {s.name: delta(before[s.name], after[s.name]) for s in (pre, dec)}
    dd = out["metrics_delta"][dec.name]
    out["decode_counters"] = {k.removeprefix("vllm:orbitkv_"): dd.get(k) for k in STORM_COUNTERS}
    out["servers_alive"] = {s.name: bool(s.proc and s.proc.alive()) for s in (pre, dec)}
    ctx.log(f"  idle: {out['idle']} ({out['idle_after_last_drop_s']}s after the last drop); "
            f"decode counters {out['decode_counters']}")
    # the next plain request, against one engine
    ids = [rng.randrange(len(SPECIALS), V) for _ in range(a.storm_min_tokens)]
    got = ask(url, ids, a.gen, fleet.spec.name)
    nxt: dict[str, Any] = {"prompt_tokens": len(ids), "status": got.status, "tokens": len(got.ids)}
    if got.status != 200:
        nxt["error"] = str(got.error)[:800]
    if fleet.single is not None and fleet.single.ready_s:
        ref = ask(fleet.single.url, ids, a.gen, fleet.spec.name)
        tol = a.tol_fp32 if (fleet.spec.dtype == "float32" or not ctx.cuda) else a.tol_bf16
        nxt.update(compare(ref, got, tol))
        nxt["equal_token_ids"] = ref.status == 200 and ref.ids == got.ids
    else:
        nxt["verdict"] = "no single engine to compare with" if got.status == 200 else "error"
    out["next_request"] = nxt
    ctx.log(f"  next plain request: {nxt.get('verdict')}")
    out["pass"] = bool(out["idle"] and not out["errors"] and got.status == 200
                       and nxt.get("verdict") in ("equal", "near-tie", "no single engine to compare with")
                       and all(out["servers_alive"].values()))
    out["ended"] = time.time()
    ctx.save(name, out)
    ctx.log(f"stage {name}: done, pass {out['pass']}")
    return out


# ---- the run ----------------------------------------------------------------------------------------


def environment(ctx: Ctx) -> dict[str, Any]:
    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                           "python": sys.version.split()[0], "device": ctx.args.device, "args": vars(ctx.args)}
    for mod in ("torch", "vllm", "orbitkv", "transformers", "nixl", "vllm_router"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?") + " " + os.path.dirname(m.__file__ or "")
        except Exception as e:  # noqa: BLE001
            env[mod] = f"not importable: {type(e).__name__}: {e}"
    with contextlib.suppress(Exception):
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["gpus"] = torch.cuda.device_count()  # (no CUDA context in the driver)
    env["env"] = {k: v for k, v in os.environ.items()
                  if k.startswith(("ORBITKV_", "MC_", "VLLM_", "NCCL_", "CUDA_", "LD_LIBRARY", "PYTHONPATH", "UCX_"))}
    return env


def run(ctx: Ctx) -> int:
    a = ctx.args
    stages = a.stages.split(",")
    ctx.log(f"driver: device={a.device} stages={stages} deadline={a.deadline_s}s out={ctx.out}")
    ctx.save("environment", environment(ctx))
    # the new stages first (a run that names them is about them): block sizes, MLA, then fp8 KV
    try:
        cell_stages = [(st, fn) for st, fn in (("k-blocks", stage_blocks), ("m-mla", stage_mla), ("f-fp8", stage_fp8))
                       if st in stages]
        if a.cell_stages_together and len(cell_stages) > 1:
            # every instance of these stages starts at once (one warm-up on a fresh machine)
            with cf.ThreadPoolExecutor(len(cell_stages)) as ex:
                futs = [ex.submit(fn, ctx) for _, fn in cell_stages]
                for f in futs:
                    f.result()
        else:
            for st, fn in cell_stages:
                if st == "k-blocks" or st == "m-mla" or ctx.left() > 150:
                    fn(ctx)
    except BaseException as e:
        ctx.log(f"driver: ERROR {type(e).__name__}: {e}")
        ctx.save("driver-error", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        with contextlib.suppress(Exception):
            report(ctx.out)
        raise
    if not any(s in stages for s in ("a-default", "a-eager", "s-storm", "b-default", "c-default", "c-eager",
                                     "b-eager")):
        with contextlib.suppress(Exception):
            report(ctx.out)
        ctx.log(f"driver: done in {time.monotonic() - T0:.0f}s")
        return 0
    t = time.monotonic()
    models: dict[str, tuple[ModelSpec, str]] = {}
    for dt in (["float32", "bfloat16"] if ctx.cuda else ["float32"]):
        spec = small_spec(ctx, dt)
        models["fp32" if dt == "float32" else "bf16"] = (spec, make_model(spec, ctx.work / "models"))
    bspec = big_spec(ctx)
    bpath = make_model(bspec, ctx.work / "models")
    ctx.log(f"models made in {time.monotonic() - t:.1f}s: {[m[1] for m in models.values()]} {bpath}")

    plan = plan_big(ctx, bspec)
    ctx.plan = plan
    ctx.save("plan", plan)
    groups = plan["groups"]
    ctx.log(f"Llama-3-8B-shaped instances: {plan['kv_gib']} GiB of KV each ({plan['kv_tokens_per_instance']} tokens), "
            f"groups run one after another: {groups}" + (f"; {plan['warning']}" if plan.get("warning") else "")
            + (f"; {plan['kv_bound_levels']}" if plan.get("kv_bound_levels") else ""))

    fleet: Fleet | None = None  # the group being measured (stopped on the way out)
    fleet_state: dict[str, Any] = {}
    default_big = [s for s in ("s-storm", "b-default", "c-default") if s in stages]

    def start_big(failed_small: dict[str, str]) -> None:
        """Called once the small default-mode instances are up (or failed):
        start the first group of Llama-3-8B-shaped instances meanwhile. If
        OrbitKV could not start under vLLM's defaults, its big pair gets
        VLLM_KV_CACHE_LAYOUT=HND (labelled so), so load and TTFT are still measured."""
        nonlocal fleet
        if not default_big or fleet is not None:
            return
        orbit_failed = [k for k in failed_small if "prefill" in k or "decode" in k]
        orbit_env = {}
        if orbit_failed and a.hnd_fallback:
            orbit_env = {"VLLM_KV_CACHE_LAYOUT": "HND"}
            ctx.log(f"OrbitKV instances failed under defaults ({orbit_failed}): big OrbitKV pair gets HND by hand")
        fleet_state["orbit_env"] = orbit_env
        fleet = Fleet(ctx, bspec, bpath, eager=False, orbit_env=orbit_env, systems=groups[0], kv_gib=plan["kv_gib"])
        fleet.start()

    def run_groups(eager: bool) -> None:
        """Each group of systems in turn: its instances started (the first
        group's default-mode ones already are), the stages, stopped."""
        nonlocal fleet
        bname, cname = ("b-eager", "c-eager") if eager else ("b-default", "c-default")
        order = [x for x in ((cname, bname) if eager else ("s-storm", bname, cname)) if x in stages]
        acc: dict[str, dict[str, Any] | None] = {bname: None, cname: None}
        for gi, grp in enumerate(groups):
            if gi and ctx.left() < 240:
                ctx.log(f"group {gi + 1} {grp}: skipped, out of time")
                break
            if fleet is None:
                fleet = Fleet(ctx, bspec, bpath, eager=eager, orbit_env=fleet_state.get("orbit_env", {}),
                              systems=grp, kv_gib=plan["kv_gib"], group=gi)
                fleet.start()
            try:
                failed = fleet.wait(max(60, min(a.start_timeout_s, ctx.left() - 60)))
                if failed:
                    ctx.log(f"big instances failed: {list(failed)}")
                for st in order:
                    if st == "s-storm":
                        if gi == 0 and ctx.left() > 90:
                            stage_storm(ctx, fleet, "s-storm")
                    elif st == bname and ctx.left() > 120:
                        acc[st] = stage_b(ctx, fleet, st, acc[st])
                    elif st == cname and ctx.left() > (60 if eager else 90):
                        acc[st] = stage_c(ctx, fleet, st, acc[st])
            finally:
                fleet.stop()
                fleet = None

    try:
        if "a-default" in stages:
            stage_a(ctx, models, eager=False, on_ready=start_big)
        else:
            start_big({})
        if "a-eager" in stages and ctx.left() > 120:
            stage_a(ctx, models, eager=True, on_ready=None)
        if fleet is not None:
            run_groups(eager=False)
        if any(s in stages for s in ("c-eager", "b-eager")) and ctx.left() > 150:
            run_groups(eager=True)
    except BaseException as e:
        ctx.log(f"driver: ERROR {type(e).__name__}: {e}")
        ctx.save("driver-error", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        raise
    finally:
        if fleet is not None:
            fleet.stop()
        with contextlib.suppress(Exception):
            report(ctx.out)
        ctx.log(f"driver: done in {time.monotonic() - T0:.0f}s")
    return 0


# ---- the report --------------------------------------------------------------------------------------


def _load(d: Path, name: str) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((d / f"{name}.json").read_text())
    return None


# The ratio tables of stage b: (numerator system, denominator system, their
# labels, the sentence under which the table goes).
RATIOS = (
    ("orbit", "mc", "OrbitKV", "MooncakeConnector", "OrbitKV ÷ MooncakeConnector"),
    ("orbit", "nixl", "OrbitKV", "NIXL", "OrbitKV ÷ NIXL"),
    ("orbit-router", "orbit", "via vllm-router", "via orbitkv.proxy",
     "OrbitKV through vllm-router ÷ through orbitkv.proxy (the same instances; vllm-router's two-stage flow)"),
    ("orbit-router-mc", "orbit", "via vllm-router (mooncake)", "via orbitkv.proxy",
     "OrbitKV through vllm-router's mooncake mode ÷ through orbitkv.proxy (the same instances)"),
    ("orbit-router-mc", "mc", "OrbitKV via vllm-router (mooncake)", "MooncakeConnector",
     "OrbitKV through vllm-router's mooncake mode ÷ MooncakeConnector (both transfer after the prefill)"),
    *(row for system, (short, base, what) in {
        "orbit-staging": ("staging", "direct", "with staging (--ab-staging-*)"),
        "orbit-one-lane": ("one writer", "4 writers", "with one writer per peer"),
        "orbit-lanes-16": ("16 writers", "4 writers", "with 16 writers per peer"),
        "orbit-wide-ranges": ("8192 ranges", "defaults", "with 8192 ranges in flight per peer"),
        "orbit-narrow-ranges": ("768 ranges", "defaults", "with 768 ranges in flight per peer"),
        "orbit-custom": ("--ab-config", "defaults", "with --ab-config (see plan.json)"),
    }.items() for row in (
        (system, "mc", f"OrbitKV, {short}", "MooncakeConnector", f"OrbitKV {what} ÷ MooncakeConnector"),
        (system, "orbit", short, base, f"OrbitKV {what} ÷ {base} (the A/B pair)"))),
    ("orbit-control", "orbit", "second pair", "first pair", "OrbitKV, an identical second pair ÷ the first (A/A control)"),
)


def ratio_rows(r: dict[str, Any]) -> list[str]:
    """Per in-flight level, OrbitKV ÷ MooncakeConnector (and ÷ NIXL), and
    OrbitKV through vllm-router ÷ through orbitkv.proxy: TTFT p50 and p99
    (below 1: the first faster) and output tok/s (above 1: the first more),
    with each system's prefill KV usage peak."""
    systems = r.get("systems", {})
    out: list[str] = []
    # --ab-more's pairs (orbit-NAME, settings in plan.json's ab_more)
    more = [(x, base, f"OrbitKV, {x[6:]}", lab, f"OrbitKV with {x[6:]} (plan.json's ab_more) ÷ {what}")
            for x in systems if x.startswith("orbit-") and ab_more_name(x[6:])
            for base, lab, what in (("mc", "MooncakeConnector", "MooncakeConnector"),
                                    ("orbit", "defaults", "defaults (the A/B pair)"))]
    for num, den, num_label, den_label, title in (*RATIOS, *more):
        if "runs" not in systems.get(num, {}) or "runs" not in systems.get(den, {}):
            continue
        rows = []
        for tag, o in systems[num]["runs"].items():
            p = systems[den]["runs"].get(tag)
            if tag.startswith("warm") or not p:
                continue
            rat = lambda k, o=o, p=p: (f"{o[k] / p[k]:.2f}" if isinstance(o.get(k), (int, float))  # noqa: E731
                                       and isinstance(p.get(k), (int, float)) and p[k] else "-")
            peak = lambda x: next((peak_cell(v)  # noqa: E731
                                   for k, v in x.get("servers", {}).items() if "prefill" in k), "-")
            rows.append(f"| {level(o)} | {rat('p50_ttft_ms')} | {rat('p99_ttft_ms')} | "
                        f"{rat('output_throughput')} | {peak(o)} | {peak(p)} | {whole_cache_ratio(o, p)} |")
        if rows:
            out += [f"{title}, same prompts (TTFT below 1 and tok/s above 1: {num_label} ahead):", "",
                    f"| in flight | TTFT p50 | TTFT p99 | output tok/s | {num_label} prefill KV peak | "
                    f"{den_label} prefill KV peak | KV peak over the whole cache, ratio: request pages / "
                    "with the taken blocks |",
                    "|---|---|---|---|---|---|---|"] + rows + [""]
    return out


def _gaps(details: list[dict[str, Any]]) -> str:
    """The reference's log-probability gap between the two chosen tokens at
    each difference (chosen_gap), else its top-2 gap."""
    out = []
    for x in details:
        g = x.get("chosen_gap", x.get("ref_top2_gap"))
        out.append(f"{g:.3f}" if isinstance(g, (int, float)) else "?")
    return ", ".join(out) or "-"


def cell_report(st: str, r: dict[str, Any]) -> list[str]:
    """The m-mla / f-fp8 tables: per cell and pair, the cases, the prompts
    sent at once against both references, the gaps at the differences, the
    KV counted and compared, idle, pass; then what vLLM's selector offers."""
    what = {"m-mla": "MLA (DeepSeek-V2-Lite shape)", "f-fp8": "fp8 KV cache (small bf16 Llama)",
            "k-blocks": "prefill and decode of different block sizes (cell: prefill backend/block to decode's; "
                        "the one engine runs decode's)"}.get(st, st)
    n = r.get("concurrent", 24)
    lines = [f"## {st}: {what}, OrbitKV P/D vs one engine of the same backend and KV dtype"
             + (" (eager)" if r.get("eager") else ""), "",
             f"Model: {r.get('model', {}).get('name')}; {r.get('kv_gib')} GiB of KV per instance; tolerance "
             f"{r.get('tolerance_nats')} nats; {n} prompts at once compared with the engine's one-by-one answers "
             "(ref 1) and with its own answers to the same prompts at once (ref n). Gaps: at each difference, "
             "the reference's log-probability of its token minus that of the P/D token.", "",
             "| cell | backend used | mode | cases equal / near-tie / mismatch / error | at once vs ref 1 | "
             "at once vs ref n | engine at once vs ref 1 | gaps at differences (vs ref 1; vs ref n) | "
             "transfers / P/D requests / failed | staging grants | KV slots (idle): prefill written / not on decode | "
             "KV at release: requests / tokens compared / tokens differing | idle after | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cnt = lambda v: "/".join(str(v.count(x)) for x in ("equal", "near-tie", "mismatch")) if v else "-"  # noqa: E731
    for key, c in r.get("cells", {}).items():
        used = sorted({v for v in c.get("backend_used", {}).values() if v})
        used_s = ", ".join(used) or "-"
        if c.get("refused") and not c.get("pairs"):
            lines.append(f"| {key} | {used_s} | | refused: {c['refused']} | | | | | | | | | | **no** |")
        for mode, m in c.get("pairs", {}).items():
            if "counts" not in m:
                why = ("did not start: " + "; ".join(f"{k.rsplit('-', 1)[-1]}: {v}" for k, v in m["why"].items())
                       if m.get("why") else str(m.get("error", ""))[:300].replace("\n", " "))
                lines.append(f"| {key} | {used_s} | {mode} | {why.replace('|', '/')} | | | | | | | | | | **no** |")
                continue
            k = m["counts"]
            cc = next((x for x in m["cases"] if "verdicts" in x), {})
            diffs = [dict(x, case=x["case"]) for x in m["cases"] if x.get("verdict") not in ("equal", None)
                     and "verdicts" not in x]
            gaps = _gaps(diffs + cc.get("details", []))
            gaps_n = _gaps(m.get("pd_concurrent_vs_single_concurrent_details", []))
            kvb = m.get("kv_bytes") or {}
            kv_s = (f"{kvb.get('prefill_slots_written')} / {kvb.get('prefill_slots_missing_on_decode')} "
                    f"({kvb.get('missing_elsewhere')} not a block's last, {kvb.get('blocks_with_missing')} blocks)"
                    + ("" if kvb.get("ok") else (" **not equal**" if kvb.get("ok") is False else " (not compared)"))
                    if kvb else "-")
            rel = m.get("kv_release") or {}
            rel_s = (f"{rel.get('requests_compared')} / {rel.get('tokens_compared')} / {rel.get('tokens_mismatched')}"
                     + ("" if rel.get("ok") else " **not equal**") if rel else "-")
            idle_ok = all(v.get("idle") for v in m.get("idle_after", {}).values())
            lines.append(
                f"| {key} | {used_s} | {mode} | {k.get('equal', 0)} / {k.get('near-tie', 0)} / {k.get('mismatch', 0)} / "
                f"{k.get('error', 0) + k.get('reference error', 0)} | {cnt(cc.get('verdicts'))} | "
                f"{cnt(m.get('pd_concurrent_vs_single_concurrent'))} | "
                f"{cnt(m.get('control_single_concurrent_vs_sequential'))} | {gaps}; {gaps_n} | "
                f"{m.get('transfers_completed')} / {m.get('pd_requests')} / {m.get('transfers_failed')} | "
                f"{m.get('staging_granted')} | {kv_s} | {rel_s} | {'yes' if idle_ok else '**NO**'} | "
                f"{'yes' if m.get('pass') else '**no**'} |")
    lines += ["", "(at once: equal/near-tie/mismatch counts of the prompts sent at once. KV slots (idle): "
              "digests of every slot once both instances are idle (kv_digest.py); KV at release: per request, "
              "decode's tokens as loaded against prefill's as released (ORBITKV_TESTING_KV_DIGEST). Pass: no token "
              "differing in that byte check (else the idle-time one) where present, AND every answer equal or a "
              "near-tie, every P/D request transferred, none failed, both instances idle after: a mismatch "
              "fails the cell even when the KV is byte-exact.)", ""]
    pr = r.get("backend_probe") or {}
    if pr:
        lines += [f"vLLM's attention selector on this GPU ({pr.get('capability', '?')}): valid backends in priority "
                  "order (the first is vLLM's pick), and why others are not.", "",
                  "| model kind : KV dtype | valid | not valid (reasons) |", "|---|---|---|"]
        if pr.get("error"):
            lines.append(f"| probe failed | {str(pr['error'])[:300]} | |")
        for k, v in pr.items():
            if not isinstance(v, dict):
                continue
            inv = "; ".join(f"{b}: {', '.join(rs)[:120]}" for b, rs in v.get("invalid", {}).items())
            lines.append(f"| {k} | {', '.join(v.get('valid', [])) or v.get('error', '-')} | {inv.replace('|', '/')} |")
        lines.append("")
    return lines


def report(d: Path) -> str:
    """summary.md from the stage files in ``d``."""
    d = Path(d)
    lines: list[str] = ["# OrbitKV GPU end-to-end run: summary", ""]
    env = _load(d, "environment")
    if env:
        lines += [f"- date: {env.get('date')}; host: {env.get('host')}; GPUs: {env.get('gpus')}",
                  f"- torch {env.get('torch')}; vllm {env.get('vllm')}; orbitkv {env.get('orbitkv')}; "
                  f"nixl {env.get('nixl')}", ""]
    plan = _load(d, "plan")
    if plan:
        lines += [f"- Llama-3-8B-shaped instances ({'one GPU' if plan.get('one_gpu') else 'two GPUs'}): "
                  f"{plan.get('kv_gib')} GiB of KV each ({plan.get('kv_tokens_per_instance')} tokens), weights "
                  f"{plan.get('weights_gib')} GiB; systems in groups run one after another: {plan.get('groups')}"
                  + (f"; {plan['warning']}" if plan.get("warning") else "")
                  + (f"; {plan['kv_bound_levels']}" if plan.get("kv_bound_levels") else ""), ""]
    r = _load(d, "s-storm")
    if r:
        c = r.get("config", {})
        lines += [f"## s-storm: cancel storm through orbitkv.proxy ({c.get('requests')} streamed requests of "
                  f"{c.get('tokens')} fresh tokens, {c.get('in_flight')} in flight, half dropped (RST) 0-"
                  f"{c.get('drop_ms')} ms after sending)", ""]
        if r.get("error"):
            lines += [f"error: {str(r['error'])[:500]}", ""]
        else:
            nx = r.get("next_request", {})
            lines += ["| requests | both idle after the last drop | decode fences sent / ranks fenced / "
                      "quarantines expired | errors | next request vs one engine | pass |", "|---|---|---|---|---|---|",
                      f"| {r.get('counts')} | {'yes' if r.get('idle') else '**NO**'}, "
                      f"{r.get('idle_after_last_drop_s')} s | "
                      + " / ".join(str(v) for v in r.get("decode_counters", {}).values())
                      + f" | {len(r.get('errors', []))} | {nx.get('verdict')} | "
                      f"{'yes' if r.get('pass') else '**no**'} |", ""]
            if not r.get("idle"):
                lines += [f"State when the wait gave up: {json.dumps(r.get('state_at_end_of_wait'))}", ""]
    for st in ("a-default", "a-eager"):
        r = _load(d, st)
        if not r:
            continue
        lines += [f"## {st}: correctness, OrbitKV P/D vs one engine", ""]
        lines += ["| model | started | cases (equal / near-tie / mismatch / error) | decode prefix hit | "
                  "transfers completed / failed | bytes written | idle after | pass |", "|---|---|---|---|---|---|---|---|"]
        for key, m in r.get("models", {}).items():
            if "counts" not in m:
                lines.append(f"| {key} | {'no' if 'did not start' in str(m.get('error')) else 'yes'} | "
                             f"{str(m.get('error', ''))[:300].replace(chr(10), ' ')} | | | | | **no** |")
                continue
            c = m["counts"]
            hit = next((x.get("decode_prefix_cache_hit_tokens") for x in m["cases"]
                        if "decode_prefix_cache_hit_tokens" in x), None)
            idle_ok = all(v.get("idle") for v in m.get("idle_after", {}).values())
            late = f", {m['layers_saved_at_wait']:.0f} layers sent at wait_for_save" if "layers_saved_at_wait" in m else ""
            if m.get("staging_granted"):
                late += f", staged: {m['staging_granted']:.0f} grants, {m.get('layers_staged') or 0:.0f} layers"
            lines.append(
                f"| {key} ({m['model']['dtype']}{late}) | yes | {c.get('equal', 0)} / {c.get('near-tie', 0)} / "
                f"{c.get('mismatch', 0)} / {c.get('error', 0) + c.get('reference error', 0)} | {hit} tokens | "
                f"{m.get('transfers_completed')} of {m.get('pd_requests')} / {m.get('transfers_failed')} | "
                f"{m.get('bytes_written')} | "
                f"{'yes' if idle_ok else 'NO'} | {'yes' if m.get('pass') else '**no**'} |")
        ctrl = {k: m["control_single_concurrent_vs_sequential"] for k, m in r.get("models", {}).items()
                if m.get("control_single_concurrent_vs_sequential")}
        if ctrl:
            lines.append("")
            lines.append("Control, the single engine's own 16 concurrent answers against its one-by-one answers: " + "; ".join(
                f"{k}: " + ", ".join(f"{v.count(x)} {x}" for x in sorted(set(v))) for k, v in ctrl.items()))
        lines.append("")
    for st in ("k-blocks", "m-mla", "f-fp8"):
        r = _load(d, st)
        if r:
            lines += cell_report(st, r)
    for st in ("b-default", "b-eager"):
        r = _load(d, st)
        if not r:
            continue
        lines += [f"## {st}: vllm bench serve ({r['config']['input_len']} ± {r['config']['input_range']:.0%} "
                  f"input tokens, {r['config']['output_len']} output)", "",
                  "| system | in flight | done/failed | TTFT p50 / p99 ms | ITL mean / p99 ms | TPOT mean ms | "
                  "output tok/s | prefill KV peak | decode waiting peak |", "|---|---|---|---|---|---|---|---|---|"]
        for system, sr in r.get("systems", {}).items():
            if "runs" not in sr:
                lines.append(f"| {system} | | {str(sr.get('error'))[:200].replace(chr(10), ' ')} | | | | | | |")
                continue
            for tag, x in sr["runs"].items():
                if tag.startswith("warm"):
                    continue
                srv = x.get("servers", {})
                pre = next((v for k, v in srv.items() if "prefill" in k or k.endswith("single")), {})
                dec = next((v for k, v in srv.items() if "decode" in k or k.endswith("single")), {})
                f = lambda k, x=x: f"{x[k]:.1f}" if isinstance(x.get(k), (int, float)) else "-"  # noqa: E731
                lines.append(
                    f"| {system} | {level(x)} | {x.get('completed', '-')}/{x.get('failed', '-')} | "
                    f"{f('p50_ttft_ms')} / {f('p99_ttft_ms')} | {f('mean_itl_ms')} / {f('p99_itl_ms')} | "
                    f"{f('mean_tpot_ms')} | {f('output_throughput')} | "
                    f"{peak_cell(pre)} | {dec.get('waiting_peak', '-')} |")
        lines.append("")
        lines += ratio_rows(r)
        # where the time goes: the proxies' per-request lines, OrbitKV's
        # phase histograms, OrbitKV's counters
        rows = level_rows(r, "orbit_phases", phase_cells)
        if rows:
            lines += ["OrbitKV's phase histograms per level (ms, p50 / p90 from the buckets, (requests)): prefill: "
                      "vLLM finished the request → decode's handshake reached it (0: before), → its last layer "
                      "seen computed by its writer lane (the GPU's lag; 0: before), → its last write's "
                      "first batch went out (0: before), → its last write ended and its notice went out; → vLLM's "
                      "scheduler told the worker it ended the request (vLLM's own pipeline), → the worker reported "
                      "it sent (vLLM frees its blocks with that step); → its pages back to vLLM (the runtime's side); "
                      "decode: KV complete → taken by vLLM's worker. '-': a wheel without that "
                      "histogram.", "",
                      "| system | in flight | handshake after finish | last layer computed after finish | last write "
                      "sent after finish | written after finish | vLLM ended after finish | reported sent after "
                      "finish | pages held after finish | complete → taken |",
                      "|---|---|---|---|---|---|---|---|---|---|"] + rows + [""]
        rows = level_rows(r, "proxy_breakdown", proxy_cells)
        if rows:
            lines += ["Proxy view per request (ms after the proxy took it, p50 / p90): when the prefill "
                      "answered, when decode's first byte came, and the gap between them.", "",
                      "| system | in flight | requests | prefill answered | first byte | first byte − prefill |",
                      "|---|---|---|---|---|---|"] + rows + [""]
        rows = []
        for system, sr in r.get("systems", {}).items():
            md = sr.get("metrics_delta", {})
            pre = next((v for k, v in md.items() if "prefill" in k), None)
            dec = next((v for k, v in md.items() if "decode" in k), None)
            if not pre or not system.startswith("orbit"):
                continue
            c = lambda m, k: m.get(f"vllm:orbitkv_{k}_total", m.get(f"vllm:orbitkv_{k}", 0.0))  # noqa: E731
            per = lambda a, b: (f"{1e3 * a / b:.2f}" if b else "-")  # noqa: E731
            items, batches, lw = c(pre, "ready_layers"), c(pre, "write_batches"), c(pre, "layer_writes")
            ranges, nbytes = c(pre, "write_ranges"), c(pre, "bytes_written")
            done = c(dec or {}, "transfers_completed")
            grouped = c(pre, "writes_grouped")
            # (counters a wheel before these metrics lacks: "-")
            has = lambda k, m=pre: f"vllm:orbitkv_{k}_total" in m or f"vllm:orbitkv_{k}" in m  # noqa: E731
            stops = (f"{c(pre, 'group_stops_budget'):.0f} / {c(pre, 'group_stops_gpu'):.0f} / "
                     + (f"{c(pre, 'writes_ahead_of_gpu'):.0f}" if has("writes_ahead_of_gpu") else "-")
                     if has("group_stops_gpu") else "-")
            queued = per(c(pre, "write_queue_seconds"), lw) if has("write_queue_seconds") else "-"
            on_gpu = f"{c(pre, 'write_gpu_wait_seconds'):.1f}" if has("write_gpu_wait_seconds") else "-"
            # Mooncake's submit call per range: the cost that bounds the writer
            # under load (runs 37-38 of docs/qualification.md), and staging's
            # share: layers written from source staging, decode's grants, and
            # the requests that found decode's staging region full.
            per_range = f"{1e6 * c(pre, 'write_submit_seconds') / ranges:.1f}" if ranges else "-"
            staging = (f"{c(pre, 'layers_staged'):.0f} / {c(dec or {}, 'staging_granted'):.0f} / "
                       f"{c(dec or {}, 'staging_exhausted'):.0f}" if has("layers_staged") else "-")
            # the layer pieces' reach: layers of a chunk that found no room in
            # the source region, pieces given up unread by a request that
            # missed (orbitkv.pd.staging_pieces "request"), and requests whose
            # pages went back to vLLM before their writes (37f6a3b)
            given_up = f"{c(pre, 'source_pieces_given_up'):.0f}" if has("source_pieces_given_up") else "-"
            pieces = (f"{c(pre, 'source_staging_full'):.0f} / {given_up} / "
                      f"{c(pre, 'producer_pages_given_back'):.0f}" if has("producer_pages_given_back") else "-")
            # the writer's gather (staging_pieces "write"): writes gathered,
            # those that found no room, and the mean copy a gathered write
            gathered = c(pre, "writes_gathered")
            gather = (f"{gathered:.0f} / {c(pre, 'gather_no_room'):.0f} / {per(c(pre, 'gather_seconds'), gathered)}"
                      if has("writes_gathered") else "-")
            rows.append(f"| {system} | {items:.0f} | {per(c(pre, 'ready_lag_seconds'), items)} | {batches:.0f} | "
                        f"{grouped:.0f} | {stops} | "
                        f"{(ranges / batches if batches else 0):.0f} | {(nbytes / ranges / 1024 if ranges else 0):.0f} | "
                        f"{per(c(pre, 'write_submit_seconds'), batches)} | {per_range} | "
                        f"{per(c(pre, 'write_batch_seconds'), batches)} | "
                        f"{lw:.0f} | {per(c(pre, 'layer_write_seconds'), lw)} | {queued} | {on_gpu} | {staging} | "
                        f"{pieces} | {gather} | {done:.0f} | {per(c(dec or {}, 'transfer_seconds'), done)} |")
        if rows:
            lines += ["OrbitKV's counters over the whole system run (mean ms): a step's layer launched → admitted "
                      "(GPU lag + gate), Mooncake submit call, batch submitted → ended, layer write admitted → "
                      "written and the part of it queued before its first batch, decode's authorization → KV "
                      "complete; group commits ended by the lane's budget / that passed over a layer the GPU had not "
                      "written / writes sent ahead of one waiting for the GPU; "
                      "the submit call per range in µs; seconds the writer lanes spent parked on the GPU with "
                      "nothing else to send, all lanes together; staging: layers written from source staging / decode's grants / requests "
                      "that found decode's staging full; pieces: layers of a chunk that found no room in the source "
                      "region / pieces given back unread by a request a layer of which found none (staging_pieces "
                      "'request') / requests whose pages went back to vLLM before their writes; gather (staging_pieces "
                      "'write'): layer writes a lane gathered / that found no room / mean ms a gathered write's copy.", "",
                      "| system | layers admitted | launched → admitted | batches | writes grouped | stops: budget / GPU / ahead "
                      "| ranges per batch | KiB per range | submit call | submit per range, µs | batch | layer writes | "
                      "layer write | queued | lanes on GPU, s | staging: layers / grants / full | "
                      "pieces: no room / given up / pages back | gather: writes / no room / ms | transfers | "
                      "authorized → complete |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"] + rows + [""]
        rows = []
        for system, sr in r.get("systems", {}).items():
            kr = sr.get("kv_release")
            if kr:
                back = kr.get("pages_given_back")
                rows.append(f"| {system} | {kr.get('requests_compared', 0)} of {kr.get('requests', 0)} | "
                            f"{kr.get('tokens_compared', 0)} | {kr.get('tokens_mismatched', 0)} | "
                            f"{kr.get('requests_mismatched', 0)} | {'-' if back is None else f'{back:.0f}'} | "
                            f"{'yes' if kr.get('ok') else '**no**'} |")
        if rows:
            lines += ["KV under load (--load-kv-digest): per request, decode's KV as loaded against prefill's as "
                      "released or given back early, token for token over all layers (the digests slow both "
                      "instances: not a timing run).", "",
                      "| system | requests compared | tokens compared | tokens differing | requests differing | "
                      "pages given back early | equal |", "|---|---|---|---|---|---|---|"] + rows + [""]
        rows = []
        for system, sr in r.get("systems", {}).items():
            mt = sr.get("mc_transfer_metrics")
            if mt:
                rows.append(f"| {system} | {mt['transfers']} | {mt['descriptors_per_transfer']:.0f} | "
                            f"{mt['kb_per_descriptor'] or '-'} | {mt['mb_per_transfer']:.0f} | {mt['ms_per_transfer']:.1f} |")
        if rows:
            lines += ["MooncakeConnector's own transfer metrics over the whole system run (its prefill's log; a "
                      "transfer is one Mooncake batch holding every layer of a request; means weighted by transfers).",
                      "", "| system | transfers | descriptors per transfer | KB per descriptor | MB per transfer | "
                      "ms per transfer |", "|---|---|---|---|---|---|"] + rows + [""]
    for st in ("c-default", "c-eager"):
        r = _load(d, st)
        if not r or "summary" not in r:
            continue
        s = r["summary"]
        others = [x for x in r.get("systems", ["single", "orbit", "nixl"]) if x != "single"]
        names = {"orbit": "OrbitKV P/D", "orbit-python-gate": "OrbitKV P/D, Python gate", "orbit-py": "OrbitKV P/D, Python gate",
                 "orbit-one-lane": "OrbitKV P/D, one writer per peer",
                 "orbit-lanes-16": "OrbitKV P/D, 16 writers per peer",
                 "orbit-device-wait": "OrbitKV P/D, Mooncake's submit wait",
                 "orbit-wide-ranges": "OrbitKV P/D, 8192 ranges in flight",
                 "orbit-narrow-ranges": "OrbitKV P/D, 768 ranges in flight",
                 "orbit-staging": "OrbitKV P/D with staging", "orbit-control": "OrbitKV P/D, second pair (A/A)",
                 "orbit-custom": "OrbitKV P/D with --ab-config",
                 "nixl": "NIXL P/D",
                 "mc": "MooncakeConnector P/D", "orbit-router": "OrbitKV P/D via vllm-router",
                 "orbit-router-mc": "OrbitKV P/D via vllm-router (mooncake mode)"}
        peers = [x for x in ("mc", "nixl") if x in others and "orbit" in others]
        router = "orbit-router" in others and "orbit" in others
        lines += [f"## {st}: TTFT, medians of {r['reps']} (fresh prompt per request), ms", "",
                  "| prompt tokens | one engine | " + " | ".join(names.get(x, x) for x in others) + " | "
                  + " | ".join(f"{names.get(x, x)} ÷ one" for x in others)
                  + "".join(f" | OrbitKV ÷ {names.get(x, x)}" for x in peers)
                  + (" | OrbitKV via vllm-router ÷ via orbitkv.proxy" if router else "") + " |",
                  "|---|---|" + "---|" * (2 * len(others) + len(peers) + router)]
        for n in r["lengths"]:
            g = lambda sysn, n=n, s=s: s.get(sysn, {}).get(str(n), {}).get("median_ms")  # noqa: E731
            one = g("single")
            rat = lambda v, one=one: f"{v / one:.2f}" if (v and one) else "-"  # noqa: E731
            vs = lambda x, g=g: (f"{g('orbit') / g(x):.2f}" if (g("orbit") and g(x)) else "-")  # noqa: E731
            via = lambda g=g: (f"{g('orbit-router') / g('orbit'):.2f}"  # noqa: E731
                               if (g("orbit-router") and g("orbit")) else "-")
            lines.append(f"| {n} | {one} | " + " | ".join(str(g(x)) for x in others) + " | "
                         + " | ".join(rat(g(x)) for x in others) + "".join(f" | {vs(x)}" for x in peers)
                         + (f" | {via()}" if router else "") + " |")
        if r.get("errors"):
            lines.append(f"\nerrors: {len(r['errors'])}, first: {json.dumps(r['errors'][0])[:400]}")
        lines.append("")
    err = _load(d, "driver-error")
    if err:
        lines += ["## driver error", "", "```", err.get("traceback", err.get("error", ""))[-3000:], "```", ""]
    text = "\n".join(lines)
    (d / "summary.md").write_text(text)
    return text


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"signal {signum}")  # so that every server is stopped on the way out


def command_line(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """The driver's arguments: ``argv`` (run.sh's own), then
    ``E2E_DRIVER_ARGS`` split as a shell splits words, so a quoted argument
    with spaces stays one (``--ab-config '{"orbitkv.pd.writer_lanes": 8}'``);
    nothing in it is run. Unbalanced quotes: ``ValueError`` naming the
    variable."""
    text = env.get("E2E_DRIVER_ARGS", "")
    try:
        extra = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"E2E_DRIVER_ARGS is not shell words ({e}): {text!r}") from None
    return [*argv, *extra]


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _sigterm)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="e2e-results")
    p.add_argument("--work", default="/tmp/orbitkv-e2e-work")
    p.add_argument("--deadline-s", type=float, default=1200)
    p.add_argument("--stages", default="a-default,a-eager,s-storm,b-default,c-default,c-eager,b-eager")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--report", metavar="DIR", help="only (re)write DIR/summary.md and print it")
    p.add_argument("--nixl-mock", action="store_true", help="NIXL instances without a connector (CPU dry run)")
    p.add_argument("--nixl", choices=("auto", "yes", "no"), default="auto",
                   help="the NIXL P/D system in stages b and c (auto: yes on two GPUs, no with --one-gpu)")
    p.add_argument("--no-single", dest="single", action="store_false",
                   help="leave the one-engine reference out of stages b and c (GPU memory for an A/B pair)")
    p.add_argument("--no-mc", dest="mc", action="store_false",
                   help="leave vLLM's MooncakeConnector P/D system out of stages b and c")
    p.add_argument("--mc-mock", action="store_true",
                   help="MooncakeConnector instances without a connector (CPU dry run: mc_proxy.py's flow only)")
    p.add_argument("--mc-protocol", default="",
                   help="kv_connector_extra_config.mooncake_protocol (default: vLLM's; Mooncake picks its transport "
                        "by auto-discovery and MC_INTRANODE_NVLINK either way)")
    p.add_argument("--mc-pythonpath", default=os.environ.get("E2E_MC_PYTHONPATH", ""),
                   help="a folder holding a `mooncake` package for vLLM's MooncakeConnector, first on the MC "
                        "instances' PYTHONPATH (run.sh: $E2E_ROOT/mcpy)")
    p.add_argument("--router", action="store_true",
                   help="stages b and c also measure orbit-router: the orbit pair (no other instances) behind "
                        "vllm-router --vllm-pd-disaggregation (its default nixl mode: the two-stage flow) "
                        "instead of orbitkv.proxy")
    p.add_argument("--router-mc", action="store_true",
                   help="stages b and c also measure orbit-router-mc: the orbit pair behind vllm-router "
                        "--kv-connector mooncake (the pair serves OrbitKV's mooncake dialect)")
    p.add_argument("--router-bin", default="",
                   help="an executable to run as vllm-router (default: --python -m vllm_router.launch_router, "
                        "else vllm-router on PATH)")
    p.add_argument("--router-args", default="", help="more vllm-router flags (one string, split like a shell)")
    p.add_argument("--router-start-timeout-s", type=float, default=120)
    p.add_argument("--no-hnd-fallback", dest="hnd_fallback", action="store_false")
    p.add_argument("--start-timeout-s", type=float, default=480)
    p.add_argument("--gpu-mem-util", type=float, default=0.04)
    p.add_argument("--small-kv-gib", type=float, default=2)
    p.add_argument("--big-kv-gib", type=float, default=0,
                   help="KV of each Llama-3-8B-shaped instance (0: the most that fits the GPU by the estimate, "
                        "at most --big-kv-cap-gib)")
    p.add_argument("--big-decode-kv-gib", type=float, default=0.0,
                   help="KV of each Llama-3-8B-shaped decode instance (0: --big-kv-gib's): a decode with room for "
                        "the widest load level keeps the comparison from being one of decode's KV admission")
    p.add_argument("--big-kv-cap-gib", type=float, default=12)
    p.add_argument("--big-orbit-block-sizes", type=block_size_pair, default=None, metavar="P:D",
                   help="vLLM's --block-size of every OrbitKV prefill (P) and decode (D) of the Llama-3-8B-shaped "
                        "instances, e.g. 16:64 (prefill blocks smaller than decode's: written page to page by "
                        "default, gathered by staging_pieces 'write'); the other systems keep vLLM's default")
    p.add_argument("--min-kv-gib", type=float, default=4,
                   help="systems that would leave less KV than this (or than the longest TTFT prompt) per instance "
                        "run in a later group, after the first group's instances are stopped")
    p.add_argument("--gpu-gib", type=float, default=0.0,
                   help="memory of one GPU, GiB (0: the smallest visible GPU's, from nvidia-smi; else an H200's 139)")
    p.add_argument("--gpu-reserve-gib", type=float, default=2.0)
    p.add_argument("--instance-overhead-gib", type=float, default=4.75,
                   help="per instance besides weights and KV: CUDA context, activations, CUDA graphs, staging (run 41, one H100: 4.4-4.7)")
    p.add_argument("--big-layers", type=int, default=32,
                   help="layers of the Llama-3-8B-shaped model (fewer: more instances fit one GPU)")
    p.add_argument("--staging", action="store_true",
                   help="stage a: every OrbitKV instance stages every request (orbitkv.pd.staging_mb, "
                        "staging_min_ranges 1); a model passes only if each P/D request got a grant")
    p.add_argument("--skip-layer-hook", action="store_true",
                   help="stage a: the fp32 model once more with its prefill's attention layers skipping vLLM's "
                        "per-layer connector hooks (every layer then goes at wait_for_save; counted)")
    p.add_argument("--one-gpu", action="store_true",
                   help="every instance on GPU 0 (a one-GPU machine; the transfer stays on one device)")
    p.add_argument("--ab", choices=("auto", "none", "one-lane", "device-wait", "wide-ranges", "narrow-ranges",
                                    "lanes-16", "staging", "control", "custom"),
                   default="auto",
                   help="a second OrbitKV pair with one setting changed: one writer per peer, or Mooncake's "
                        "own submit-time stream wait (orbitkv.pd.mooncake_submit_wait = device), or 8192 ranges "
                        "in flight per peer (wide-ranges) or 768 (narrow-ranges) instead of the transport's "
                        "default (orbitkv.pd.max_inflight_ranges: 8192 on NVLink, 768 on TCP), or 16 writers per "
                        "peer, or staging (--ab-staging-*), or nothing (control: an A/A pair, the spread between two "
                        "identical pairs), or the settings of --ab-config (custom); auto: device-wait on two GPUs, "
                        "none with --one-gpu")
    p.add_argument("--load-kv-digest", action="store_true",
                   help="b-default: per-request KV digests on every OrbitKV pair (the test hook "
                        "ORBITKV_TESTING_KV_DIGEST): decode's KV as loaded against prefill's as released or given "
                        "back early, token for token, over every request of the load runs. The hook hashes each "
                        "request's KV on its device at load and at release: a correctness call under load, not "
                        "one to time")
    p.add_argument("--orbit-roles", choices=("split", "both"), default="split",
                   help="vLLM's kv_role of every OrbitKV pair: split (the prefill kv_producer, the decode "
                        "kv_consumer, as docs/configuration.md advises and MooncakeConnector's pair runs) or "
                        "both (kv_both on both instances, as every run up to 42: the decode then gives a tenth "
                        "of its KV cache to a source staging it never uses)")
    p.add_argument("--ab-config", type=ab_config, default={},
                   help="--ab custom: a JSON object of orbitkv.pd.* settings for both instances of the A/B pair, "
                        "e.g. '{\"orbitkv.pd.writer_lanes\": 16, \"orbitkv.pd.max_inflight_ranges\": 8192}'")
    p.add_argument("--ab-more", type=ab_more, action="append", default=[], metavar="NAME=JSON",
                   help="one more OrbitKV pair, the system orbit-NAME, with the orbitkv.pd.* settings of JSON on both "
                        "instances (repeatable; beside --ab): several A/Bs against the same orbit and mc runs in "
                        "one call, e.g. --ab-more 'share25={\"orbitkv.pd.staging_kv_share\": 0.25}'")
    p.add_argument("--ab-staging-mb", type=int, default=8192,
                   help="--ab staging: orbitkv.pd.staging_mb on both instances of the A/B pair")
    p.add_argument("--ab-staging-min-ranges", type=int, default=1,
                   help="--ab staging: orbitkv.pd.staging_min_ranges on both instances (1: every request; "
                        "16 is the shipped default: only requests whose pages take 16 or more ranges per layer)")
    p.add_argument("--big-max-model-len", type=int, default=36864)
    p.add_argument("--gen", type=int, default=12, help="tokens generated per correctness request")
    p.add_argument("--tol-fp32", type=float, default=0.01)
    p.add_argument("--tol-bf16", type=float, default=0.25)
    p.add_argument("--boundary-lengths", default="5,15,16,17,31,32,33,64,65")
    p.add_argument("--long-lengths", default="1000,2500")
    p.add_argument("--prefix-len", type=int, default=640)
    p.add_argument("--concurrent-max", type=int, default=3000)
    p.add_argument("--fallback-mnbt", type=int, default=8192)
    p.add_argument("--small-mnbt", type=int, default=0,
                   help="--max-num-batched-tokens of the correctness instances (0: vLLM's default)")
    p.add_argument("--bench-input-len", type=int, default=4609)
    p.add_argument("--bench-input-range", type=float, default=0.7777)
    p.add_argument("--bench-output-len", type=int, default=64)
    p.add_argument("--bench-warmup", default="warmup:4:8:1000")
    p.add_argument("--bench-runs", default="c1:1:12:11,c4:4:32:12,c8:8:32:14,c16:16:64:13,c32:32:96:15",
                   help="TAG:IN_FLIGHT:PROMPTS:SEED[:RATE],... (issue 33's levels 1, 4, 8, 16, 32); RATE: "
                        "requests/s of an open loop (Poisson arrivals; IN_FLIGHT then a cap), inf (the default) "
                        "a closed loop of IN_FLIGHT clients")
    p.add_argument("--bench-system-timeout-s", type=float, default=360)
    p.add_argument("--ttft-lengths", default="1024,8192,32768")
    p.add_argument("--ttft-reps", type=int, default=7)
    p.add_argument("--ttft-warmup", type=int, default=2)
    p.add_argument("--ttft-gen", type=int, default=2)
    p.add_argument("--mla-backends", default="FLASH_ATTN_MLA,FLASHMLA,TRITON_MLA",
                   help="m-mla: the MLA attention backends, BACKEND[:KV_DTYPE[:MODES]] comma separated (auto: vLLM's pick); "
                        "each a cell: one engine and an OrbitKV pair per --cell-modes, all of that backend")
    p.add_argument("--mla-layers", type=int, default=4, help="m-mla: layers of the DeepSeek-V2-Lite-shaped model")
    p.add_argument("--mla-boundary-lengths", default="5,15,16,17,63,64,65,127,128,129",
                   help="m-mla: block-boundary prompt lengths (the MLA backends' blocks are 16 or 64 tokens)")
    p.add_argument("--cell-modes", default="direct,staging",
                   help="m-mla: the OrbitKV pairs per cell: direct (no staging setting: the shipped default, "
                        "which since e642ecd is layer pieces cut out of blocks taken from vLLM's KV cache), "
                        "staging (orbitkv.pd.staging_mb --cell-staging-mb, staging_min_ranges 1: every request), "
                        "kv-cache (orbitkv.pd.staging_memory kv_cache set by hand), beside (the layer pieces in "
                        "a region of their own beside vLLM's KV cache: orbitkv.pd.staging_memory beside, the "
                        "default before e642ecd)")
    p.add_argument("--kv-cache-dtypes", default="fp8,fp8_e4m3,fp8_e5m2",
                   help="f-fp8: the KV cache dtypes, KV_DTYPE[:BACKEND[:MODES]] comma separated (no backend: "
                        "vLLM's pick; MODES e.g. direct+staging: this cell's pairs, else --fp8-modes); each a "
                        "cell of the small bf16 Llama")
    p.add_argument("--fp8-modes", default="direct,staging", help="f-fp8: the OrbitKV pairs per cell (as --cell-modes)")
    p.add_argument("--cell-kv-gib", type=float, default=1.0, help="m-mla, f-fp8: KV of each instance")
    p.add_argument("--cell-staging-mb", type=int, default=1024, help="m-mla, f-fp8: staging_mb of a staging pair")
    p.add_argument("--cell-concurrent", type=int, default=24, help="m-mla, f-fp8: prompts sent at once")
    p.add_argument("--cell-eager", action="store_true", help="m-mla, f-fp8: --enforce-eager")
    p.add_argument("--cell-parallel", type=int, default=8, help="m-mla, f-fp8: cells checked at once")
    p.add_argument("--cell-compile-threads", type=int, default=2,
                   help="m-mla, f-fp8: TORCHINDUCTOR_COMPILE_THREADS per instance (many start at once)")
    p.add_argument("--no-kv-digest", dest="kv_digest", action="store_false",
                   help="m-mla, f-fp8: skip the byte-for-byte comparison of prefill's and decode's KV "
                        "(kv_digest.py through vLLM's dev-mode /collective_rpc)")
    p.add_argument("--chunk-split-reps", type=int, default=0,
                   help="m-mla, f-fp8: times to send three prompts at once so that the third's final block spans "
                        "two prefill steps (its last chunk starts inside it), KV compared after")
    p.add_argument("--block-pairs", default="dense:FLASH_ATTN/16>FLASH_ATTN/64,dense:FLASH_ATTN/64>FLASH_ATTN/16,"
                   "mla:FLASH_ATTN_MLA/16>FLASHMLA/64,mla:FLASHMLA/64>FLASH_ATTN_MLA/16",
                   help="k-blocks: MODEL:PBACKEND/PBS>DBACKEND/DBS[:MODES] comma separated (MODEL dense: the "
                        "small bf16 Llama; mla: the m-mla model; a backend auto: vLLM's pick); the one engine "
                        "runs decode's backend and block size")
    p.add_argument("--block-modes", default="direct", help="k-blocks: the OrbitKV pairs per cell (as --cell-modes)")
    p.add_argument("--no-release-digest", dest="release_digest", action="store_false",
                   help="k-blocks, m-mla, f-fp8: no per-request KV digests at load (decode) and release (prefill) "
                        "(the test hook ORBITKV_TESTING_KV_DIGEST)")
    p.add_argument("--cell-stages-together", action="store_true",
                   help="k-blocks, m-mla, f-fp8: run these stages at once (every instance starts together)")
    p.add_argument("--tol-fp8", type=float, default=0.25,
                   help="f-fp8: near-tie tolerance in nats (the model computes in bf16; the KV is fp8)")
    p.add_argument("--storm-requests", type=int, default=48)
    p.add_argument("--storm-in-flight", type=int, default=16)
    p.add_argument("--storm-min-tokens", type=int, default=1536)
    p.add_argument("--storm-max-tokens", type=int, default=6144)
    p.add_argument("--storm-drop-ms", type=float, default=400, help="dropped requests go 0 .. this after sending")
    p.add_argument("--storm-gen", type=int, default=32, help="tokens each streamed storm request asks for")
    p.add_argument("--storm-idle-timeout-s", type=float, default=200)
    p.add_argument("--storm-request-timeout-s", type=float, default=180)
    if argv is None:
        try:
            argv = command_line(sys.argv[1:], os.environ)
        except ValueError as e:
            p.error(str(e))
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.report)))
        return 0
    a.boundary_lengths = [int(x) for x in a.boundary_lengths.split(",") if x]
    a.long_lengths = [int(x) for x in a.long_lengths.split(",") if x]
    a.ttft_lengths = [int(x) for x in a.ttft_lengths.split(",") if x]
    a.mla_boundary_lengths = [int(x) for x in a.mla_boundary_lengths.split(",") if x]
    for opt, sep in (("cell_modes", ","), ("fp8_modes", ","), ("block_modes", ","), ("mla_backends", None),
                     ("kv_cache_dtypes", None), ("block_pairs", "pairs")):
        text = getattr(a, opt)
        wanted = (text.split(",") if sep == "," else
                  [m for c in parse_block_pairs(text) for m in (c[5] or [])] if sep == "pairs" else
                  [m for c in parse_cells(text, "backend") for m in (c.modes or [])])
        bad = [m for m in wanted if m and m not in CELL_MODES]
        if bad:
            p.error(f"--{opt.replace('_', '-')}: unknown mode(s) {bad} (modes: {', '.join(CELL_MODES)})")
    if a.ab == "auto":
        a.ab = "none" if (a.one_gpu and a.device == "cuda") else "device-wait"
    if (a.ab == "custom") != bool(a.ab_config):
        p.error("--ab custom and --ab-config go together")
    names = [name for name, _ in a.ab_more]
    if len(set(names)) != len(names):
        p.error(f"--ab-more: a NAME given twice ({names})")
    for opt in ("bench_runs", "bench_warmup"):
        try:
            parse_runs(getattr(a, opt))
        except ValueError as e:
            p.error(f"--{opt.replace('_', '-')}: {e}")
    return run(Ctx(a))


if __name__ == "__main__":
    sys.exit(main())
