"""STAND-IN for ``tensorrt_llm.bindings.internal``."""
