"""The CPU side of a pipeline group: stage order, agreement on set-up outcomes, timed messages.

Every collective step of set-up goes through :func:`agree`: each rank runs its
local part, then all ranks exchange "ok" or the error over the CPU (gloo)
group, and every rank leaves with the same outcome. A failure on one rank thus
becomes the same exception on every rank, and no rank waits for a peer that
already gave up.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from syncless._core.errors import (
    CopyEngineUnavailable,
    CudaError,
    MissingDependencyError,
    PeerTimeoutError,
    TransportSetupError,
)
from syncless._core.logs import log_once
from syncless.pp import _wire as wire

logger = logging.getLogger(__name__)

#: The torch.distributed transport's tags: this one carries metadata, the next one data. One value serves
#: every transport: each has a side group of its own (``cpu_group``) for its gloo traffic, and NCCL ignores tags.
TRANSPORT_TAG = 1000


@dataclass(frozen=True)
class StageMap:
    """Where this process sits in the pipeline.

    Attributes:
        ranks: global ranks in pipeline order.
        index: this process's stage index.
    """

    ranks: tuple[int, ...]
    index: int

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the stage this one receives from (None for the first stage)."""
        return self.ranks[self.index - 1] if self.index > 0 else None

    @property
    def next_rank(self) -> int | None:
        """Global rank of the stage this one sends to (None for the last stage)."""
        return self.ranks[self.index + 1] if self.index + 1 < len(self.ranks) else None

    def name(self, index: int | None = None) -> str:
        """Return e.g. ``"stage 1 (rank 3)"``."""
        i = self.index if index is None else index
        return f"stage {i} (rank {self.ranks[i]})"


#: A source location in a torch or gloo error (``[/__w/pytorch/pytorch/third_party/gloo/.../pair.cc:553] ``):
#: the build machine's path, of no use to whoever reads the error.
_SOURCE_LOCATION = re.compile(r"\[(?:[A-Za-z]:)?[/\\][^\]\s]*:\d+\]\s*")


def peer_error_text(err: BaseException) -> str:
    """The text of a torch.distributed (gloo) error without the source locations it embeds."""
    return _SOURCE_LOCATION.sub("", str(err)).strip()


def resolve_stages(group_ranks: Sequence[int], my_rank: int, stage_ranks: Sequence[int] | None) -> StageMap:
    """Check ``stage_ranks`` against the group and locate ``my_rank``.

    Raises:
        TypeError: ``stage_ranks`` is not a sequence of ints.
        ValueError: the stage list is not a permutation of the group's ranks, has fewer than two
            stages, does not contain ``my_rank``, or names several ranks for one stage (tensor
            parallelism: one transport per TP rank instead).
    """
    group_sorted = sorted(int(r) for r in group_ranks)
    if stage_ranks is None:
        order = tuple(group_sorted)
    else:
        if isinstance(stage_ranks, (str, bytes)) or not isinstance(stage_ranks, Sequence):
            raise TypeError(f"stage_ranks must be a list of global ranks, one per stage; got {stage_ranks!r:.80}")
        several = [r for r in stage_ranks if isinstance(r, (Sequence, set, frozenset)) and not isinstance(r, str)]
        if several:
            raise ValueError(
                f"stage_ranks lists one global rank per stage; got {several[0]!r} for one stage. A stage with "
                "several ranks (tensor parallelism) is not one transport: build one per tensor-parallel rank, "
                "over the pipeline group of that rank (the ranks with the same TP index in every stage); "
                "docs/pp.md: tensor and pipeline parallelism"
            )
        try:
            order = tuple(operator.index(r) for r in stage_ranks)
        except TypeError:
            raise TypeError(f"stage_ranks must hold ints (global ranks); got {list(stage_ranks)!r:.80}") from None
        if sorted(order) != group_sorted:
            raise ValueError(
                f"stage_ranks must list each rank of the group exactly once; expected a permutation of "
                f"{group_sorted}, got {list(order)}"
            )
    if len(order) < 2:
        raise ValueError(f"a pipeline needs at least two stages; the group has ranks {group_sorted}")
    if my_rank not in order:
        raise ValueError(f"this process (rank {my_rank}) is not one of the stages {list(order)}")
    return StageMap(order, order.index(my_rank))


def cpu_group(ranks: Sequence[int], timeout_s: float) -> Any:
    """Create a private gloo group over ``ranks`` for one transport; collective over ``ranks``.

    The transports never use the caller's own group for CPU messages: gloo
    closes a connection whose receive timed out, and a timeout must break
    only syncless's group, never the caller's. Its gloo timeout is
    ``timeout_s``, which bounds every set-up exchange too.

    Every ``make_transport`` makes a new one, and none is cached or reused:
    after a failure one rank may know its group is broken while another does
    not, and a cache would then hand one rank the broken group and the other
    a new one (whose rendezvous waits for a peer that never comes). Its name
    (:func:`side_group_name`) comes from the ranks and how many private
    groups over exactly these ranks this process has made in this world, so
    the stages agree on it whatever other groups each holds (a link back
    over the end stages only, the caller's own groups). A name is never
    given twice: a destroyed group's stays registered
    (:func:`release_cpu_group`), and so does one whose rendezvous failed.
    Blocks the host for the rendezvous (a few milliseconds over the store;
    at most ``timeout_s``, plus the store's own polling).

    Raises:
        PeerTimeoutError: some stage did not join within ``timeout_s`` (it died or never called
            ``make_transport``, or made a different number of transports over these ranks).
    """
    members = sorted(int(r) for r in ranks)
    name = side_group_name(members)
    try:
        return _new_side_group(members, name, timeout_s)
    except RuntimeError as err:  # torch's store and gloo errors (DistStoreError, "Wait timeout", ...)
        _retire_name(name)  # its rendezvous keys may be in the store: the next group gets the next name
        raise PeerTimeoutError(
            f"make_transport: ranks {members} did not all join this transport's private gloo group within "
            f"{timeout_s:g} s: a stage died or has not called make_transport (every stage of a transport must "
            f"have made as many transports over these ranks before), or is only slow (raise timeout_s): "
            f"{peer_error_text(err)}"
        ) from err


#: Every private group's name starts so (torch's own names are counters and SHA-1 digests).
SIDE_GROUP_PREFIX = "syncless_pp"


def side_group_name(members: Sequence[int]) -> str | None:
    """Name the next private group over ``members`` (ascending global ranks), e.g. ``"syncless_pp:0,2:1"``.

    The last field counts the private groups over exactly these ranks already registered in this
    world (torch clears its registry when the world is destroyed): the same on every stage that made
    the same transports over these ranks, whatever else it holds. (torch's own name for such a group
    counts every group the process holds, which differs once a link back made groups on the end stages
    only.) None on a torch whose registry is not the dict this relies on.
    """
    names = _group_names()
    if names is None:
        return None
    base = f"{SIDE_GROUP_PREFIX}:{','.join(map(str, members))}:"
    made = sum(1 for name in names.values() if isinstance(name, str) and name.startswith(base))
    return f"{base}{made}"


def _new_side_group(members: list[int], name: str | None, timeout_s: float) -> Any:
    """Make the gloo group ``name`` over ``members`` as ``new_group`` does, but under that name.

    ``new_group`` takes no name; its private helper does (torch 2.11 to 2.13 share its first six
    parameters), and the group's rendezvous keys then live under ``name`` in the default store. Without
    the helper (or a name) it falls back to ``new_group(use_local_synchronization=True)``, logged once.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    helper = getattr(c10d, "_new_process_group_helper", None)
    world = getattr(c10d, "_world", None)
    if name is None or helper is None or not isinstance(getattr(world, "pg_group_ranks", None), dict):
        log_once(logger, logging.WARNING, "pp-side-group-names",
                 "syncless.pp: this torch has no private group helper or registry of group names that syncless "
                 "knows; the private gloo groups get torch's own names, which agree between stages only if "
                 "every stage holds the same groups (a link back over the end stages breaks that)")
        return dist.new_group(ranks=members, backend="gloo", timeout=timeout, use_local_synchronization=True)
    store = world.pg_map[c10d._get_default_group()][1]
    group, _ = helper(len(members), members.index(dist.get_rank()), members, dist.Backend("gloo"), store, name,
                      timeout=timeout)
    world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(members)}
    return group


def _retire_name(name: str | None) -> None:
    """Keep ``name`` taken in torch's registry of group names (a failed rendezvous registered nothing)."""
    names = _group_names()
    if name is not None and names is not None and name not in names.values():
        names[_RetiredName(name)] = name


class _RetiredName:
    """Holds a destroyed side group's name in torch's registry of group names, so it is never given again.

    A private group's rendezvous keys in the store live under its name (:func:`side_group_name`), which
    counts the names registered over its ranks. Destroying a group would give its name, and its stale
    keys, to the next group over the same ranks (measured: ``Gloo connectFullMesh failed ... Connection
    refused``). torch calls ``shutdown()`` or ``abort()`` on every registered name when the world is
    destroyed.
    """

    def __init__(self, name: str):
        self.name = name

    def shutdown(self) -> None:
        """Nothing to shut down: the group itself is gone."""

    def abort(self) -> None:
        """Nothing to abort: the group itself is gone."""


def _group_names() -> dict[Any, str] | None:
    """torch's registry of process-group names (a dict in torch 2.11 to 2.13), or None if it is not one."""
    from torch.distributed import distributed_c10d

    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    return names if type(names) is dict else None


def release_cpu_group(side_group: Any, what: str) -> None:
    """Destroy a transport's private gloo group (its threads and sockets); local, no collective.

    Its name stays taken (:class:`_RetiredName`), so the stages' later groups get the same fresh names
    whichever stage destroyed first. Does nothing when torch.distributed was torn down already
    (``destroy_process_group()`` destroyed it with the rest), when the group is gone, or on a torch
    whose registry of names is not the dict this relies on (the group is then kept, as before). A
    failure is logged, never raised: it runs at the end of ``close()`` and on a failed set-up, whose
    own error must not be masked. Blocks the host while gloo joins the group's threads. Not for a
    signal handler (``abort()`` leaves it to ``close()``).
    """
    import torch.distributed as dist

    if side_group is None or not dist.is_available() or not dist.is_initialized():
        return
    names = _group_names()
    if names is None or side_group not in names:
        return
    name = names[side_group]
    try:
        dist.destroy_process_group(side_group)
    except (RuntimeError, ValueError, KeyError) as err:  # ValueError: no longer registered
        logger.debug("%s: destroying the private gloo group: %s", what, err)
        return
    names.setdefault(_RetiredName(name), name)


# Uniform outcomes ---------------------------------------------------------------

#: Errors that mean "the copy-engine transport cannot be used here". Any other
#: error is still shared (so no rank hangs) but is raised as itself, not
#: turned into a fallback that could hide a bug.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (CopyEngineUnavailable, CudaError, MissingDependencyError)


def _status_of(err: BaseException | None) -> tuple[str, str] | None:
    if err is None:
        return None
    if isinstance(err, UNAVAILABLE_ERRORS):
        kind = "unavailable"
    elif isinstance(err, (ValueError, TypeError)):
        kind = type(err).__name__
    else:
        kind = "error"
    return kind, f"{type(err).__name__}: {err}" if kind == "error" else str(err)


def first_failure(statuses: Sequence[tuple[str, str] | None], stages: StageMap, what: str) -> BaseException | None:
    """Turn every stage's status into the one exception all ranks raise (None if all are ok).

    The first failing stage in pipeline order wins, so the message is the
    same on every rank.
    """
    for index, status in enumerate(statuses):
        if status is None:
            continue
        kind, text = status
        message = f"{what} failed on {stages.name(index)}: {text}"
        if kind == "unavailable":
            return CopyEngineUnavailable(message)
        if kind == "ValueError":
            return ValueError(message)
        if kind == "TypeError":
            return TypeError(message)
        return TransportSetupError(message)
    return None


def agree(
    side_group: Any,
    stages: StageMap,
    what: str,
    local: Callable[[], Any],
    check: tuple[Callable[[Any], bool], str] | None = None,
) -> list[Any]:
    """Run ``local`` here, share its outcome with every stage, and raise the first failure everywhere.

    Returns the list of every stage's result (in pipeline order) when all
    succeeded. Results cross in the pickle-free format of
    :mod:`~syncless.pp._wire` (what ``local`` returns must be made of the
    types it lists), so a peer's message can never run code here, and
    records come back with every field checked. Each stage's result must
    also pass ``check`` (``(predicate, what it must be)``), by default:
    have the type of this stage's own result (for tuples, item by item).
    Blocks the host for two all-gathers over ``side_group`` (the lengths,
    then the messages padded to the longest).

    Raises:
        CopyEngineUnavailable: some stage found the copy-engine path unusable.
        ValueError, TypeError: some stage was given bad arguments.
        RuntimeError: some stage failed otherwise (the message names it and its error), or sent a
            message that is not valid (every stage received the same bytes, so every stage raises).
        PeerTimeoutError: the exchange itself failed (a peer died or never came).
    """
    error: BaseException | None = None
    result: Any = None
    try:
        result = local()
    except Exception as err:  # noqa: BLE001 - shared with every rank below, then re-raised; nothing is hidden
        error = err
    me = stages.ranks[stages.index]
    status = _bounded(_status_of(error))
    try:
        message = wire.encode({"rank": me, "status": status, "value": None if error is not None else result})
    except wire.WireFormatError as err:  # a result that cannot cross is this stage's failure, shared as any other
        error = err
        message = wire.encode({"rank": me, "status": _bounded(_status_of(err)), "value": None})
    messages = _all_gather_bytes(side_group, message, len(stages.ranks), what)
    from_rank = dict(zip(sorted(stages.ranks), messages))  # the side group numbers its ranks in ascending order
    for rank in stages.ranks:  # a length out of bounds first: the others' messages were not fetched then
        if from_rank[rank] is None:
            _read_outcome(None, rank, stages, what)
    by_rank = {rank: _read_outcome(from_rank[rank], rank, stages, what) for rank in stages.ranks}
    statuses = [by_rank[rank][0] for rank in stages.ranks]
    failure = first_failure(statuses, stages, what)
    if failure is not None:
        if error is not None:
            raise failure from error
        raise failure
    predicate, expected = check or (lambda value: _same_shape(value, result), _shape_of(result))
    for index, rank in enumerate(stages.ranks):
        if not predicate(by_rank[rank][1]):
            raise RuntimeError(
                f"{what}: {stages.name(index)} sent a set-up result syncless cannot accept: it must be {expected}; "
                f"got {by_rank[rank][1]!r:.120}"
            )
    return [by_rank[rank][1] for rank in stages.ranks]


def _same_shape(value: Any, mine: Any) -> bool:
    if type(value) is not type(mine):
        return False
    if type(mine) is tuple:
        return len(value) == len(mine) and all(_same_shape(v, m) for v, m in zip(value, mine))
    return True


def _shape_of(mine: Any) -> str:
    if type(mine) is tuple:
        return "(" + ", ".join(_shape_of(m) for m in mine) + ")"
    return "None" if mine is None else f"a {type(mine).__name__}"


def _all_gather_bytes(side_group: Any, message: bytes, world: int, what: str) -> list[bytes | None]:
    """Gather every rank's ``message`` (in group-rank order).

    Blocks the host. If some rank announces a length out of bounds, every
    rank sees the same lengths and skips the second all-gather alike; the
    result then holds None for each rank whose length was out of bounds
    (and empty bytes for the others, whose messages were not fetched).
    """
    import torch.distributed as dist

    try:
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([len(message)], dtype=torch.int64), group=side_group)
        sizes = [int(t.item()) for t in lengths]
        if not all(0 < size <= wire.MAX_MESSAGE_NBYTES for size in sizes):
            return [b"" if 0 < size <= wire.MAX_MESSAGE_NBYTES else None for size in sizes]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        gathered = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(gathered, mine, group=side_group)
    except RuntimeError as err:
        raise PeerTimeoutError(
            f"{what}: exchanging set-up outcomes with the other stages failed: {peer_error_text(err)}"
        ) from err
    return [ctypes.string_at(t.data_ptr(), size) for t, size in zip(gathered, sizes)]


_STATUS_KINDS_MAX_CHARS = 64
_STATUS_TEXT_MAX_CHARS = 64 * 1024


def _bounded(status: tuple[str, str] | None) -> tuple[str, str] | None:
    """Cut a status to the sizes every rank accepts (an error's text can be arbitrarily long)."""
    if status is None:
        return None
    kind, text = status
    if len(text) > _STATUS_TEXT_MAX_CHARS:
        text = text[: _STATUS_TEXT_MAX_CHARS - 20] + " ... (cut)"
    return kind[:_STATUS_KINDS_MAX_CHARS], text


def _read_outcome(data: bytes | None, rank: int, stages: StageMap, what: str) -> tuple[Any, Any]:
    """Decode and check one rank's message; return its ``(status, value)``.

    Raises:
        RuntimeError: the message is not a valid outcome of that rank (the same on every rank).
    """
    who = stages.name(stages.ranks.index(rank))
    try:
        if data is None:
            raise wire.WireFormatError(f"it announced a message length outside 1..{wire.MAX_MESSAGE_NBYTES} bytes")
        envelope = wire.decode(data)
        if type(envelope) is not dict or sorted(envelope) != ["rank", "status", "value"]:
            raise wire.WireFormatError("it is not a {rank, status, value} dict")
        if envelope["rank"] != rank or type(envelope["rank"]) is not int:
            raise wire.WireFormatError(f"it claims to come from rank {envelope['rank']!r}")
        status = envelope["status"]
        if status is not None and not (
            type(status) is tuple and len(status) == 2 and type(status[0]) is str and type(status[1]) is str
            and len(status[0]) <= _STATUS_KINDS_MAX_CHARS and len(status[1]) <= _STATUS_TEXT_MAX_CHARS
        ):
            raise wire.WireFormatError(f"its status is not None or a (kind, text) pair of short strings: "
                                       f"{status!r:.80}")
    except wire.WireFormatError as err:
        raise RuntimeError(f"{what}: {who} sent a set-up message syncless cannot accept: {err}") from err
    return status, envelope["value"]


def barrier(side_group: Any, timeout_s: float, what: str) -> bool:
    """Wait until every rank of ``side_group`` gets here; return False (and log) if that failed.

    Blocks the host. Used while tearing down, where a dead peer must not stop
    this rank from freeing its own resources.
    """
    import torch.distributed as dist

    token = torch.zeros(1)
    try:
        work = dist.all_reduce(token, group=side_group, async_op=True)
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        logger.warning("%s: barrier with the other stages failed (a peer may have died): %s", what,
                       peer_error_text(err))
        return False
    return True


def recv_meta(side_group: Any, src: int, tag: int, length: int, timeout_s: float, what: str) -> torch.Tensor:
    """Receive one step's metadata (int64 ``[step, rows...]``) from global rank ``src``.

    Blocks the host until it arrives, at most ``timeout_s`` (another thread ends the wait early with
    :func:`break_side_group`).

    Raises:
        PeerTimeoutError: nothing came within ``timeout_s`` or the peer's connection broke.
    """
    import torch.distributed as dist

    buffer = torch.empty(length, dtype=torch.int64)
    try:
        work = dist.irecv(buffer, src=src, group=side_group, tag=tag)
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise PeerTimeoutError(
            f"{what}: rank {src} sent nothing within {timeout_s:g} s, or its connection broke (it may have died "
            f"or stopped sending; raise SYNCLESS_PP_TIMEOUT_S if it is only slow): {peer_error_text(err)}"
        ) from err
    return buffer


#: The tag of the receive :func:`break_side_group` lets time out (no message carries it).
BREAK_TAG = TRANSPORT_TAG + 2


def break_side_group(side_group: Any, peer: int, what: str) -> None:
    """Close every connection of a transport's private gloo group, so that its blocked waits raise at once.

    No other call wakes a gloo wait on another thread (torch 2.13: neither the group's ``abort()`` nor
    its destruction do). gloo closes all of a group's connections when one receive times out, and every
    wait on them then raises: so this posts a receive from global rank ``peer`` that no message matches
    and lets it time out after 1 ms. The peers see the connections end. Local; blocks the host about
    1 ms. The group is unusable afterwards (only ``abort()`` and ``close()`` call it).
    """
    import torch.distributed as dist

    if side_group is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        work = dist.irecv(torch.empty(1, dtype=torch.uint8), src=peer, group=side_group, tag=BREAK_TAG)
        work.wait(timeout=timedelta(milliseconds=1))
    except (RuntimeError, ValueError) as err:  # the timeout we asked for, or a group already broken or gone
        logger.debug("%s: closed the private gloo group's connections: %s", what, peer_error_text(err))
