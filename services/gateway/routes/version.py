"""GET /version, as vLLM answers it: {"version": the installed package's version}."""

from __future__ import annotations

from functools import cache
from importlib import metadata

import orjson
from aiohttp import web

from services.gateway.errors import json_response

PACKAGE = "deepinfer-mesh"  # pyproject.toml's project name


@cache
def package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def version(request: web.Request) -> web.Response:
    return json_response(200, orjson.dumps({"version": package_version()}))
