"""STAND-IN for the few ``tensorrt_llm`` names a KV cache connector imports. Tests only.

TensorRT-LLM cannot be installed on these machines (its PyPI package is a stub that downloads
from NVIDIA's own index), so the connector tests put ``tests/trtllm/standins`` on ``sys.path``
(``tests/trtllm/conftest.py``) and import this package instead. It is written here from
TensorRT-LLM's public interface (module paths, class names, method names, signatures); it is not
TensorRT-LLM code and implements none of its runtime. ``tests/trtllm/TRTLLM_API.md`` cites the
TensorRT-LLM commits each name follows.
"""
import logging

#: Lets a test assert that it runs against the stand-in, not a real TensorRT-LLM.
__standin__ = True

#: ``tensorrt_llm.logger`` (a logger object with ``info``/``warning``/``error``/``debug``).
logger = logging.getLogger("tensorrt_llm.standin")
