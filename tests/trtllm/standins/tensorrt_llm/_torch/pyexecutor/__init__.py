"""STAND-IN for ``tensorrt_llm._torch.pyexecutor``."""
