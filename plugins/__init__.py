"""Plugins loaded by the broker (installed as ``msgq_trio.plugins``)."""
