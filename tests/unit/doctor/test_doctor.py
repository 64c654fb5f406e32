"""``syncless doctor`` runs anywhere, names what is missing, and renders a two-GPU report."""

import json
import os
import subprocess
import sys

from syncless import cli
from syncless._core.hardware import cuda_device_count
from syncless.doctor import render


def _fake_two_h200_report():
    gpu = {"name": "NVIDIA H200", "memory_mib": 143771, "compute_capability": "9.0", "sm_count": 132,
           "stream_mem_ops_64bit": True}
    links = [
        {"src": a, "dst": b, "kind": "same" if a == b else "nvlink", "label": "X" if a == b else "NV18",
         "nvlink_count": 0 if a == b else 18, "peer_access": True}
        for a in (0, 1) for b in (0, 1)
    ]
    return {
        "software": {"python": "3.12.3", "platform": "Linux", "torch": "2.11.0+cu130", "torch_cuda_runtime": "13.0",
                     "torch_cuda_available": True, "nccl": "2.28.9", "cuda_bindings": "13.3.1",
                     "nvidia_ml_py": "13.580", "driver": "580.159.04", "driver_cuda": "13.0"},
        "gpus": [{**gpu, "ordinal": 0, "pci_bus_id": "0000:18:00.0"}, {**gpu, "ordinal": 1, "pci_bus_id": "0000:2a:00.0"}],
        "links": links,
        "confidential_compute": {"state": "off", "mode": "auto -> off"},
        "pp_transport": {"transport": "copy_engine", "reason": "2 GPUs, every pair on NVLink", "notes": [],
                         "checks": [{"name": "NVLink 0<->1", "ok": True, "detail": "yes"}]},
        "config": [{"name": "SYNCLESS_CC", "value": "auto", "source": "default", "error": None, "doc": ""}],
        "missing": [],
    }


def test_render_two_gpus_shows_nvlink_matrix_and_mem_ops():
    text = render(_fake_two_h200_report())
    assert text.count("NVIDIA H200") == 2
    assert "64-bit stream memory ops: yes" in text
    assert "NV18" in text
    assert "copy_engine" in text
    assert "[ok] NVLink 0<->1: yes" in text and "notes: none" in text
    assert "SYNCLESS_CC = auto (default)" in text
    assert "Missing" not in text


def test_render_marks_invalid_settings_and_missing_pieces():
    report = _fake_two_h200_report()
    report["config"] = [{"name": "SYNCLESS_CC", "value": "bogus", "source": "env", "error": "SYNCLESS_CC='bogus' is not valid", "doc": ""}]
    report["missing"] = [{"what": "cuda-bindings", "fix": "pip install 'syncless[cuda]'"}]
    report["confidential_compute"] = {"error": "nvidia-ml-py is not installed"}
    text = render(report)
    assert "INVALID" in text and "bogus" in text
    assert "cuda-bindings: pip install 'syncless[cuda]'" in text
    assert "unavailable: nvidia-ml-py is not installed" in text


def test_doctor_exits_zero_here_and_names_what_is_missing(capsys):
    assert cli.main(["doctor"]) == 0
    text = capsys.readouterr().out
    for heading in ("Software", "GPUs", "Confidential Computing", "Pipeline-parallel transport", "Configuration"):
        assert heading in text
    if cuda_device_count() == 0:
        assert "Missing" in text


def test_doctor_json_has_every_section(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"software", "gpus", "links", "confidential_compute", "pp_transport", "config", "missing"} <= set(report)
    names = {row["name"] for row in report["config"]}
    assert "SYNCLESS_SYNC_CHECK" in names and "SYNCLESS_PP_TIMEOUT_S" in names
    if cuda_device_count() == 0:
        assert report["gpus"] == []
        assert report["missing"], "a machine without GPU must say what is missing"


def test_doctor_reports_a_bad_setting_without_crashing_and_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setenv("SYNCLESS_PP_TIMEOUT_S", "forever")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "SYNCLESS_PP_TIMEOUT_S" in out and "forever" in out and "INVALID" in out
    assert "1 setting(s) to fix above" in out


def test_doctor_reports_a_bad_sync_check_instead_of_failing_to_load_the_detector(monkeypatch, capsys):
    monkeypatch.setenv("SYNCLESS_SYNC_CHECK", "bogus")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "SYNCLESS_SYNC_CHECK = bogus (env)  <- INVALID" in out
    import torch

    # The build decides whether the detector can run, not the bad setting (which is reported above).
    expected = "no" if torch.version.cuda is None else "yes"
    assert f"can check syncs with this torch build: {expected} (" in out


def test_a_bad_sync_backend_is_marked_by_doctor_in_a_fresh_process_and_falls_back_to_auto():
    # A fresh process: the backend is read when syncless.syncs is imported, which this process did long ago.
    env = {**os.environ, "SYNCLESS_SYNC_BACKEND": "cuptii"}
    done = subprocess.run([sys.executable, "-m", "syncless", "doctor"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    text = "SYNCLESS_SYNC_BACKEND='cuptii' is not valid; allowed: auto, torch, cupti"
    assert f"SYNCLESS_SYNC_BACKEND = cuptii (env)  <- INVALID: {text}" in done.stdout
    assert f"setting error: {text}; auto is used until it is fixed or unset" in done.stdout
    assert "requested: auto" in done.stdout
    assert done.stderr == "", done.stderr  # the command line says it once, in the report, not as a warning too


def test_doctor_shows_vllm_gpu_sync_check_and_marks_a_bad_value(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_GPU_SYNC_CHECK", "error")
    cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "VLLM_GPU_SYNC_CHECK = error (syncless.compat.vllm sets syncless's mode to 'error')" in out
    monkeypatch.setenv("VLLM_GPU_SYNC_CHECK", "loud")
    assert cli.main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert ("VLLM_GPU_SYNC_CHECK = loud  <- INVALID: VLLM_GPU_SYNC_CHECK='loud' is not one of: unset or off, warn, "
            "error") in captured.out
    assert "1 setting(s) to fix above" in captured.out
    report = json.loads(_doctor_json(capsys))
    assert [row["name"] for row in report["other_variables"]] == ["VLLM_GPU_SYNC_CHECK"]


def _doctor_json(capsys):
    cli.main(["doctor", "--json"])
    return capsys.readouterr().out


def test_doctor_flags_a_misspelt_name_with_the_likely_one(monkeypatch, capsys):
    monkeypatch.setenv("SYNCLESS_CC_MODE", "on")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "SYNCLESS_CC_MODE  <- UNKNOWN: SYNCLESS_CC_MODE is not a syncless setting and is ignored " \
           "(did you mean SYNCLESS_CC?)" in out


def test_doctor_says_whether_the_sync_detector_can_run(capsys):
    cli.main(["doctor"])
    out = capsys.readouterr().out
    import torch

    expected = "no" if torch.version.cuda is None else "yes"
    assert f"can check syncs with this torch build: {expected} (" in out


def test_missing_pieces_with_the_same_fix_are_listed_once():
    from syncless.doctor._probe import merge_missing

    fix = "install the NVIDIA driver"
    merged = merge_missing([{"what": "libnvidia-ml", "fix": fix}, {"what": "cuda-bindings", "fix": "pip"},
                            {"what": "libcuda", "fix": fix}, {"what": "libcuda", "fix": fix}])
    assert merged == [{"what": "libnvidia-ml; libcuda", "fix": fix}, {"what": "cuda-bindings", "fix": "pip"}]


def test_a_machine_without_the_cuda_extra_lists_each_missing_package_once(monkeypatch):
    """A wheel install without [cuda]: neither package imports; each is named once under Missing (issue #28)."""
    import sys

    from syncless._core import cuda
    from syncless.doctor import _probe

    for module in ("pynvml", "cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, module, None)  # `import` of it raises ImportError
    monkeypatch.setattr(_probe, "_package_version", lambda name: None)
    monkeypatch.setattr(cuda, "_nvml_ready", False)
    cuda.nvml_module.cache_clear()
    cuda.driver_module.cache_clear()
    missing = []
    try:
        _probe.probe_software(missing)
        missing = _probe.merge_missing(missing)
    finally:
        cuda.nvml_module.cache_clear()
        cuda.driver_module.cache_clear()
    named = [what for entry in missing for what in entry["what"].split("; ")]
    assert named.count("cuda-bindings") == 1 and named.count("nvidia-ml-py") == 1
    assert not [what for what in named if "not installed" in what]
    text = render({**_fake_two_h200_report(), "missing": missing})
    section = text.split("\nMissing\n")[1].splitlines()
    assert [line for line in section if "nvidia-ml-py" in line] == [
        "  cuda-bindings; nvidia-ml-py: install it with `pip install 'syncless[cuda]'` (cuda-bindings and nvidia-ml-py)"]


def test_doctor_says_where_the_documentation_is_and_syncless_docs_lists_and_prints_it(capsys):
    from pathlib import Path

    assert cli.main(["doctor"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Documentation: "))
    folder = Path(line.split()[1])
    assert (folder / "syncs.md").is_file()
    assert cli.main(["docs"]) == 0
    listing = capsys.readouterr().out
    assert "  syncs " in listing and "`syncless.syncs`: finding hidden GPU<->CPU syncs" in listing
    assert cli.main(["docs", "configuration.md"]) == 0
    assert capsys.readouterr().out == (folder / "configuration.md").read_text()
    assert cli.main(["docs", "nope"]) == 2
    assert "no page 'nope'; the pages are: README, cc," in capsys.readouterr().err
