"""pagedq: a queue-native LLM inference worker.

The code lives in three top-level folders installed as subpackages:
``pagedq.client`` (SDK, no torch), ``pagedq.worker`` (engine + service) and ``pagedq.kernels``.
"""

__version__ = "0.1.0"
