"""pagedq: a queue-native LLM inference worker.

The code lives in three top-level folders installed as subpackages:
``pagedq.client`` (SDK, no torch), ``pagedq.worker`` (engine + service) and ``pagedq.kernels``.
"""

from pagedq import checkout_names

checkout_names.install()

__version__ = "0.1.0"
