"""How deeply client JSON may nest, and the check: one limit for every service that reads client bodies.

Every walk over client JSON (schema checks, strict normalization, renderers, serializers) is recursive, and
Python's recursion limit (1,000 frames) is reached long before orjson's own (1,024 levels, a parse error). A body
nested deeper than `MAX_JSON_DEPTH` is refused where it arrives (the gateway, the recipe), so no walk after it
can overflow: each level of JSON costs a walk at most a few frames.
"""

from __future__ import annotations

from typing import Any

# Deep enough for any real tool or response schema (OpenAI allows 10 levels of nesting in a strict schema,
# each level two JSON levels: "properties" -> name -> schema), shallow enough for every walk.
MAX_JSON_DEPTH = 64


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` nests arrays and objects more than `limit` levels deep (a scalar is level 0).
    Iterative, so it cannot overflow itself; stops at the first branch past the limit."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def depth_message(limit: int = MAX_JSON_DEPTH) -> str:
    return f"the request nests arrays and objects more than {limit} levels deep"
