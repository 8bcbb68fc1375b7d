"""Generated Python stubs of proto/genserve/v1/generate.proto.

Do not edit generate_pb2*.py by hand: run `python scripts/gen_proto.py`.
"""
