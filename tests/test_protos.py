"""The committed generated gRPC code is what the .proto files generate now."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "protos"
sys.path.insert(0, str(ROOT))
from codegen import PROTO_FILES, generate  # noqa: E402


def test_generated_code_is_up_to_date(tmp_path):
    generate(tmp_path)
    stale = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            fresh = (tmp_path / (stem + suffix)).read_text()
            committed = (ROOT / (stem + suffix)).read_text()
            if fresh != committed:
                stale.append(stem + suffix)
    assert not stale, f"regenerate with `python protos/codegen.py`: stale {stale}"
