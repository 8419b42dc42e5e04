"""STAND-IN for ``tensorrt_llm._torch`` (the PyTorch backend)."""
