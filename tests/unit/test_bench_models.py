"""The benchmarks' fits and statistics: the step-time fit finds the coefficients that made the
steps, held-out errors come from fits that never saw the shape, the serving overhead is what the
served steps add, and the fleet benchmark's intervals, verdicts, workload shapes and TTFT floor."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from bench import fleet, simcheck, stepfit
from shoal_sim.engine import STEP_MODELS, StepModel
from shoal_sim.fleet import Fleet, Simulation, Workload

TRUE = StepModel(
    name="true",
    base_ms=12.0,
    decode_ms=0.9,
    chunk_ms=2.0,
    prefill_ms=0.5,
    context_us=3.0,
    pair_us=0.4,
    source="test",
)


def _batches(noise: float = 0.0) -> list[stepfit.Batch]:
    """The bench's grid of shapes, timed by ``TRUE`` (with relative noise, seeded)."""
    rng = random.Random(1)
    batches = stepfit.shapes(quick=False, kv_blocks=364)
    for batch in batches:
        values = batch.params
        if batch.kind == "decode":
            batch.context = values["B"] * values["C"]
        elif batch.kind == "mixed":
            b, p, budget = values["B"], values["P"], 2048
            batch.chunks = [(min(p - done, budget - b), done) for done in range(0, p, budget - b)]
            batch.decoding, batch.context = b * len(batch.chunks), b * values["C"] * len(batch.chunks)
        batch.ms = [stepfit.predict(TRUE, batch) * (1 + rng.uniform(-noise, noise)) for _ in range(3)]
    return batches


def test_the_step_fit_finds_the_coefficients_that_timed_the_steps() -> None:
    model = stepfit.fit(_batches())
    for term in stepfit.TERMS:
        assert getattr(model, term) == pytest.approx(getattr(TRUE, term), rel=1e-6)
    held = stepfit.cross_validate(_batches(), seed=0)
    assert max(abs(e) for e in held.values()) < 1e-6


def test_held_out_errors_come_from_fits_that_never_saw_the_shape() -> None:
    """A shape timed far off the model shows its error only when held out: the fit on all
    shapes bends towards it, the fit without it does not."""
    batches = _batches()
    odd = next(b for b in batches if b.shape == "decode B=16 C=512")
    odd.ms = [m * 1.5 for m in odd.ms]
    held = stepfit.cross_validate(batches, seed=0)
    on_all = stepfit.predict(stepfit.fit(batches), odd) / odd.median_ms - 1
    assert held[odd.shape] < on_all < 0
    assert held[odd.shape] == pytest.approx(stepfit.predict(TRUE, odd) / odd.median_ms - 1, abs=0.02)


def test_the_serving_overhead_is_what_the_served_steps_add() -> None:
    model = STEP_MODELS["smollm2-cpu"]
    stepped = StepModel(
        **{**model.__dict__, "base_ms": model.base_ms + 4.0, "decode_ms": model.decode_ms + 0.3}
    )
    calibration = [
        {"prompt": p, "ttft_ms": stepped.step_ms(0, [(p, 0)], 0) + 9.0 + 0.05 * p}
        for p in simcheck.PREFILL_CALIBRATION
    ]
    for per_engine, context in simcheck.CALIBRATION:
        mid = context + simcheck.CALIBRATION_TOKENS // 2
        step = model.step_ms(per_engine, [], per_engine * mid)
        calibration.append(
            {"per_engine": per_engine, "context": context, "gap_ms": step + 4.0 + 0.3 * per_engine}
        )
    served = simcheck.served(model, calibration)
    assert served.base_ms == pytest.approx(model.base_ms + 4.0)
    assert served.decode_ms == pytest.approx(model.decode_ms + 0.3)
    assert served.chunk_ms == pytest.approx(model.chunk_ms + 9.0)
    assert served.prefill_ms == pytest.approx(model.prefill_ms + 0.05)
    assert (served.context_us, served.pair_us) == (model.context_us, model.pair_us)


def test_a_replayed_trace_is_simulated_as_given() -> None:
    trace = simcheck.draw_trace(2.0, 30, 0, 256, 64)
    assert all(p <= simcheck.MAX_PROMPT and p + o < stepfit.MAX_MODEL_LEN for _, p, o in trace)
    workload = Workload.replay(trace)
    assert workload.draw() == trace and workload.requests == 30
    result = Simulation(Fleet(engines=2, sim=fleet.SIM), workload).run()
    assert result.tokens == sum(o for _, _, o in trace)
    with pytest.raises(ValueError, match="empty"):
        Workload.replay([])


def test_workload_shapes_burst_and_follow_a_power_law() -> None:
    def gaps(**shape: float) -> list[float]:
        draw = Workload(rate=10.0, requests=20_000, seed=3, **shape).draw()
        return [b[0] - a[0] for a, b in itertools.pairwise(draw)]

    poisson, bursty = gaps(), gaps(burstiness=0.25)
    for values, cv in ((poisson, 1.0), (bursty, 2.0)):
        assert statistics.fmean(values) == pytest.approx(0.1, rel=0.05)
        assert statistics.stdev(values) / statistics.fmean(values) == pytest.approx(cv, rel=0.1)
    pareto = Workload(rate=10.0, requests=20_000, seed=3, pareto_alpha=1.5).draw()
    lognormal = Workload(rate=10.0, requests=20_000, seed=3).draw()
    # The same medians, a heavier tail of outputs.
    assert statistics.median(o for _, _, o in pareto) == pytest.approx(256, rel=0.1)
    assert sorted(o for *_, o in pareto)[19_900] > sorted(o for *_, o in lognormal)[19_900]


def test_intervals_and_verdicts_read_differences_beyond_the_noise() -> None:
    mean, half = fleet.interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(2.776 * statistics.stdev([1, 2, 3, 4, 5]) / math.sqrt(5))
    assert math.isnan(fleet.interval([1.0])[1])
    base = {m: (1.0, 0.1) for m, _, _ in fleet.MEASURES}
    assert fleet.verdict(dict(base), base) == "==="
    better = {**base, "ttft_p99_s": (0.5, 0.1), "preemption_loss_s": (1.15, 0.1)}
    worse = {**base, "decode_p99_ms": (1.5, 0.1)}
    assert fleet.verdict(better, base) == "+=="
    assert fleet.verdict(worse, base) == "=-="


def test_no_policy_beats_the_ttft_floor() -> None:
    """The floor (each prompt computed alone as it arrives) is below what every simulated
    policy reaches."""
    floor = fleet.ttft_floor("sharegpt", 4.0, [0], 600)
    for policy in fleet.POLICIES:
        row = fleet.run(fleet.Run("sharegpt", 4.0, 0, policy, 4, 600, 8.0))
        assert floor < row["ttft_p99_s"]
    assert floor > 0.05
