"""Render the doctor's report as one screen of text."""

from __future__ import annotations

from typing import Any

from syncless.doctor._probe import config_problems


def _yes_no(value: Any) -> str:
    if value is None:
        return "unknown"
    return "yes" if value else "no"


def _software_lines(sw: dict[str, Any]) -> list[str]:
    def show(value: Any) -> str:
        return "missing" if value is None else str(value)

    return [
        "Software",
        f"  Python {sw['python']} on {sw['platform']}",
        f"  torch {sw['torch']} (CUDA runtime {show(sw['torch_cuda_runtime'])}, CUDA usable: {_yes_no(sw['torch_cuda_available'])})",
        f"  NVIDIA driver {show(sw['driver'])} (CUDA {show(sw['driver_cuda'])}), NCCL {show(sw['nccl'])}",
        f"  cuda-bindings {show(sw['cuda_bindings'])}, nvidia-ml-py {show(sw['nvidia_ml_py'])}",
    ]


def _gpu_lines(report: dict[str, Any]) -> list[str]:
    gpus = report["gpus"]
    if not gpus:
        return ["GPUs", "  none found"]
    lines = ["GPUs"]
    for g in gpus:
        lines.append(
            f"  [{g['ordinal']}] {g['name']}, {g['memory_mib']} MiB, sm_{g['compute_capability'].replace('.', '')}, "
            f"{g['sm_count']} SMs, bus {g['pci_bus_id']}, 64-bit stream memory ops: {_yes_no(g['stream_mem_ops_64bit'])}"
        )
    if len(gpus) > 1:
        labels = {(link["src"], link["dst"]): link["label"] for link in report["links"]}
        ordinals = [g["ordinal"] for g in gpus]
        lines.append("  Links (NV<n> = NVLink with n active links, PCIe = peer access without NVLink, - = none)")
        lines.append("        " + "".join(f"GPU{o:<5}" for o in ordinals))
        for a in ordinals:
            lines.append(f"  GPU{a:<3}" + "".join(f"{labels.get((a, b), '?'):<8}" for b in ordinals))
    return lines


def _section_lines(title: str, section: Any) -> list[str]:
    if isinstance(section, dict) and set(section) == {"error"}:
        return [title, f"  unavailable: {section['error']}"]
    lines = [title]
    for key, value in section.items():
        if isinstance(value, list) and value and all(isinstance(item, dict) and "ok" in item for item in value):
            lines.append(f"  {key.replace('_', ' ')}:")
            lines += [f"    [{'ok' if item['ok'] else 'no'}] {item.get('name')}: {item.get('detail', '')}" for item in value]
        elif isinstance(value, list):
            lines += [f"  {key.replace('_', ' ')}: {item}" for item in value] or [f"  {key.replace('_', ' ')}: none"]
        else:
            lines.append(f"  {key.replace('_', ' ')}: {value}")
    return lines


def _detector_lines(detector: dict[str, Any] | None) -> list[str]:
    """The hidden-sync detector's section; more lines (another backend) go after the first."""
    if detector is None:
        return []
    lines = ["Hidden-sync detector (syncless.syncs)"]
    lines.append(f"  can check syncs with this torch build: {_yes_no(detector.get('can_run'))} ({detector.get('reason')})")
    for key, value in detector.items():
        if key not in ("can_run", "reason"):
            lines.append(f"  {key.replace('_', ' ')}: {value}")
    return lines


def render(report: dict[str, Any]) -> str:
    """Return the report as text for a terminal."""
    lines = _software_lines(report["software"]) + [""] + _gpu_lines(report) + [""]
    lines += _section_lines("Confidential Computing", report["confidential_compute"]) + [""]
    lines += _section_lines("Pipeline-parallel transport", report["pp_transport"]) + [""]
    lines += _detector_lines(report.get("sync_detector")) + [""]
    if "sync_backend" in report:
        lines += _section_lines("Hidden-sync detector backend", report["sync_backend"]) + [""]
    lines.append("Configuration (SYNCLESS_*)")
    for row in report["config"]:
        origin = "env" if row["source"] == "env" else "default"
        error = f"  <- INVALID: {row['error']}" if row["error"] else ""
        lines.append(f"  {row['name']} = {row['value']} ({origin}){error}")
    for row in report.get("unknown_settings", []):
        lines.append(f"  {row['name']}  <- UNKNOWN: {row['message']}")
    if report.get("other_variables"):
        lines += ["", "Variables of other software"]
        for row in report["other_variables"]:
            error = f"  <- INVALID: {row['error']}" if row["error"] else f" ({row['doc']})"
            lines.append(f"  {row['name']} = {row['value']}{error}")
    problems = config_problems(report)
    if problems:
        lines.append(f"  {problems} setting(s) to fix above (docs/configuration.md lists every one)")
    if "docs" in report:
        lines += ["", f"Documentation: {report['docs']} (`syncless docs` lists the pages, `syncless docs PAGE` prints one)"]
    if report["missing"]:
        lines += ["", "Missing"]
        lines += [f"  {entry['what']}: {entry['fix']}" for entry in report["missing"]]
    return "\n".join(lines)
