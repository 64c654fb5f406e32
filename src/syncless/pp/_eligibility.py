"""Whether the copy-engine transport can run: the decisions in plain Python, the facts from the hardware.

The rules (docs/pp.md, "Eligibility"): CUDA; one node; every pair of pipeline GPUs
connected by NVLink (PCIe peers are refused: the receiver's wait relies on
NVLink delivering the data before the flag write that follows it; stages on
one GPU count as connected); 64-bit stream memory operations. The functions
that decide take the facts as arguments, so tests feed them fakes; only
``gather_local_facts``, ``query_nvlink``, ``device_uuid``,
``local_stage_device`` and ``mem_ops_problem`` touch NVML or the driver.

One more rule: more than one hardware queue per context
(``CUDA_DEVICE_MAX_CONNECTIONS`` not 1, :func:`connections_problem`). Each
stage checks its own facts and ``make_transport`` shares every stage's
outcome, so all stages decide alike (``_group.agree``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncless._core import config, cuda, topology
from syncless._core.errors import CudaError, MissingDependencyError
from syncless.pp import _driver

logger = logging.getLogger(__name__)

NvlinkQuery = Callable[[str, str], bool]


@dataclass(frozen=True)
class StageDevice:
    """The GPU one stage runs on, as the other stages need to know it.

    Attributes:
        host: the node's host name.
        uuid: NVML-style UUID (``GPU-xxxxxxxx-...``) of the GPU.
        ordinal: CUDA ordinal in that stage's process (for messages only).
    """

    host: str
    uuid: str
    ordinal: int


def topology_problem(devices: Sequence[StageDevice], nvlink: NvlinkQuery) -> str | None:
    """Return why these stages cannot use copy engines, or None if they can.

    Args:
        devices: every stage's GPU, in pipeline order.
        nvlink: answers whether two GPUs (by UUID) are NVLink-connected.
    """
    hosts = sorted({d.host for d in devices})
    if len(hosts) > 1:
        return f"the stages run on several nodes ({', '.join(hosts)}); copy engines need one node"
    uuids = sorted({d.uuid for d in devices})
    for i, first in enumerate(uuids):
        for second in uuids[i + 1 :]:
            if not nvlink(first, second):
                return (
                    f"GPUs {first} and {second} are not NVLink-connected (PCIe peers are refused: the flag "
                    "write could overtake the data it follows)"
                )
    return None


# Facts from the hardware --------------------------------------------------------


def uuid_string(raw: bytes) -> str:
    """Format the driver's 16 UUID bytes the way NVML names GPUs: ``GPU-8-4-4-4-12`` hex."""
    text = raw.hex()
    return f"GPU-{text[0:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:32]}"


def device_uuid(ordinal: int) -> str:
    """Return the NVML-style UUID of CUDA device ``ordinal``."""
    device = cuda.call("cuDeviceGet", ordinal)
    uuid = cuda.call("cuDeviceGetUuid", device)
    return uuid_string(bytes(uuid.bytes)[:16])


def local_stage_device(ordinal: int) -> StageDevice:
    """Describe this process's GPU for the other stages."""
    return StageDevice(socket.gethostname(), device_uuid(ordinal), ordinal)


def query_nvlink(uuid_a: str, uuid_b: str) -> bool:
    """Ask NVML whether two GPUs, named by UUID, are connected by NVLink (:func:`syncless._core.topology.nvlink_p2p`).

    Raises:
        MissingDependencyError: NVML is not there.
    """
    nvml = cuda.ensure_nvml()
    handle_a = nvml.nvmlDeviceGetHandleByUUID(uuid_a.encode())
    handle_b = nvml.nvmlDeviceGetHandleByUUID(uuid_b.encode())
    return topology.nvlink_p2p(nvml, handle_a, handle_b)


def mem_ops_problem(ordinal: int) -> str | None:
    """Return why GPU ``ordinal`` cannot run the flag protocol, or None if it can."""
    if not cuda.supports_64bit_stream_mem_ops(ordinal):
        return f"GPU {ordinal} does not support 64-bit stream memory operations (CAN_USE_64_BIT_STREAM_MEM_OPS = 0)"
    return None


#: The CUDA variable that sets how many hardware queues (connections) a context's streams share.
MAX_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def connections_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """Return why ``CUDA_DEVICE_MAX_CONNECTIONS`` rules out the copy-engine transport, or None.

    CUDA reads the variable once, when it creates the context (torch's first
    CUDA call), and maps the context's streams onto that many hardware
    queues. A ``cuStreamWaitValue64`` that waits holds its queue: with one
    queue, the watchdog's release write (on a private stream) queues behind
    the stuck wait it should release, so the GPU stays blocked until the
    peer's flag comes, which never happens if the peer died (measured on
    H200s). So ``1`` is refused. With two or more queues a blocked wait
    holds only the streams that share its queue; CUDA does not document
    the mapping and offers no way to give the private stream a queue of its
    own, so the release relies on it not sharing the stuck stream's queue
    (``docs/pp.md``, failure model). This reads the value now (``os.environ``
    unless ``environ`` is given): set the variable before the process
    starts, since a value changed after CUDA created its context is not the
    one CUDA uses. A value that is not an integer is not judged here.
    """
    raw = (os.environ if environ is None else environ).get(MAX_CONNECTIONS_VAR)
    if raw is None:
        return None
    try:
        connections = int(raw.strip())
    except ValueError:
        return None
    if connections != 1:
        return None
    return (
        f"{MAX_CONNECTIONS_VAR}=1 puts every stream of the CUDA context on one hardware queue, so the watchdog "
        "could not release a GPU wait stuck on a dead or stalled peer (its release would queue behind that "
        f"wait). Unset {MAX_CONNECTIONS_VAR} (CUDA's default is 8) or set it to 2 or more before the process starts"
    )


# What `syncless doctor` shows -------------------------------------------------------


@dataclass
class LocalFacts:
    """What this machine offers, as :func:`describe_local_choice` needs it.

    ``None`` in a pair map means the fact could not be read; ``notes`` says why.
    """

    cuda_available: bool
    gpu_count: int
    mem_ops_64: list[bool] = field(default_factory=list)
    nvlink: dict[tuple[int, int], bool | None] = field(default_factory=dict)
    peer_access: dict[tuple[int, int], bool | None] = field(default_factory=dict)
    #: why a step's tensors would not go out as one batched copy (None: they would)
    batch_problem: str | None = "unknown"
    notes: list[str] = field(default_factory=list)
    #: the value of CUDA_DEVICE_MAX_CONNECTIONS (None: unset)
    max_connections: str | None = None


def gather_local_facts() -> LocalFacts:
    """Read the facts of this machine (torch, the CUDA driver, NVML); never raises for absent pieces."""
    import torch

    if not torch.cuda.is_available():
        return LocalFacts(False, 0, notes=["torch sees no CUDA GPU"])
    count = torch.cuda.device_count()
    facts = LocalFacts(True, count, max_connections=os.environ.get(MAX_CONNECTIONS_VAR))
    try:
        facts.mem_ops_64 = [cuda.supports_64bit_stream_mem_ops(i) for i in range(count)]
        uuids = [device_uuid(i) for i in range(count)]
        facts.batch_problem = _driver.batch_api_problem()
    except (CudaError, MissingDependencyError) as err:
        facts.notes.append(f"the CUDA driver could not be queried: {err}")
        return facts
    nvml_errors = cuda.nvml_errors()
    for a in range(count):
        for b in range(a + 1, count):
            try:
                facts.peer_access[(a, b)] = cuda.can_access_peer(a, b) and cuda.can_access_peer(b, a)
            except CudaError as err:
                facts.peer_access[(a, b)] = None
                facts.notes.append(f"peer access {a}<->{b} unknown: {err}")
            try:
                facts.nvlink[(a, b)] = query_nvlink(uuids[a], uuids[b])
            except nvml_errors as err:  # NVML missing or refusing: the fact is unknown, doctor goes on
                facts.nvlink[(a, b)] = None
                facts.notes.append(f"NVLink {a}<->{b} unknown: {err}")
    return facts


def decide(facts: LocalFacts, setting: str = "auto") -> dict[str, Any]:
    """Say which transport ``make_transport`` would build for a pipeline over all local GPUs, and why.

    Args:
        facts: the machine's facts.
        setting: ``SYNCLESS_PP_TRANSPORT`` (``auto``, ``copy_engine`` or ``torch_distributed``).

    Returns:
        ``{"transport", "reason", "checks": [{"name", "ok", "detail"}], "notes", "setting"}``, plus
        ``"batched_copies"`` (yes, or no and why) when ``transport`` is ``copy_engine``;
        ``transport`` is ``"error"`` when ``copy_engine`` is forced on a machine that cannot run it.
    """
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> bool:
        checks.append({"name": name, "ok": ok, "detail": detail})
        return ok

    eligible = check("CUDA", facts.cuda_available, f"{facts.gpu_count} GPU(s)" if facts.cuda_available else "none")
    if eligible:
        eligible = check(
            "GPUs",
            facts.gpu_count >= 1,
            "stages may share one GPU" if facts.gpu_count == 1 else f"{facts.gpu_count} GPUs",
        )
    if eligible:
        missing = [i for i, ok in enumerate(facts.mem_ops_64) if not ok]
        known = len(facts.mem_ops_64) == facts.gpu_count
        eligible = check(
            "64-bit stream memory ops",
            known and not missing,
            "all GPUs" if known and not missing else (f"missing on GPU {missing}" if known else "unknown"),
        )
    if facts.cuda_available:
        value = facts.max_connections
        problem = connections_problem({} if value is None else {MAX_CONNECTIONS_VAR: value})
        if problem:
            detail = f"{MAX_CONNECTIONS_VAR}={value}: one queue, a stuck wait could not be released; unset it or >= 2"
        elif value is None:
            detail = f"{MAX_CONNECTIONS_VAR} unset (CUDA's default, 8)"
        else:
            detail = f"{MAX_CONNECTIONS_VAR}={value}"
        eligible = check("hardware queues", problem is None, detail) and eligible
    for (a, b), linked in sorted(facts.nvlink.items()):
        ok = linked is True
        detail = {True: "yes", False: "no (PCIe only)", None: "unknown"}[linked]
        eligible = check(f"NVLink {a}<->{b}", ok, detail) and eligible
    for (a, b), peer in sorted(facts.peer_access.items()):
        ok = peer is True
        eligible = check(f"peer access {a}<->{b}", ok, {True: "yes", False: "no", None: "unknown"}[peer]) and eligible
    failed = [c for c in checks if not c["ok"]]
    why_not = "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
    if setting == "torch_distributed":
        transport, reason = "torch_distributed", "SYNCLESS_PP_TRANSPORT=torch_distributed"
    elif eligible:
        transport = "copy_engine"
        reason = "one node, every GPU pair on NVLink with peer access, 64-bit stream memory ops"
        if facts.gpu_count == 1:
            reason = "one GPU shared by the stages, 64-bit stream memory ops"
    elif setting == "copy_engine":
        transport, reason = "error", f"SYNCLESS_PP_TRANSPORT=copy_engine but make_transport would raise: {why_not}"
    else:
        transport, reason = "torch_distributed", f"copy engines not usable: {why_not}"
    result = {"transport": transport, "reason": reason, "checks": checks}
    if transport == "copy_engine":
        batch = facts.batch_problem
        result["batched_copies"] = (
            "yes: the driver and cuda-bindings can send a step of several tensors as one copy"
            if batch is None else f"no: {batch}"
        )  # fmt: skip
    return {**result, "notes": list(facts.notes), "setting": setting}


def describe_local_choice(facts: LocalFacts | None = None) -> dict[str, Any]:
    """Say which pipeline transport ``make_transport`` would pick on this machine, and why.

    Blocks the host for a few driver and NVML queries; does no GPU work.
    A bad ``SYNCLESS_PP_TRANSPORT`` value is reported in the result, not raised.
    """
    try:
        setting = config.read("SYNCLESS_PP_TRANSPORT")
    except ValueError as err:
        result = decide(facts or gather_local_facts())
        result["notes"].append(str(err))
        return result
    return decide(facts or gather_local_facts(), setting)
