"""Queue storage backends behind a small synchronous interface.

Installed as ``msgq_trio.storage``; import it under that name. ``api`` holds the contract
(``QueueStore`` and its types and errors), ``memory`` the reference backend and
``lmdb_store`` the durable one.
"""

from .api import (
    MAX_NAME_BYTES,
    NewMessage,
    QueueStats,
    QueueStore,
    StorageClosed,
    StorageCorrupt,
    StorageError,
    StorageFull,
    StoredMessage,
    UnknownQueue,
)
from .lmdb_store import LmdbQueueStore
from .memory import MemoryQueueStore

__all__ = [
    "MAX_NAME_BYTES",
    "LmdbQueueStore",
    "MemoryQueueStore",
    "NewMessage",
    "QueueStats",
    "QueueStore",
    "StorageClosed",
    "StorageCorrupt",
    "StorageError",
    "StorageFull",
    "StoredMessage",
    "UnknownQueue",
]
