"""Exceptions a KV-store user catches. A miss is never an exception: it is `None` or a count."""

from __future__ import annotations


class KvStoreError(Exception):
    """Base of every store failure; a worker catches it and recomputes the KV instead."""


class KvStoreUnavailable(KvStoreError):
    """The backend (Redis, ...) cannot be reached or did not answer within its timeout."""
