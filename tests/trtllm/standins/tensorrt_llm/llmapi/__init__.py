"""STAND-IN for ``tensorrt_llm.llmapi``."""
