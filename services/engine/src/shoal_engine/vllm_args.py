"""A user's own vLLM engine flags: ``shoal-engine --vllm-args "--enable-chunked-prefill ..."``.

The text is split as a shell would (``shlex``), and a flag Shoal sets itself
(``shoal_protos.vllm_flags``) is refused by name, both without importing vLLM, so that
``parse_args`` fails at once. ``vllm_backend.user_engine_args`` then runs vLLM's own parser
over the words, which checks names and values as ``vllm serve`` does.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from shoal_protos.vllm_flags import OWNED_VLLM_FLAGS, owned_flag

# What to use instead of each owned flag.
_INSTEAD: dict[str, str] = {
    "--host": "use shoal-engine's --host",
    "--port": "use shoal-engine's --zmq-port and --http-port",
    "--kv-transfer-config": "use shoal-engine's --migration, which loads Shoal's KV connector",
    "--tokenizer-revision": "use shoal-engine's --revision, which sets both",
    "--distributed-executor-backend": "use shoal-engine's --executor-backend",
    "--disable-log-stats": "its stats feed the engine's load reports",
    "--enable-log-requests": "Shoal turns it off",
    "--hf-token": "pass the token in the HF_TOKEN environment variable",
}

OWNED_FIELDS: frozenset[str] = frozenset(
    flag.removeprefix("--").replace("-", "_")
    for flag in {owned_flag(spelling) or spelling for spelling in OWNED_VLLM_FLAGS}
)
"""``AsyncEngineArgs`` fields behind the owned flags (``host`` and ``port`` are none)."""


class VllmArgsError(Exception):
    """``--vllm-args`` holds something vLLM or Shoal refuses; the message is one line."""


def refusal(flag: str) -> str:
    """The one-line message refusing owned ``flag`` (its canonical spelling)."""
    instead = _INSTEAD.get(flag, f"use shoal-engine's {flag}")
    return f"--vllm-args: {flag} is set by Shoal ({instead})"


def split_vllm_args(texts: Iterable[str]) -> tuple[str, ...]:
    """The words of every ``--vllm-args`` text, in order; raises ``VllmArgsError`` on quoting a
    shell would refuse or on a flag Shoal sets itself."""
    words: list[str] = []
    for text in texts:
        try:
            words += shlex.split(text)
        except ValueError as exc:
            # The text itself stays out of the message: it may hold what should not be logged.
            raise VllmArgsError(f"--vllm-args: {exc}") from None
    for word in words:
        flag = owned_flag(word)
        if flag is not None:
            raise VllmArgsError(refusal(flag))
    return tuple(words)
