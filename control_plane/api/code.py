"""/v1/code: archives of code that jobs run in (services/code.py), uploaded once per content hash."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Response, status

from control_plane.api.deps import CodeUpload, RuntimeDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.jobs import CodeOut
from control_plane.schemas.tenants import TENANT_NAME
from control_plane.services import code

router = APIRouter(prefix="/v1/code", tags=["jobs"], route_class=TransactionRoute)

Sha256 = Annotated[str, Path(pattern="^[0-9a-f]{64}$", description="sha256 of the archive.")]
Archive = Annotated[bytes, Body(media_type="application/octet-stream", description="A tar.gz archive.")]
Tenant = Annotated[str | None, Query(min_length=1, max_length=128, pattern=TENANT_NAME,
                                     description="Default: the caller's. Only an admin may name another.")]


@router.get("/{sha256}", response_model=CodeOut, responses=ERRORS, summary="Is this code uploaded?")
def get_code(sha256: Sha256, runtime: RuntimeDep, principal: CodeUpload, tenant: Tenant = None) -> CodeOut:
    """200 when the caller's tenant has uploaded it (nothing to upload again), 404 otherwise."""
    return CodeOut(**code.get(runtime.object_store, principal, sha256, tenant))


@router.put("/{sha256}", response_model=CodeOut, status_code=status.HTTP_201_CREATED, summary="Upload code",
            responses={200: {"model": CodeOut, "description": "It was uploaded before."}, **ERRORS})
def put_code(sha256: Sha256, response: Response, runtime: RuntimeDep, principal: CodeUpload, body: Archive,
             tenant: Tenant = None) -> CodeOut:
    """A gzip-compressed tar of the job's folder, whose sha256 is `sha256`, for the caller's tenant
    (at most max_code_bytes; 413 above). Name it in a job as `"code": {"sha256": ...}`."""
    stored, created = code.upload(runtime.object_store, principal, sha256, body, tenant)
    if not created:
        response.status_code = status.HTTP_200_OK
    return CodeOut(**stored)
