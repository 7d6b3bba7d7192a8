"""API adapters by the name the gateway puts in `PrepareRequest.api`. A new API is one module and one entry."""

from __future__ import annotations

from services.recipe.apis.anthropic_messages import AnthropicMessages
from services.recipe.apis.base import Api, ChatRequest, Finish, ResponseWriter, Usage
from services.recipe.apis.errors import ApiError, openai_error
from services.recipe.apis.openai_chat import OpenAIChat

APIS: dict[str, Api] = {api.name: api for api in (OpenAIChat(), AnthropicMessages())}

__all__ = ["APIS", "Api", "ApiError", "ChatRequest", "Finish", "ResponseWriter", "Usage", "openai_error"]
