"""Placeholder: the Redis fixture lands with the queue worker."""
