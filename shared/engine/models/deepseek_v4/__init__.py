"""DeepSeek-V4: spec, two-tier cache, forward."""

from shared.engine.models.deepseek_v4.model import DeepseekV4

__all__ = ["DeepseekV4"]
