"""Generated gRPC code of headrace (see protos/codegen.py)."""
