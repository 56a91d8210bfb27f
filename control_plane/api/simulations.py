"""/v1/simulations: the goodput model of one long job (docs/goodput.md), a thin route."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.api.deps import SimulationsCreate
from control_plane.api.jobs import ERRORS
from control_plane.schemas.simulations import SimulationIn, SimulationOut
from control_plane.services.read import simulations

router = APIRouter(prefix="/v1/simulations", tags=["simulations"])


@router.post("", response_model=SimulationOut, responses=ERRORS, summary="Simulate a job's goodput")
def simulate(body: SimulationIn, _: SimulationsCreate) -> SimulationOut:
    """A discrete-event model of one job on `nodes` nodes that fail at random: its goodput, lost work,
    the best checkpoint interval (and Young's), goodput against spare nodes and async against sync
    saves. Pure: nothing is stored, and the same body gives the same answer."""
    return simulations.simulate(body)
