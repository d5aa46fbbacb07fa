"""vLLM engine flags that Shoal sets itself, so a user's own vLLM flags must not carry them.

``shoal-engine --vllm-args`` passes a user's extra vLLM engine flags through to vLLM; the engine
refuses one named here at start, and the operator refuses it when an InferenceCluster is
admitted. Both read the same tuple, so the list lives here, in the shared contract package.
"""

from __future__ import annotations

OWNED_VLLM_FLAGS: tuple[str, ...] = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--dtype",
    "--max-model-len",
    "--max-num-seqs",
    "--block-size",
    "--kv-transfer-config",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--gpu-memory-utilization",
    "--device-memory-utilization",
    "--quantization",
    "-q",
    "--revision",
    "--tokenizer-revision",
    "--scheduling-policy",
    "--enforce-eager",
    "--no-enforce-eager",
    "--distributed-executor-backend",
    "--disable-log-stats",
    "--enable-log-requests",
    "--no-enable-log-requests",
    "--hf-token",
)
"""vLLM CLI spellings of the settings Shoal gives vLLM itself: every ``AsyncEngineArgs`` field
the engine sets (``shoal_engine.vllm_backend``), under each name vLLM's parser gives it (its
aliases ``-tp``, ``-pp``, ``-q``, ``--device-memory-utilization`` and the ``--no-`` forms of
its boolean flags); ``--host`` and ``--port``, since the engine serves its own sockets; and
``--hf-token``, since a gated model's token comes from the ``HF_TOKEN`` environment variable (a
Secret) and must never appear in a command line.

vLLM reads ``--x_y`` as ``--x-y``, ``--x-y=V`` as ``--x-y V`` and ``--x-y.key V`` as part of
``--x-y``'s JSON, so an argument is owned when its name, cut at the first ``=`` and at the
first ``.`` and with ``_`` turned into ``-``, is in this tuple; a short alias also takes its
value glued on (``-tp2``, ``-qawq``). ``owned_flag`` applies these rules. The engine checks the
flags vLLM's parser actually read as well, which also catches abbreviations (``--tensor-par``)."""

# The canonical spelling of each alias and negation, for messages.
_CANONICAL: dict[str, str] = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-q": "--quantization",
    "--device-memory-utilization": "--gpu-memory-utilization",
    "--no-enforce-eager": "--enforce-eager",
    "--no-enable-log-requests": "--enable-log-requests",
}

# A short option takes its value glued on as well (``-qawq``, ``-tp2``), as argparse allows.
_SHORT: tuple[str, ...] = tuple(flag for flag in OWNED_VLLM_FLAGS if not flag.startswith("--"))


def owned_flag(arg: str) -> str | None:
    """The owned flag ``arg`` sets, in its canonical long spelling (``-tp=2`` gives
    ``--tensor-parallel-size``), or None for any other argument, values included."""
    if arg.startswith("--"):
        name = "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        return _CANONICAL.get(name, name) if name in OWNED_VLLM_FLAGS else None
    for short in _SHORT:
        if arg.startswith(short):
            return _CANONICAL[short]
    return None
