"""The output side's API emitters and the per-request driver (processor.py): parser events -> Chat
Completions / Anthropic Messages / Responses / Completions stream events and complete responses."""

from services.recipe.emit.base import Finish, StreamEvent, Usage, sse
from services.recipe.emit.processor import Chunk, End, OutputProcessor, Ready, Text, Tokens

__all__ = ["Chunk", "End", "Finish", "OutputProcessor", "Ready", "StreamEvent", "Text", "Tokens", "Usage", "sse"]
