"""Types of the optional C extension ``_speedups.c`` (see framing.py, which uses it)."""

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

API: int

def init(
    frame: type[Any],
    run: type[Any],
    valid_mask: int,
    message_type: int,
    body_py: Callable[[Any], object],
    encode_small_bytes_py: Callable[[int, bytes, bytes, bytes], bytes],
    /,
) -> None: ...
def scan(
    buf: bytearray, pos: int, limit: int, source: bytes | None, out: list[Any], seen: int, /
) -> tuple[int, int, bool]: ...
def frame_body_method(frame: type[Any], /) -> Any: ...
def encode_small_bytes(type: int, target: bytes, payload: bytes, source: bytes) -> bytes: ...
def slot_maker(
    cls: Callable[..., _T], arg_slots: tuple[str, ...], fixed_slots: dict[str, object], /
) -> Callable[..., _T]: ...
def ready(value: _T, /) -> Awaitable[_T]: ...
def body_getter(
    cls: type[_T],
    frame_slot: str,
    decoded_slot: str,
    body_slot: str,
    fallback: Callable[[_T], object],
    /,
) -> Callable[[_T], object]: ...
def new_bytes(n: int, /) -> tuple[bytes, memoryview]: ...
def reuse_bytes(spares: list[Any], n: int, /) -> tuple[bytes, memoryview] | None: ...
