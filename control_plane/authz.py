"""Who may do what (pure: standard library only).

Every API token belongs to a principal with a tenant and a role. Every route declares one policy
(api/deps.py ``Allow``); tests/control_plane/test_authz_matrix.py walks the app's route table and
fails for a route that declares none, then calls every route as every role. docs/security.md has
the table this module encodes.

- **admin**: everything, every tenant; may submit on behalf of any tenant (body ``tenant``).
- **operator**: nodes, join tokens and tenants (weights, quotas, priority caps); reads every
  tenant's jobs; submits and cancels nothing.
- **member**: submits jobs for its own tenant, cancels and reads its tenant's jobs.
- **viewer**: reads its tenant's jobs.

A member or viewer asking for another tenant's job gets 404, as for a job that does not exist, so
job ids cannot be probed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class Role(StrEnum):
    admin = "admin"
    operator = "operator"
    member = "member"
    viewer = "viewer"


ALL_ROLES = frozenset(Role)
STAFF = frozenset({Role.admin, Role.operator})
"""Roles that see every tenant's jobs."""

BOOTSTRAP_ADMIN = "admin"
"""The name of the principal of TRAINYARD_ADMIN_TOKEN (no row; the name cannot be created)."""

USER_TOKEN_PREFIX = "tyt_"
"""API tokens of principals (``tyt_`` + 43 url-safe characters): recognizable by secret scanners."""
JOIN_TOKEN_PREFIX = "tyj_"
"""Bootstrap tokens for agents (control_plane/services/access/join_tokens.py)."""
NODE_TOKEN_PREFIX = "tyn_"
"""Node credentials (control_plane/services/cluster/nodes.py)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling, as its token says."""

    name: str
    tenant: str
    role: Role
    token_id: uuid.UUID | None = None
    """The API token used; None for the bootstrap admin token."""

    @property
    def is_admin(self) -> bool:
        return self.role is Role.admin

    @property
    def sees_all_tenants(self) -> bool:
        return self.role in STAFF

    def can_see(self, tenant: str) -> bool:
        return self.sees_all_tenants or tenant == self.tenant

    @property
    def tenant_filter(self) -> str | None:
        """The tenant a listing is limited to; None: every tenant."""
        return None if self.sees_all_tenants else self.tenant


Credential = Literal["none", "user", "node", "join"]


@dataclass(frozen=True)
class Policy:
    """What a route requires. ``tenant_scoped``: the route names a job, and a member or viewer of
    another tenant gets 404 for it."""

    name: str
    credential: Credential
    roles: frozenset[Role] = frozenset()
    tenant_scoped: bool = False
    description: str = ""

    def allows(self, role: Role) -> bool:
        return role in self.roles


def _policies(*items: Policy) -> dict[str, Policy]:
    return {p.name: p for p in items}


POLICIES: dict[str, Policy] = _policies(
    Policy("public", "none", description="anyone, no token (health checks)"),
    Policy("agent", "node", description="a node agent with its node credential"),
    Policy("agent.register", "join", description="a join token, or a node's own credential to register it again"),
    Policy("self", "user", ALL_ROLES, description="any principal, about itself (whoami, its own tokens)"),
    Policy("jobs.read", "user", ALL_ROLES, tenant_scoped=True, description="read jobs (members and viewers: "
           "their tenant's)"),
    Policy("jobs.submit", "user", frozenset({Role.admin, Role.member}), description="submit a job for one's tenant"),
    Policy("jobs.cancel", "user", frozenset({Role.admin, Role.member}), tenant_scoped=True,
           description="cancel a job (members: their tenant's)"),
    Policy("code.upload", "user", frozenset({Role.admin, Role.member}), description="upload code for one's "
           "tenant's jobs (trainyard run's workdir) and ask whether it is there"),
    Policy("plans.create", "user", ALL_ROLES, description="plan a model's layout (stores nothing; reads the "
           "links of the cluster's nodes of a GPU kind)"),
    Policy("simulations.create", "user", ALL_ROLES, description="run the goodput model (stores and reads nothing)"),
    Policy("metrics.read", "none", description="Prometheus metrics: no token, or TRAINYARD_METRICS_TOKEN (or the "
           "admin token) when it is set"),
    Policy("cluster.read", "user", ALL_ROLES, description="capacity and the queue (members and viewers see "
           "their tenant's queued jobs only)"),
    Policy("nodes.read", "user", STAFF, description="list and inspect nodes"),
    Policy("nodes.manage", "user", STAFF, description="cordon, drain, label, remove nodes"),
    Policy("join_tokens.manage", "user", STAFF, description="create, list, revoke agents' join tokens"),
    Policy("tenants.read", "user", STAFF, description="every tenant's share and usage"),
    Policy("tenants.manage", "user", STAFF, description="set a tenant's weight, quota and priority cap"),
    Policy("principals.manage", "user", frozenset({Role.admin}),
           description="create and disable principals, manage anyone's tokens"),
)


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise KeyError(f"no policy named {name!r}; declare it in control_plane/authz.py POLICIES") from None


def submit_tenant(principal: Principal, requested: str | None) -> str:
    """The tenant a job is submitted for: the principal's own. Only an admin may name another
    (submitting on behalf of a team); anyone else naming a different tenant is refused (ValueError,
    the caller's 403)."""
    if requested is None or requested == principal.tenant:
        return principal.tenant
    if principal.is_admin:
        return requested
    raise ValueError(f"principal {principal.name} belongs to tenant {principal.tenant!r} and cannot submit "
                     f"for tenant {requested!r}")


def check_priority(principal: Principal, priority: int, cap: int, tenant: str) -> None:
    """A job's priority may not exceed its tenant's cap (tenants.max_priority), except an admin's."""
    if priority > cap and not principal.is_admin:
        raise ValueError(f"priority {priority} is above tenant {tenant!r}'s max_priority {cap}; an operator "
                         "sets it with PUT /v1/tenants/{name}")


def new_token(prefix: str) -> str:
    """A fresh bearer secret: 256 bits, url-safe, with its kind's prefix."""
    return prefix + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """How tokens are stored: sha256 hex. The tokens are 256-bit random secrets, so a fast hash
    is enough (no password to stretch), and the lookup is one indexed equality."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets given as text. Compares UTF-8 bytes:
    ``hmac.compare_digest`` raises TypeError on str with non-ASCII characters (a 500 from a bad
    token otherwise)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))
