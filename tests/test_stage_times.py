"""First-token stage stamps (``headrace.common.stage_times``) and their decomposition
(``bench.first_token``): off by default; on, the front end, the core and the step loop stamp a
request's path, and the stages of a streamed request add up to the TTFT its client measured, in
the split layout (a front end and an engine core) and in one process."""

from __future__ import annotations

import pytest

from bench.first_token import STAGES, ClientStamps, decompose, table
from headrace.common import stage_times
from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import inference_pb2 as pb
from tests.harness import Planes


def test_off_unless_the_environment_names_a_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(stage_times.ENV, raising=False)
    assert stage_times.from_env() is None
    monkeypatch.setenv(stage_times.ENV, str(tmp_path / "s"))
    log = stage_times.from_env()
    log.stamp("r1", "fe_received", at=12.5)
    log.stamp("step:3", "result", execute_ms=1.5)
    assert stage_times.read(str(tmp_path / "s")) == [(12.5, "r1", "fe_received", {}),
                                                     (pytest.approx(stage_times.time.monotonic(), abs=5),
                                                      "step:3", "result", {"execute_ms": 1.5})]


@pytest.mark.parametrize("split", [True, False])
def test_the_stages_of_a_first_token_add_up_to_its_ttft(monkeypatch, tmp_path, split):
    directory = str(tmp_path / "stages")
    monkeypatch.setattr(stage_times, "STAGES", stage_times.StageLog(directory))
    planes = Planes(default_model_dir(), split=split)
    try:
        client = ClientStamps(directory)
        ids = []
        for i in range(3):
            rid = f"r{i}"
            client.sent(rid)
            stream = planes.stub.Generate(pb.GenerateRequest(
                request_id=rid, prompt_token_ids=pb.TokenIds(ids=[5, 9, 13, 20 + i]), max_tokens=4,
                ignore_eos=True, sampling=pb.SamplingParams(temperature=0)), timeout=60)
            next(stream)
            client.first(rid)
            list(stream)
            ids.append(rid)
    finally:
        planes.close()
    one = decompose(directory, ids[:1])
    assert one["requests"] == 1
    assert one["sum"] == pytest.approx(one["ttft"], abs=0.01)   # the stages telescope to the TTFT
    for stage in STAGES:
        if stage != "to_core":   # (in one process the engine stamps before the front end does)
            assert one[stage] >= 0, (stage, one)
    assert one["dataplane_host"] + one["sample_readback"] > 0   # a CPU step: host time
    assert decompose(directory, ids)["requests"] == 3
    assert "core_admission_scheduling" in table(one)
