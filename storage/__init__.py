"""Queue storage backends behind a small synchronous interface (installed as ``msgq_trio.storage``)."""
