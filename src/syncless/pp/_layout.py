"""Layouts of a stage's receive region, and validation of what a sender passes.

Plain Python over tensor metadata: no GPU work, so it is unit-tested on the CPU.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: Every tensor's slot in a region starts on this boundary (bytes). 256 is the
#: granularity cudaMalloc guarantees, so each slot is as aligned as a fresh
#: allocation and the copy engines move whole aligned bursts.
SLOT_ALIGN_BYTES = 256


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    """What one named tensor of a step looks like.

    Attributes:
        dtype: element type.
        row_shape: shape of one row (everything after the leading dimension).
        max_rows: the most rows a step may carry (the persistent tensor's leading dimension).
    """

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    max_rows: int

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row."""
        count = 1
        for extent in self.row_shape:
            count *= extent
        return count * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of ``max_rows`` rows."""
        return self.row_nbytes * self.max_rows

    def describe(self) -> str:
        """Return e.g. ``"torch.bfloat16 rows of (8192,), at most 256 rows"``."""
        return f"{self.dtype} rows of {self.row_shape}, at most {self.max_rows} rows"


@dataclass(frozen=True)
class Layout:
    """The byte layout of a receive region: one aligned slot per name, in a fixed order.

    Attributes:
        specs: name -> spec, in slot order (the order the receiver passed them).
        offsets: name -> byte offset of the slot within the region.
        nbytes: total bytes of the region (at least 1, so it can be allocated).
    """

    specs: dict[str, TensorSpec]
    offsets: dict[str, int]
    nbytes: int

    @property
    def names(self) -> list[str]:
        """Names in slot order."""
        return list(self.specs)

    @classmethod
    def from_specs(cls, specs: Mapping[str, TensorSpec]) -> Layout:
        """Lay ``specs`` out in order, each slot aligned to :data:`SLOT_ALIGN_BYTES`."""
        offsets: dict[str, int] = {}
        cursor = 0
        for name, spec in specs.items():
            cursor = _align_up(cursor, SLOT_ALIGN_BYTES)
            offsets[name] = cursor
            cursor += spec.nbytes
        return cls(dict(specs), offsets, max(_align_up(cursor, SLOT_ALIGN_BYTES), SLOT_ALIGN_BYTES))


#: The one word ``depth`` accepts besides a number: choose per step (``_auto``).
AUTO_DEPTH = "auto"
_DEPTH_WANTED = f'an int >= 0 (steps in flight per link) or "{AUTO_DEPTH}"'


def check_depth(depth: object) -> int | str:
    """Return ``depth`` as an int when it is a usable number of slots (an integer >= 0), or ``"auto"``.

    Raises:
        ValueError: ``depth`` is not an integer (bool included) nor exactly ``"auto"``, or is negative.
    """
    if isinstance(depth, str):
        if depth == AUTO_DEPTH:
            return AUTO_DEPTH
        raise ValueError(
            f"depth must be {_DEPTH_WANTED}; got {depth!r} (str): the only word it accepts is \"{AUTO_DEPTH}\", "
            "lower-case"
        )
    if isinstance(depth, bool):
        raise ValueError(f"depth must be {_DEPTH_WANTED}; got {depth!r}")
    try:
        value = operator.index(depth)
    except TypeError:
        raise ValueError(f"depth must be {_DEPTH_WANTED}; got {depth!r} ({type(depth).__name__})") from None
    if value < 0:
        raise ValueError(f"depth must be {_DEPTH_WANTED}; got {value}")
    return value


@dataclass(frozen=True)
class Ring:
    """``depth`` copies of a layout back to back: the slots that consecutive steps use in turn.

    Step N (1, 2, ...) uses slot ``(N - 1) % depth``. Each slot is
    ``layout.nbytes`` long, a multiple of :data:`SLOT_ALIGN_BYTES`, so every
    slot (and every tensor in it) is as aligned as slot 0.

    Attributes:
        layout: the layout of one slot.
        depth: how many slots (steps that may be in flight at once).
    """

    layout: Layout
    depth: int

    @property
    def stride(self) -> int:
        """Bytes from one slot's start to the next one's."""
        return self.layout.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of all ``depth`` slots."""
        return self.depth * self.layout.nbytes

    def slot(self, step: int) -> int:
        """Return the slot index step ``step`` (counted from 1) uses."""
        return (step - 1) % self.depth

    def slot_offset(self, slot: int) -> int:
        """Return the byte offset of slot ``slot`` from the ring's start."""
        if not 0 <= slot < self.depth:
            raise ValueError(f"slot must be in [0, {self.depth}); got {slot}")
        return slot * self.stride


def specs_from_persistent(persistent: Mapping[str, torch.Tensor] | None) -> dict[str, TensorSpec]:
    """Describe a receiver's preallocated tensors; check each is usable as a target.

    Raises:
        TypeError: ``persistent`` is not a mapping of str to Tensor.
        ValueError: a tensor is not a plain dense tensor (sparse, or a conjugate or negative view), has no
            leading (rows) dimension, or is not contiguous.
    """
    if persistent is None:
        return {}
    if not isinstance(persistent, Mapping):
        raise TypeError(f"persistent must be a dict of name -> Tensor (or None); got {type(persistent).__name__}")
    specs: dict[str, TensorSpec] = {}
    for name, tensor in persistent.items():
        if not isinstance(name, str):
            raise TypeError(f"persistent keys must be str; got {name!r} ({type(name).__name__})")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"persistent[{name!r}] must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(
                f"persistent[{name!r}] must be a dense (strided) tensor, the receive target of a step; got "
                f"layout {tensor.layout}: allocate it with torch.empty (or alloc_persistent)"
            )
        if tensor.dim() < 1:
            raise ValueError(f"persistent[{name!r}] needs a leading rows dimension; got a 0-d tensor")
        if tensor.is_conj() or tensor.is_neg():
            # A receive writes the raw bytes: a conjugate or negative view would read them back conjugated or
            # negated (gloo), or torch refuses to receive into it at the first recv().
            kind, read = ("conjugate", "conjugated") if tensor.is_conj() else ("negative", "negated")
            raise ValueError(
                f"persistent[{name!r}] is a {kind} view (its memory is {read} on every read), which a receive "
                "cannot write: pass the plain tensor it views, or allocate one with torch.empty (or "
                "alloc_persistent)"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"persistent[{name!r}] must be contiguous (rows are copied as one block); "
                f"got strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
            )
        specs[name] = TensorSpec(tensor.dtype, tuple(int(d) for d in tensor.shape[1:]), int(tensor.shape[0]))
    return specs


def persistent_device(persistent: Mapping[str, torch.Tensor] | None) -> torch.device | None:
    """Return the one device every persistent tensor is on (None when there are none).

    Raises:
        ValueError: the tensors are on different devices.
    """
    devices = {name: t.device for name, t in (persistent or {}).items()}
    unique = set(devices.values())
    if len(unique) > 1:
        listing = ", ".join(f"{name}: {dev}" for name, dev in devices.items())
        raise ValueError(f"every persistent tensor must be on one device; got {listing}")
    return next(iter(unique)) if unique else None


def validate_step(
    specs: Mapping[str, TensorSpec], tensors: object, device: torch.device, next_stage: str
) -> dict[str, int]:
    """Check one step's tensors against the next stage's layout; return name -> row count (sent keys only).

    A step may carry any subset of the layout's keys (the receiver gets
    exactly those). Called before any GPU work, so a bad step leaves the
    transport untouched.

    Raises:
        TypeError: ``tensors`` is not a dict of str -> Tensor.
        ValueError: a key is not in the layout, a tensor is not dense (sparse), or its dtype, row shape,
            row count or device does not fit; the message names the key, what
            was expected and what came.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"send() takes a dict of name -> Tensor; got {type(tensors).__name__}")
    unknown = sorted(set(tensors) - set(specs), key=str)
    if unknown:
        raise ValueError(
            f"send() keys do not match {next_stage}'s layout: it has {sorted(specs)} (a step may carry any subset "
            f"of them); unknown {unknown}"
        )
    rows: dict[str, int] = {}
    for name, spec in specs.items():
        if name not in tensors:
            continue
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send()[{name!r}] must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(
                f"send()[{name!r}]: expected a dense (strided) tensor, got layout {tensor.layout}: send "
                "t.to_dense()"
            )
        if tensor.dtype != spec.dtype:
            raise ValueError(f"send()[{name!r}]: expected dtype {spec.dtype}, got {tensor.dtype}")
        if tensor.dim() < 1 or tuple(tensor.shape[1:]) != spec.row_shape:
            raise ValueError(
                f"send()[{name!r}]: expected shape (rows, *{spec.row_shape}), got {tuple(tensor.shape)}"
            )
        count = int(tensor.shape[0])
        if count > spec.max_rows:
            raise ValueError(f"send()[{name!r}]: expected at most {spec.max_rows} rows, got {count}")
        if tensor.device != device:
            raise ValueError(f"send()[{name!r}]: expected a tensor on {device}, got one on {tensor.device}")
        rows[name] = count
    return rows


#: The row count a step's metadata carries for a key the step did not send (the receiver leaves it out).
ABSENT = -1


def sent_rows(rows: Sequence[int]) -> list[int]:
    """Row counts to move: :data:`ABSENT` (a key not sent) moves nothing, like 0 rows."""
    return [count if count > 0 else 0 for count in rows]


def rows_are_valid(rows: Sequence[int], specs: Mapping[str, TensorSpec]) -> bool:
    """Whether a step's metadata row counts (one per layout key, :data:`ABSENT` allowed) fit the layout."""
    return len(rows) == len(specs) and all(
        ABSENT <= count <= spec.max_rows for count, spec in zip(rows, specs.values())
    )


def received_views(persistent: Mapping[str, torch.Tensor], names: Sequence[str],
                   rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """The views a receiver returns: the first ``rows`` rows of each key the step carried (absent keys left out)."""
    return {name: persistent[name][:count] for name, count in zip(names, rows) if count != ABSENT}


def dense_spans(row_nbytes: Sequence[int], rows: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """Place one step's rows densely in a slot: ``([(offset, nbytes) per tensor], end)``.

    Tensors follow each other in layout order, each starting on the next
    :data:`SLOT_ALIGN_BYTES` boundary after the previous one's rows (a tensor
    with no rows takes no bytes). ``end`` is where the last tensor's rows end
    (0 for an empty step): one copy of ``[0, end)`` moves the whole step.
    Sender and receiver call this with the same row counts (the receiver's
    come in the step's metadata), so they agree on every offset. With every
    count at most its tensor's ``max_rows``, each offset is at most that
    tensor's offset in :meth:`Layout.from_specs`, so the step fits its slot.
    """
    spans: list[tuple[int, int]] = []
    cursor = end = 0
    for size, count in zip(row_nbytes, rows):
        nbytes = size * count if count > 0 else 0  # ABSENT (-1): a key not sent takes no bytes
        spans.append((cursor, nbytes))
        if nbytes:
            end = cursor + nbytes
            cursor = _align_up(end, SLOT_ALIGN_BYTES)
    return spans, end


class StepCheck:
    """:func:`validate_step` with the per-name expectations worked out once; same errors, same result.

    :meth:`rows` runs every check in one pass over precomputed tuples. When a
    check fails (or the input is not a plain ``dict``) it calls
    :func:`validate_step`, which raises the full message; so the fast path
    only ever accepts what ``validate_step`` accepts.
    """

    def __init__(self, specs: Mapping[str, TensorSpec], device: torch.device, next_stage: str):
        self.specs = dict(specs)
        self.device = device
        self.next_stage = next_stage
        self._expect = [(name, spec.dtype, torch.Size(spec.row_shape), spec.max_rows) for name, spec in specs.items()]

    def rows(self, tensors: object) -> list[int]:
        """Return the row count of each layout key, in layout order (:data:`ABSENT` for a key not sent).

        Raises:
            TypeError, ValueError: as :func:`validate_step`.
        """
        if type(tensors) is dict:
            device = self.device
            strided = torch.strided
            counts: list[int] = []
            found = 0
            for name, dtype, row_shape, max_rows in self._expect:
                tensor = tensors.get(name)
                if tensor is None:
                    counts.append(ABSENT)
                    continue
                if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.layout != strided:
                    break
                shape = tensor.shape
                if not shape or shape[1:] != row_shape or shape[0] > max_rows or tensor.device != device:
                    break
                counts.append(shape[0])
                found += 1
            else:
                if found == len(tensors):  # every key sent is one of the layout's
                    return counts
        checked = validate_step(self.specs, tensors, self.device, self.next_stage)
        return [checked.get(name, ABSENT) for name in self.specs]
