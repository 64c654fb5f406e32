"""The pickle-free format of what stages exchange during set-up: strict, typed JSON.

Set-up messages come from other processes, so decoding one must never run
code or build an arbitrary object (unpickling does both). A message is
UTF-8 JSON of a closed set of forms, each a JSON value or an object with
exactly one key that names its type::

    null, true/false, integers, finite floats, strings  as themselves
    {"bytes": "<hex>"}      {"tuple": [...]}      {"list": [...]}
    {"dict": [[key, value], ...]}                 (string keys, in order)
    {"dtype": "bfloat16"}                         (a torch dtype, by name)
    {"record": "TensorSpec", "fields": {...}}     (a registered type, below)

A record type is registered with one check per field
(:func:`register_record`); decoding builds it only from fields that pass
their checks, so a caller gets exactly the types it expects or a
:class:`WireFormatError` that says what was wrong. Sizes are bounded
(:data:`MAX_MESSAGE_NBYTES`, :data:`MAX_DEPTH`, integers within 64 bits).
Plain Python, unit-tested on the CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from syncless._core.errors import SynclessError

#: Largest encoded message (a set-up message is a few kilobytes).
MAX_MESSAGE_NBYTES = 1 << 20
#: Deepest nesting of lists, tuples, dicts and records.
MAX_DEPTH = 16
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # int64 and uint64 (addresses, handles' numbers)

Check = Callable[[Any], bool]


class WireFormatError(SynclessError, ValueError):
    """A set-up message could not be encoded, or what came back is not a valid message."""


class _Record(NamedTuple):
    cls: type
    fields: dict[str, tuple[Check, str]]  # field -> (check, what it must be)


_records: dict[str, _Record] = {}
_dtypes: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def register_record(cls: type, **fields: tuple[Check, str]) -> None:
    """Let instances of ``cls`` (a NamedTuple or frozen dataclass) cross, with one ``(check, description)`` per field.

    ``cls(**fields)`` must rebuild an instance. Registering the same class again replaces its checks.
    """
    _records[cls.__name__] = _Record(cls, dict(fields))


# Checks for record fields -------------------------------------------------------------


def is_int(value: Any) -> bool:
    return type(value) is int


def is_int_at_least(low: int) -> Check:
    return lambda value: type(value) is int and value >= low


def is_str(value: Any) -> bool:
    return type(value) is str


def is_bytes_of(nbytes: int) -> Check:
    return lambda value: type(value) is bytes and len(value) == nbytes


def is_optional(check: Check) -> Check:
    return lambda value: value is None or check(value)


def is_sequence_of(check: Check, most: int = 4096) -> Check:
    return lambda value: type(value) in (list, tuple) and len(value) <= most and all(check(v) for v in value)


def is_tuple_of(*checks: Check) -> Check:
    return lambda value: type(value) is tuple and len(value) == len(checks) and all(
        check(v) for check, v in zip(checks, value)
    )


def is_dtype(value: Any) -> bool:
    return isinstance(value, torch.dtype)


# Encoding ------------------------------------------------------------------------------


def encode(value: Any) -> bytes:
    """Return ``value`` as a message.

    Raises:
        WireFormatError: ``value`` holds something that cannot cross, or is too large.
    """
    data = json.dumps(_to_tree(value, 0), separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_MESSAGE_NBYTES:
        raise WireFormatError(f"a set-up message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_NBYTES}")
    return data


def _is_scalar(value: Any, depth: int) -> bool:
    """Whether ``value`` crosses as itself (None, bool, str, a 64-bit int, a finite float); checks depth and bounds.

    The same rule on both sides: what encode sends as a scalar, decode accepts as one.

    Raises:
        WireFormatError: too deep, an int beyond 64 bits, or a float that is not finite.
    """
    if depth > MAX_DEPTH:
        raise WireFormatError(f"a set-up message nests deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind is int and not _INT_MIN <= value <= _INT_MAX:
        raise WireFormatError(f"the integer {value} does not fit in 64 bits")
    if kind is float and not math.isfinite(value):
        raise WireFormatError(f"the float {value} is not finite (only finite floats cross)")
    return value is None or kind in (bool, str, int, float)


def _to_tree(value: Any, depth: int) -> Any:
    if _is_scalar(value, depth):
        return value
    kind = type(value)
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is list:
        return {"list": [_to_tree(v, depth + 1) for v in value]}
    if kind is tuple:
        return {"tuple": [_to_tree(v, depth + 1) for v in value]}
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise WireFormatError(f"only dicts with string keys can cross; got keys {list(value)[:5]!r}")
        return {"dict": [[k, _to_tree(v, depth + 1)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    record = _records.get(kind.__name__)
    if record is not None and record.cls is kind:
        return {"record": kind.__name__,
                "fields": {name: _to_tree(getattr(value, name), depth + 1) for name in record.fields}}
    raise WireFormatError(
        f"a value of type {kind.__qualname__} cannot cross in a set-up message "
        "(register it with syncless.pp._wire.register_record)"
    )


# Decoding ------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise WireFormatError(f"{name} is not allowed in a set-up message")


def decode(data: bytes) -> Any:
    """Rebuild the value of a message from :func:`encode`; never runs code from the message.

    Raises:
        WireFormatError: ``data`` is not a valid message (the error says what is wrong).
    """
    if len(data) > MAX_MESSAGE_NBYTES:
        raise WireFormatError(f"a set-up message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_NBYTES}")
    try:
        tree = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise WireFormatError(f"a set-up message is not valid JSON: {err}") from err
    return _from_tree(tree, 0)


def _from_tree(tree: Any, depth: int) -> Any:
    if _is_scalar(tree, depth):
        return tree
    kind = type(tree)
    if kind is not dict or len(tree) == 0:
        raise WireFormatError(f"unexpected {_describe(tree)} in a set-up message")
    form = next(iter(tree))
    body = tree[form]
    if form == "record":
        return _record_from_tree(tree, depth)
    if len(tree) != 1:
        raise WireFormatError(f"a {form!r} form has extra keys {sorted(tree)[:5]!r}")
    if form == "bytes" and type(body) is str:
        try:
            return bytes.fromhex(body)
        except ValueError as err:
            raise WireFormatError(f"a bytes value is not hexadecimal: {body[:40]!r}") from err
    if form in ("list", "tuple") and type(body) is list:
        items = [_from_tree(v, depth + 1) for v in body]
        return items if form == "list" else tuple(items)
    if form == "dict" and type(body) is list:
        out: dict[str, Any] = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or pair[0] in out:
                raise WireFormatError(f"a dict entry must be a [string key, value] pair with a new key; got "
                                      f"{_describe(pair)}")  # fmt: skip
            out[pair[0]] = _from_tree(pair[1], depth + 1)
        return out
    if form == "dtype" and type(body) is str:
        if body not in _dtypes:
            raise WireFormatError(f"{body[:40]!r} is not a torch dtype")
        return _dtypes[body]
    raise WireFormatError(f"unexpected {form[:40]!r} form holding {_describe(body)} in a set-up message")


def _record_from_tree(tree: dict[str, Any], depth: int) -> Any:
    name, fields = tree.get("record"), tree.get("fields")
    if sorted(tree) != ["fields", "record"] or type(name) is not str or type(fields) is not dict:
        raise WireFormatError(f"a record must be {{'record': name, 'fields': {{...}}}}; got keys {sorted(tree)[:5]!r}")
    record = _records.get(name)
    if record is None:
        raise WireFormatError(f"{name[:40]!r} is not a record type that can cross")
    if sorted(fields) != sorted(record.fields):
        raise WireFormatError(f"a {name} needs the fields {sorted(record.fields)}; got {sorted(fields)[:10]}")
    values = {}
    for field, (check, expected) in record.fields.items():
        value = _from_tree(fields[field], depth + 1)
        if not check(value):
            raise WireFormatError(f"{name}.{field} must be {expected}; got {_describe(value)}")
        values[field] = value
    return record.cls(**values)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"



def _register_set_up_records() -> None:
    """The record types of make_transport's own exchanges (the copy-engine set-up registers its export)."""
    from syncless.pp._eligibility import StageDevice
    from syncless.pp._layout import TensorSpec

    register_record(
        TensorSpec,
        dtype=(is_dtype, "a torch dtype"),
        row_shape=(lambda v: type(v) is tuple and is_sequence_of(is_int_at_least(0), 64)(v),
                   "a tuple of at most 64 integers >= 0"),
        max_rows=(is_int_at_least(0), "an integer >= 0"),
    )
    register_record(
        StageDevice,
        host=(is_str, "a host name"),
        uuid=(is_str, "a GPU UUID"),
        ordinal=(is_int_at_least(0), "a CUDA ordinal >= 0"),
    )


_register_set_up_records()
