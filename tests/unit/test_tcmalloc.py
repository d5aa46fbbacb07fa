"""CPU engines preload tcmalloc into vLLM's processes when it is installed: the library goes
first in ``LD_PRELOAD`` (vLLM appends its OpenMP runtime after), is never added twice, and
nothing changes without it or with ``--no-tcmalloc``."""

from __future__ import annotations

import pytest

from shoal_engine.main import parse_args
from shoal_engine.tcmalloc import preload

LIB = "libtcmalloc_minimal.so.4"


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({}, {"LD_PRELOAD": LIB}),
        ({"LD_PRELOAD": ""}, {"LD_PRELOAD": LIB}),
        ({"LD_PRELOAD": "/opt/libgomp.so.1"}, {"LD_PRELOAD": f"{LIB}:/opt/libgomp.so.1"}),
    ],
)
def test_the_library_goes_first(before: dict[str, str], after: dict[str, str]) -> None:
    environ = dict(before)
    assert preload(environ, LIB)
    assert environ == after


@pytest.mark.parametrize(
    ("environ", "library"),
    [
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, LIB),  # one is preloaded already
        ({"LD_PRELOAD": "/opt/libgomp.so.1"}, None),  # not installed
        ({}, None),
    ],
)
def test_nothing_changes(environ: dict[str, str], library: str | None) -> None:
    before = dict(environ)
    assert not preload(environ, library)
    assert environ == before


def test_the_flag_turns_it_off() -> None:
    common = ["--model", "m", "--served-model-name", "m"]
    assert parse_args(common).tcmalloc
    assert not parse_args([*common, "--no-tcmalloc"]).tcmalloc
