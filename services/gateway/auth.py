"""Who is calling: the API key presented, checked against the configured one and hashed into a tenant id.

The raw key never leaves this process; the tenant id salts KV cache keys, so tenants never share cached prefixes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping


def presented_key(headers: Mapping[str, str]) -> str:
    """The key from `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic); "" if none."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


def authorized(key: str, required: str | None) -> bool:
    if required is None:
        return True
    return hmac.compare_digest(key.encode(), required.encode())  # constant time: no timing oracle


def tenant_of(key: str) -> str:
    if not key:
        return ""
    return hashlib.sha256(b"deepinfer-tenant\0" + key.encode()).hexdigest()[:32]
