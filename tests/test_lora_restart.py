"""A LoRA adapter loaded at run time outlives a crash of the engine core: kill -9 of the core
while a stream of that adapter runs; the front end loads the adapter into the restarted core
(``CoreClient.restore_adapters``, ``lora_api.restorer``) before it resumes the stream, which ends
with the tokens of an undisturbed run, and the adapter is served again."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from headrace.dataplane.default_model import default_model_dir
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.lora_harness import make_adapter
from tests.served import Served

pytestmark = pytest.mark.slow   # a serve process tree and a core restart

TOKEN = "restore-test"
AUTH = [("authorization", f"Bearer {TOKEN}")]


def _tokens(stub, **kw) -> list[int]:
    return [t for r in stub.Generate(pb.GenerateRequest(**kw), timeout=120) for t in r.token_ids]


@pytest.mark.timeout(300)
def test_a_runtime_adapter_is_loaded_again_into_a_restarted_core_and_its_stream_resumes(tmp_path):
    adapter = make_adapter(default_model_dir(), tmp_path / "adapter", seed=3, r=8)
    served = Served(tmp_path / "serve.log", api_server_count=1,
                    extra=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
                    env={"HEADRACE_ADMIN_TOKEN": TOKEN})
    try:
        served.wait_serving()
        channel = served.channel_to(0)
        stub = pb_grpc.InferenceStub(channel)
        apb_grpc.AdminStub(channel).LoadLoraAdapter(
            apb.LoadLoraAdapterRequest(lora_name="tuned", lora_path=str(adapter)), metadata=AUTH,
            timeout=120)
        request = dict(prompt="The river ran", max_tokens=160, ignore_eos=True, model="tuned",
                       sampling=pb.SamplingParams(temperature=0))
        undisturbed = _tokens(stub, **request)
        assert undisturbed != _tokens(stub, **{**request, "model": ""})   # the adapter matters

        core = served.role_pids()["core"]
        stream = stub.Generate(pb.GenerateRequest(**request), timeout=120)
        got = list(next(stream).token_ids)
        os.kill(core, signal.SIGKILL)
        for resp in stream:
            got.extend(resp.token_ids)
        assert got == undisturbed
        assert served.role_pids()["core"] != core, "the core was restarted"
        listed = apb_grpc.AdminStub(channel).ListLoraAdapters(apb.ListLoraAdaptersRequest(),
                                                              metadata=AUTH, timeout=30)
        assert [a.adapter.name for a in listed.adapters] == ["tuned"]
        assert _tokens(stub, **request) == undisturbed
    except grpc.RpcError as exc:
        raise AssertionError(f"{exc.code().name}: {exc.details()}\n{served.log_tail()}") from None
    finally:
        served.close()
