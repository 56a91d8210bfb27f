"""/v1/code: archives of code that jobs run in (services/runs/code.py), uploaded once per content hash."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status

from control_plane.api.deps import CodeUpload, RuntimeDep, SettingsDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.jobs import CodeOut
from control_plane.schemas.tenants import TENANT_NAME
from control_plane.services.runs import code, code_upload
from control_plane.services.runs.code_upload import declared_length

router = APIRouter(prefix="/v1/code", tags=["jobs"], route_class=TransactionRoute)

Sha256 = Annotated[str, Path(pattern="^[0-9a-f]{64}$", description="sha256 of the archive.")]
Tenant = Annotated[str | None, Query(min_length=1, max_length=128, pattern=TENANT_NAME,
                                     description="Default: the caller's. Only an admin may name another.")]


@router.get("/{sha256}", response_model=CodeOut, responses=ERRORS, summary="Is this code uploaded?")
def get_code(sha256: Sha256, runtime: RuntimeDep, principal: CodeUpload, tenant: Tenant = None) -> CodeOut:
    """200 when the caller's tenant has uploaded it (nothing to upload again), 404 otherwise."""
    return CodeOut(**code.get(runtime.object_store, principal, sha256, tenant))


ARCHIVE_BODY = {"requestBody": {"required": True, "description": "A tar.gz archive, streamed (at most max_code_bytes).",
                                 "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                     "format": "binary"}}}}}


@router.put("/{sha256}", response_model=CodeOut, status_code=status.HTTP_201_CREATED, summary="Upload code",
            responses={200: {"model": CodeOut, "description": "It was uploaded before."}, **ERRORS},
            openapi_extra=ARCHIVE_BODY)
async def put_code(sha256: Sha256, request: Request, response: Response, runtime: RuntimeDep, principal: CodeUpload,
                   settings: SettingsDep, tenant: Tenant = None) -> CodeOut:
    """A gzip-compressed tar of the job's folder, whose sha256 is `sha256`, for the caller's tenant
    (at most max_code_bytes: 413 above; within the tenant's code quota: 409/413 code-quota; at
    most code_uploads_per_principal at once: 429). Streamed to storage as it arrives. Name it in
    a job as `"code": {"sha256": ...}`."""
    stored, created = await code_upload.receive(
        runtime.object_store, runtime.code_uploads, principal, sha256, request.stream(),
        declared=declared_length(request.headers.get("content-length")), tenant=tenant, settings=settings)
    if not created:
        response.status_code = status.HTTP_200_OK
    return CodeOut(**stored)
