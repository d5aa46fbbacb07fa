"""The tokenizer service's ``--revision``: parsed into the config, and loading the tokenizer and
config of that revision of a Hub repository (from a local Hub cache, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from shoal_tokenizer.main import parse_args

REPO = "shoal-test/tiny"
# Commit of each revision, as the Hub cache records it.
COMMITS = {"main": "1" * 40, "v2": "2" * 40}
MAX_LEN = {"main": 1024, "v2": 4096}


def test_revision_reaches_the_config() -> None:
    assert parse_args(["--models", "m=/models/m"]).revision is None
    config = parse_args(["--models", f"m={REPO}", "--revision", "v2"])
    assert config.revision == "v2"
    assert config.models == {"m": Path(REPO)}


def test_an_empty_revision_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--models", "m=/models/m", "--revision", ""])
    assert exited.value.code == 2
    assert "argument --revision: " in capsys.readouterr().err


def write_revision(snapshot: Path, max_len: int) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    model = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(snapshot)
    config = {"model_type": "llama", "max_position_embeddings": max_len, "eos_token_id": 2}
    (snapshot / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Hub cache holding two revisions of ``REPO`` that differ in context length."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    for revision, commit in COMMITS.items():
        (repo / "refs" / revision).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        write_revision(snapshot, MAX_LEN[revision])
    return cache


def loaded_max_lens(hub_cache: Path, cwd: Path, revisions: list[str | None]) -> list[int]:
    """``load_model``'s context length for ``REPO`` at each revision, in one process that reads
    only ``hub_cache`` (huggingface_hub takes its cache and offline mode from the environment
    when imported)."""
    script = (
        "import sys; from pathlib import Path; from shoal_tokenizer.service import load_model; "
        "print(*(load_model('m', Path(sys.argv[1]), r or None).max_model_len for r in sys.argv[2:]))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_unused"}
    done = subprocess.run(
        [sys.executable, "-c", script, REPO, *(r or "" for r in revisions)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "hf_unused" not in done.stdout + done.stderr
    return [int(word) for word in done.stdout.split()[-len(revisions) :]]


def test_the_revision_picks_the_files_loaded(hub_cache: Path, tmp_path: Path) -> None:
    loaded = loaded_max_lens(hub_cache, tmp_path, [None, "v2", "main"])
    assert loaded == [MAX_LEN["main"], MAX_LEN["v2"], MAX_LEN["main"]]
