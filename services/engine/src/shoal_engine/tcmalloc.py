"""tcmalloc for vLLM's processes on CPU engines.

vLLM's CPU build steps allocate and free many small tensors; with tcmalloc preloaded its steps
run a few percent faster than with glibc's allocator (``make bench-allocator``). The engine
service puts the library in ``LD_PRELOAD`` before it starts vLLM, so the processes vLLM starts
(the engine core and the worker that runs the model) load it; vLLM then appends its OpenMP
runtime. Benchmarks give vLLM's own server the same, so comparisons stay even.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import MutableMapping


def installed() -> str | None:
    """The library's name for ``LD_PRELOAD`` (Debian's ``libtcmalloc-minimal4``), or None when
    it is not installed."""
    return ctypes.util.find_library("tcmalloc_minimal")


def preload(environ: MutableMapping[str, str], library: str | None) -> bool:
    """Put ``library`` first in ``environ["LD_PRELOAD"]``. False when there is no library or a
    tcmalloc is preloaded already."""
    current = environ.get("LD_PRELOAD", "")
    if not library or "libtcmalloc" in current:
        return False
    environ["LD_PRELOAD"] = f"{library}:{current}" if current else library
    return True
