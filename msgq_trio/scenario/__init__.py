"""scenario layer."""
