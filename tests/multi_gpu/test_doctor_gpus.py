"""``syncless doctor`` on two GPUs: the NVLink between them, and the copy-engine transport it picks."""

import json

import pytest

from syncless import cli


@pytest.mark.multi_gpu
def test_doctor_sees_nvlink_between_gpus_and_picks_copy_engines(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    links = [link for link in report["links"] if link["src"] != link["dst"]]
    assert links and all(link["kind"] == "nvlink" and link["nvlink_count"] > 0 for link in links), links
    assert report["pp_transport"].get("transport") == "copy_engine", report["pp_transport"]
