"""trioserve: an OpenAI-compatible LLM inference server on trio."""

__version__ = "0.1.0"
