"""Socket transport shared by the broker's I/O and every client driver: receive/send with
fd passing (:mod:`.sockets`, trio), its trio-free helpers (:mod:`.fdpass`, for the
asyncio driver too) and the one OSError translation (:mod:`.errors`). Imports trio and
the sans-I/O protocol only, never the broker (io, core) or the clients."""
