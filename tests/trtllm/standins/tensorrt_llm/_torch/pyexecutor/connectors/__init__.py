"""STAND-IN for ``tensorrt_llm._torch.pyexecutor.connectors`` (the module path of newer releases)."""
