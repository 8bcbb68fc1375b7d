"""genserve: the import root of the generated gRPC contract (genserve.v1).

The generated stubs live in genserve/v1/ and are rebuilt by scripts/gen_proto.py.
"""
