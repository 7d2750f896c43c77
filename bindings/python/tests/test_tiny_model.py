"""The tiny random-weight Llama used by the end-to-end tests (no hub)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from orbitkv.testing.tiny_model import MARKER, TinyModelSpec, make_tiny_model


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.iterdir()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def test_tiny_model_files_geometry_and_idempotence(tmp_path: Path) -> None:
    spec = TinyModelSpec(num_layers=2)
    path = Path(make_tiny_model(tmp_path / "m", spec))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER):
        assert (path / name).is_file(), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 2, 4)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (2, 64, 1024)
    assert cfg["dtype"] == "float32"

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 1024
    ids = tok("The quick brown fox, 12345!")["input_ids"]
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == "The quick brown fox, 12345!"

    before = _digest(path)
    t0 = time.monotonic()
    assert make_tiny_model(path, spec) == str(path)
    assert time.monotonic() - t0 < 1.0  # already there: nothing rebuilt
    assert _digest(path) == before

    # Same spec elsewhere: the same bytes (fixed seed, deterministic tokenizer).
    assert _digest(Path(make_tiny_model(tmp_path / "again", spec))) == before


def test_tiny_model_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        make_tiny_model(tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "not a model"
