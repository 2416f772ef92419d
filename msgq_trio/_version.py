"""The package version, in a module of its own so the broker daemon (msgq_trio.io) can
name it without importing the package face (which imports the clients)."""

__version__ = "0.1.0"
