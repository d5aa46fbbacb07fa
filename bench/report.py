"""Writing a benchmark's section into ``docs/benchmarks.md``, between its own markers, and the
bootstrap interval the sections quote."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"


def update_section(section: str, begin: str, end: str, path: Path = DOCS) -> None:
    """Replace the text from ``begin`` to ``end`` with ``section`` (which carries both markers),
    append it when the file has no such section, or create the file."""
    if path.exists():
        text = path.read_text()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + section + rest.split(end, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        text = "# Benchmarks\n\nMeasured on this repository's machines; each section names its command.\n\n"
        text += section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish(section: str, begin: str, end: str, print_only: bool) -> None:
    """Print a benchmark's section and, unless ``print_only``, write it into the docs."""
    print(section)
    if not print_only:
        update_section(section, begin, end)
        print(f"wrote {DOCS.relative_to(ROOT)}")


def bootstrap_interval(
    values: Sequence[float], statistic: Callable[[Sequence[float]], float], resamples: int = 4000
) -> tuple[float, float, float]:
    """``statistic`` of ``values`` and a 95 % bootstrap interval of it (percentiles of the
    statistic over ``resamples`` draws with replacement; a fixed seed, so a rerun of the report
    agrees)."""
    draw = random.Random(0)
    drawn = sorted(statistic(draw.choices(values, k=len(values))) for _ in range(resamples))
    return statistic(values), drawn[int(0.025 * resamples)], drawn[int(0.975 * resamples) - 1]
