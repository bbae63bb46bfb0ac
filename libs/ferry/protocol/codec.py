"""msgpack codec for ferry messages, validated on decode.

Wire form of every message: a msgpack array `[version, type_tag, {field: value, ...}]`.
Nested messages are msgpack maps of their fields. Decoding checks the version, the tag, that every
required field is present and that every field has its declared type; anything else raises
`ProtocolError` naming the problem (`SubmitRequest.sampling.top_p: expected float, got str`).
Unknown fields are ignored so that a newer sender can add optional fields without breaking older
receivers; a field is only ever added with a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union, overload

import msgpack

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a bus message is small; block bytes never travel on NATS

T = TypeVar("T")

_EXACT_SCALARS = (int, str, bytes, bool)
"""Item types whose lists are accepted as they are when every item has exactly that type (so no
bool passes as an int); anything else takes the item-by-item check, which names the bad index."""

_REGISTRY: dict[str, type] = {}
_TAGS: dict[type, str] = {}
_HINTS: dict[type, dict[str, Any]] = {}


class ProtocolError(ValueError):
    """Bytes that are not a valid ferry message. The text names the exact problem."""


def message(tag: str):
    """Class decorator: register a dataclass as a top-level message type with its wire tag."""

    def register(cls: type[T]) -> type[T]:
        assert dataclasses.is_dataclass(cls), cls
        assert tag not in _REGISTRY, f"duplicate message tag {tag!r}"
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return register


def message_types() -> dict[str, type]:
    """Every registered message type, by wire tag."""
    return dict(_REGISTRY)


def encode(msg: Any) -> bytes:
    """Serialize a registered message to its msgpack wire form."""
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered ferry message")
    return msgpack.packb([PROTOCOL_VERSION, tag, _to_wire(msg)], use_bin_type=True)


@overload
def decode(data: bytes) -> object: ...
@overload
def decode(data: bytes, expected: type[T]) -> T: ...
@overload
def decode(data: bytes, expected: None) -> object: ...


def decode(data: bytes, expected: type[T] | None = None) -> Any:
    """Parse and validate wire bytes. With `expected`, any other message type is an error."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, list) or len(raw) != 3:
        raise ProtocolError("not a ferry message: expected [version, type, fields]")
    version, tag, fields = raw
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this is {PROTOCOL_VERSION})")
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    if expected is not None and cls is not expected:
        raise ProtocolError(f"expected {expected.__name__}, got {cls.__name__}")
    return _from_wire(cls, fields, cls.__name__)


def _to_wire(msg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if dataclasses.is_dataclass(value):
            value = _to_wire(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [_to_wire(v) for v in value]
        out[f.name] = value
    return out


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _from_wire(cls: type[T], fields: Any, path: str) -> T:
    if not isinstance(fields, dict):
        raise ProtocolError(f"{path}: expected a map of fields, got {_kind(fields)}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # T: a registered message dataclass
        if f.name not in fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{path}.{f.name}: missing required field")
            continue
        kwargs[f.name] = _check(fields[f.name], hints[f.name], f"{path}.{f.name}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ range checks
        raise ProtocolError(f"{path}: {exc}") from None


def _check(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, path)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{path}: expected a list, got {_kind(value)}")
        (item,) = typing.get_args(hint)
        if item in _EXACT_SCALARS and all(type(v) is item for v in value):
            return value  # token ids, hashes: one pass, no per-item path string (the hot case)
        return [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{path}: expected a map, got {_kind(value)}")
        _, item = typing.get_args(hint)
        return {k: _check(v, item, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _from_wire(hint, value, path)
    return _check_scalar(value, hint, path)


def _check_scalar(value: Any, hint: Any, path: str) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise ProtocolError(f"{path}: expected int, got bool")
    if hint is Any or isinstance(value, hint):
        return value
    raise ProtocolError(f"{path}: expected {hint.__name__}, got {_kind(value)}")


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__
