"""The output side's parser: generated text or token ids -> API-neutral events (reasoning, answer text, tool
calls as JSON argument deltas, stop sequences). See stream.py for the pipeline and stages.py for the grammar."""

from services.recipe.parse.detok import TokenPieces, TokenTable
from services.recipe.parse.stream import Event, OutputParser

__all__ = ["Event", "OutputParser", "TokenPieces", "TokenTable"]
