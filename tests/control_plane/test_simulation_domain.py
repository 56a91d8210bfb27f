"""The goodput simulation over the whole domain its schema allows (issue 28): hypothesis draws every
field from the bounds the schema declares (read from SimulationIn itself, so a widened bound is
tried at once), subnormals, zeros and extremes included. Every answer is finite, its goodputs in
[0, 1]; or the request is a 422 that names its fields. Never an exception, never a 500."""

from __future__ import annotations

import math
from typing import Any

import annotated_types
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from control_plane.errors import Unprocessable
from control_plane.schemas.simulations import SimulationIn, SimulationOut
from control_plane.services.read.simulations import simulate
from tests.factories import ADMIN

ISSUE_28 = {"blocking_s": 26993.83016630085, "node_mtbf_h": 5e-324, "days": None, "work_h": 5e-324,
            "repair_h": 0.0, "nodes": 11954}
"""The 500 schemathesis found at 3c4b776 (ZeroDivisionError: job MTBF 0)."""
CLOSED_FORM_OVERFLOW = {"nodes": 100, "node_mtbf_h": 1, "work_h": 0.01, "interval_s": 1e7, "recovery_s": 0,
                        "blocking_s": 0}
"""Inside the tightened schema, still a 500 before the fix: e^(interval / job MTBF) overflowed."""
EVENTS = 20_000
"""The service's budget of simulated failures, lowered from 2,000,000: which requests are refused
as too slow moves, what is computed for the rest does not, and each example takes milliseconds."""


SMALLEST_NORMAL = 2.2250738585072014e-308
"""Subnormals are drawn wherever a range reaches below it (hypothesis refuses them elsewhere)."""


def _bounds(name: str) -> tuple[float, float]:
    lo = hi = None
    for m in SimulationIn.model_fields[name].metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Le):
            hi = m.le
    assert lo is not None and hi is not None, f"{name} has no closed range"
    return float(lo), float(hi)  # type: ignore[arg-type]


def _field(name: str) -> st.SearchStrategy[Any]:
    lo, hi = _bounds(name)
    info = SimulationIn.model_fields[name]
    if info.annotation in (int, int | None):
        values: st.SearchStrategy[Any] = st.integers(int(lo), int(hi))
    else:
        edges = st.sampled_from(sorted({lo, hi, math.nextafter(lo, math.inf), math.nextafter(hi, -math.inf)}))
        # Times and rates span decades: a uniform draw over [0, 86,400] is almost never under 100 s,
        # where the model's ratios are extreme; a log-uniform one is, as often as near the top.
        floor = max(lo, 1e-6)
        scales = st.floats(math.log10(floor), math.log10(hi)).map(lambda e: min(max(10.0**e, lo), hi))
        values = st.one_of(edges, scales, st.floats(min_value=lo, max_value=hi, allow_subnormal=lo < SMALLEST_NORMAL))
    return values if info.is_required() else st.one_of(st.none(), values)


NUMERIC = [n for n, f in SimulationIn.model_fields.items() if f.annotation in (int, float, int | None, float | None)]


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = {name: draw(_field(name)) for name in NUMERIC}
    # Mostly one of the two ways to give the failure rate (the model validator refuses the others).
    rate = draw(st.sampled_from(["mtbf", "interruptions", "as drawn"]))
    if rate == "mtbf":
        body["interruptions"] = body["days"] = None
        body["node_mtbf_h"] = draw(_field("node_mtbf_h").filter(lambda v: v is not None))
    elif rate == "interruptions":
        body["node_mtbf_h"] = None
        body["interruptions"] = draw(_field("interruptions").filter(lambda v: v is not None))
        body["days"] = draw(_field("days").filter(lambda v: v is not None))
    body["runs"] = draw(st.integers(1, 3)) if draw(st.booleans()) else body["runs"]
    return {k: v for k, v in body.items() if v is not None}


def _check(out: SimulationOut) -> None:
    for key, value in out.model_dump().items():
        if isinstance(value, float):
            assert math.isfinite(value) and value >= 0, (key, value)
    fractions = [out.goodput, *(p.goodput for p in out.intervals), *(p.goodput for p in out.spares),
                 *(p.goodput for p in out.modes)]
    if out.goodput_closed_form is not None:
        fractions.append(out.goodput_closed_form)
    assert all(0 <= g <= 1 for g in fractions), fractions
    for point in (*out.intervals, *out.modes):
        assert math.isfinite(point.interval_s) and point.interval_s > 0, point
    for spares in out.spares:
        assert math.isfinite(spares.waiting_h) and spares.waiting_h >= 0


@given(body=bodies())
@example(body=CLOSED_FORM_OVERFLOW)
@example(body={"nodes": 100_000, "node_mtbf_h": 1, "work_h": 100_000, "blocking_s": 86_400, "recovery_s": 0})
@example(body={"nodes": 1, "node_mtbf_h": 1e7, "work_h": 0.01, "blocking_s": 5e-324, "background_s": 86_400,
               "interval_s": 1e7, "repair_h": 10_000, "spares": 0})
@example(body={"nodes": 1, "interruptions": 1, "days": 0.01, "work_h": 100_000, "blocking_s": 0,
               "recovery_s": 0, "repair_h": 0, "spares": 10_000})
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_model_answers_finite_fractions_or_a_422_naming_fields(body):
    try:
        request = SimulationIn.model_validate(body)
    except ValidationError as exc:
        # Out of the domain (only the rate's own checks can be, every field being in its range).
        for error in exc.errors():
            assert error["loc"] == ("days",) or "node_mtbf_h" in error["msg"] or "interruptions" in error["msg"], error
        return
    try:
        out = simulate(request, max_events=EVENTS)
    except Unprocessable as exc:
        assert exc.status == 422 and {"node_mtbf_h", "work_h"} <= {e["field"] for e in exc.extra["errors"]}
        return
    _check(out)


def test_an_answer_inside_the_event_budget_is_the_same_with_the_full_one():
    """The lowered budget only decides what is refused: a request it admits computes the same."""
    body = SimulationIn(nodes=64, node_mtbf_h=500, work_h=200, blocking_s=30, runs=2)
    assert simulate(body, max_events=EVENTS) == simulate(body)


@pytest.mark.parametrize(("body", "fields"), [
    (ISSUE_28, {"node_mtbf_h", "work_h"}),
    ({"nodes": 8, "node_mtbf_h": 0.5, "blocking_s": 5}, {"node_mtbf_h"}),
    ({"nodes": 8, "node_mtbf_h": 1000, "blocking_s": 5, "work_h": 1e-3}, {"work_h"}),
    ({"nodes": 8, "interruptions": 10_000_000, "days": 1, "blocking_s": 5}, {"days"}),
    ({"nodes": 8, "node_mtbf_h": 1000, "blocking_s": 1e300}, {"blocking_s"}),
])
def test_values_off_the_domain_are_a_422_naming_the_field(client, body, fields):
    r = client.post("/v1/simulations", json=body, headers=ADMIN)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), r.text
    assert {e["field"] for e in r.json()["errors"]} == fields, r.text


def test_a_closed_form_that_overflows_is_an_answer_not_a_500(client):
    r = client.post("/v1/simulations", json=CLOSED_FORM_OVERFLOW, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["goodput_closed_form"] == 0.0 and 0 < r.json()["goodput"] <= 1


def test_too_many_failures_to_simulate_is_a_422_naming_the_rate_fields(client):
    body = {"nodes": 100_000, "node_mtbf_h": 1, "work_h": 100_000, "blocking_s": 60, "recovery_s": 0}
    r = client.post("/v1/simulations", json=body, headers=ADMIN)
    assert r.status_code == 422, r.text
    assert {"node_mtbf_h", "nodes", "work_h"} <= {e["field"] for e in r.json()["errors"]}


def test_the_ranges_are_in_the_openapi_document(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["SimulationIn"]["properties"]
    mtbf = next(s for s in schema["node_mtbf_h"]["anyOf"] if s.get("type") == "number")
    assert (mtbf["minimum"], mtbf["maximum"]) == (1, 1e7) and "1 to 10,000,000" in schema["node_mtbf_h"]["description"]
    assert schema["work_h"]["minimum"] == 0.01 and "0.01" in schema["work_h"]["description"]
