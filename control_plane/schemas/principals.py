"""Request and response models of principals, API tokens and join tokens."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from control_plane.authz import Role
from control_plane.schemas.limits import TEXT_LINE
from control_plane.schemas.tenants import TENANT_NAME

PRINCIPAL_NAME = r"^[a-z0-9][a-z0-9._@-]*$"
NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
TOKEN_TTL_MAX_S = 366 * 86400
JOIN_TTL_MAX_S = 30 * 86400


class PrincipalIn(BaseModel):
    """A new principal and its first API token (shown once, in the answer)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"name": "alice", "tenant": "vision", "role": "member"}]})

    name: str = Field(min_length=1, max_length=128, pattern=PRINCIPAL_NAME)
    tenant: str = Field(min_length=1, max_length=128, pattern=TENANT_NAME)
    role: Role = Field(strict=False, description="admin, operator, member or viewer (docs/security.md).")
    token_ttl_s: int | None = Field(default=None, ge=60, le=TOKEN_TTL_MAX_S,
                                    description="Lifetime of the first token; null: until revoked.")


class PrincipalOut(BaseModel):
    id: str
    name: str
    tenant: str
    role: Role = Field(strict=False, description="admin, operator, member or viewer (docs/security.md).")
    created_by: str
    created_at: datetime
    disabled_at: datetime | None
    tokens: int = Field(description="Tokens not revoked or expired.")


class WhoAmI(BaseModel):
    name: str
    tenant: str
    role: Role = Field(strict=False, description="admin, operator, member or viewer (docs/security.md).")
    token_id: str | None = Field(description="The token used; null for the bootstrap admin token.")


class TokenIn(BaseModel):
    """A new API token, for the caller or (admin) for a named principal."""

    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"examples": [{"description": "CI", "ttl_s": 2592000}]})

    principal: str | None = Field(default=None, min_length=1, max_length=128, pattern=PRINCIPAL_NAME,
                                  description="Whose token (admins only); default: the caller's.")
    description: str = Field(default="", max_length=256, pattern=TEXT_LINE)
    ttl_s: int | None = Field(default=None, ge=60, le=TOKEN_TTL_MAX_S, description="Lifetime; null: until revoked.")


class TokenOut(BaseModel):
    id: str
    principal: str
    description: str
    created_by: str
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="The bearer token. Shown once: only its sha256 is stored.")


class PrincipalCreated(PrincipalOut):
    token: str = Field(description="The first bearer token of the principal. Shown once.")
    token_id: str


class JoinTokenIn(BaseModel):
    """A bootstrap token for agents. Without ``node_name`` it registers new node names only; with
    one, it may also re-claim that registered node (an agent whose credential was lost)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"node_name": "gpu-07", "ttl_s": 3600}]})

    node_name: str | None = Field(default=None, min_length=1, max_length=128, pattern=NODE_NAME)
    ttl_s: int = Field(default=3600, ge=60, le=JOIN_TTL_MAX_S, description="Lifetime in seconds.")
    max_uses: int | None = Field(default=1, ge=1, le=100_000,
                                 description="Registrations it allows; null: any number until it expires.")
    description: str = Field(default="", max_length=256, pattern=TEXT_LINE)


class JoinTokenOut(BaseModel):
    id: str
    node_name: str | None
    max_uses: int | None
    uses: int
    description: str
    created_by: str
    created_at: datetime
    expires_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    usable: bool = Field(description="Neither expired, revoked nor used up.")


class JoinTokenCreated(JoinTokenOut):
    token: str = Field(description="Give it to the agent in a file (--join-token-file) or TRAINYARD_JOIN_TOKEN; "
                                   "never on a command line. Shown once.")
