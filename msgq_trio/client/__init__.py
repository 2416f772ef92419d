"""Client libraries: the trio ``Bus`` and the synchronous wrapper."""
