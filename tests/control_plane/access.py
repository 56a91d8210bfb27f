"""Principals of every role for API tests, made through the real API."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.testclient import TestClient

from tests.factories import ADMIN


@dataclass(frozen=True)
class Caller:
    name: str
    role: str
    tenant: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def make_principal(client: TestClient, name: str, role: str, tenant: str) -> Caller:
    r = client.post("/v1/principals", json={"name": name, "tenant": tenant, "role": role}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return Caller(name, role, tenant, r.json()["token"])


def team(client: TestClient, tenant: str, prefix: str | None = None) -> dict[str, Caller]:
    """An admin, an operator, a member and a viewer; the last two of ``tenant``."""
    p = prefix or tenant
    return {role: make_principal(client, f"{p}-{role}", role, tenant) for role in ("admin", "operator", "member",
                                                                                 "viewer")}
