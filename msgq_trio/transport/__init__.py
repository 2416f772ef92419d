"""Socket transport shared by the broker's I/O and every client driver: receive/send with
fd passing (:mod:`.sockets`) and the one OSError translation (:mod:`.errors`). Imports
trio and the sans-I/O protocol only, never the broker (io, core) or the clients."""
