"""genserve: the import root of the generated gRPC contract (genserve.v1), the helpers every
process shares (genserve.common) and the local deployment's command line (genserve.deploy).

* `genserve.v1`: the generated stubs, rebuilt by scripts/gen_proto.py (the public import path).
* `genserve.common`: leaf helpers that engine/, service/ and bridge/ import; they import none of
  them, nor genserve.deploy.
* `genserve.deploy`: `genserve serve` (cli), its process supervisor and its Envoy configuration;
  the top layer, which may import service/.

This package imports none of them itself, so `import genserve.v1` loads only the stubs.
"""
