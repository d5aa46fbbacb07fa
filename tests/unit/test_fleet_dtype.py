"""``make run`` picks bf16 only on CPUs that compute it, float32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal_fleet.cpu import cpu_flags, native_dtype
from shoal_fleet.main import parse_args

AVX2_ONLY = "fpu vme sse4_2 avx avx2 fma bmi2"
SAPPHIRE_RAPIDS = AVX2_ONLY + " avx512f avx512bw avx512_bf16 amx_bf16 amx_tile"


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    # The first processor's flags count (every processor of a machine has the same).
    path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    return path


def test_avx2_only_cpu_gets_float32(tmp_path: Path) -> None:
    dtype, why = native_dtype(cpu_flags(_cpuinfo(tmp_path, AVX2_ONLY)))
    assert dtype == "float32" and "emulated" in why


def test_cpu_with_bf16_instructions_gets_bf16(tmp_path: Path) -> None:
    dtype, why = native_dtype(cpu_flags(_cpuinfo(tmp_path, SAPPHIRE_RAPIDS)))
    assert dtype == "bfloat16" and "amx_bf16, avx512_bf16" in why


def test_arm_features_line_is_read(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert native_dtype(cpu_flags(path))[0] == "bfloat16"


def test_unreadable_cpuinfo_is_float32(tmp_path: Path) -> None:
    assert native_dtype(cpu_flags(tmp_path / "missing"))[0] == "float32"


@pytest.mark.parametrize(
    ("argv", "dtype"),
    [(["--model", "tiny"], "float32"), (["--dtype", "bfloat16", "--model", "tiny"], "bfloat16")],
)
def test_fleet_takes_the_dtype_asked_for_or_the_models(
    argv: list[str], dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models"
    (models / "tiny-llama").mkdir(parents=True)
    (models / "tiny-llama" / "config.json").write_text("{}")
    cfg = parse_args([*argv, "--models-dir", str(models), "--run-dir", str(tmp_path / "run")])
    assert cfg.dtype == dtype
    assert f"engine dtype: {dtype}" in capsys.readouterr().out


def test_fleet_picks_from_this_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = parse_args(["--model", str(model), "--run-dir", str(tmp_path / "run")])
    assert cfg.dtype == native_dtype(cpu_flags())[0]
    assert capsys.readouterr().out.startswith(f"engine dtype: {cfg.dtype} (")
