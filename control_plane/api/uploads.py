"""/v1/upload-slots: who holds checkpoint upload slots and who waits, and the limits (operators:
policy nodes.read, as the slots name every tenant's jobs and nodes)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Query

from control_plane.api.deps import NodesRead, SessionDep, SettingsDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.uploads import UploadSlotsOut
from control_plane.services.checkpoints import upload_slots

router = APIRouter(prefix="/v1/upload-slots", tags=["uploads"], route_class=TransactionRoute)


@router.get("", response_model=UploadSlotsOut, responses=ERRORS, summary="Checkpoint upload slots")
def list_upload_slots(session: SessionDep, settings: SettingsDep, _: NodesRead,
                      job_id: uuid.UUID | None = Query(default=None, description="Every slot of this job, "
                                                       "ended ones included (kept a day).")) -> UploadSlotsOut:
    """The limits and the slots granted or waiting now (docs/architecture.md, "Checkpoint upload slots")."""
    return upload_slots.view(session, settings, job_id)
