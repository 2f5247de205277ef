"""``pagedq serve``: the OpenAI HTTP API in front of the queue.

The gateway runs no model. Every HTTP request becomes a queue job and its answer is read
from the job's output stream, so gateways and workers scale apart and a worker dying
mid-answer is invisible to the HTTP client (another worker continues the same stream).
FastAPI is imported only by the modules that serve HTTP, so ``pagedq --help`` stays light.
"""
