"""Generates the Python gRPC code under protos/headrace from the .proto files.

Run `python protos/codegen.py` after editing a .proto file and commit the output;
tests/test_protos.py fails when the committed code is stale. Use grpcio-tools no
newer than the grpcio you deploy with (stubs check the runtime version).
"""

from __future__ import annotations

import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PROTO_FILES = ["headrace/v1/inference.proto", "headrace/v1/admin.proto",
               "headrace/worker/v1/worker.proto", "headrace/core/v1/core.proto"]


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc  # build-time dependency only

    for proto in PROTO_FILES:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}", str(PROTO_ROOT / proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(PROTO_ROOT)
    sys.exit(0)
