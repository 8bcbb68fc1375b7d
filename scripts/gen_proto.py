"""Regenerate the Python gRPC stubs in genserve/v1/ from proto/.

    python scripts/gen_proto.py            # rewrite the committed stubs
    python scripts/gen_proto.py --out DIR  # write DIR/genserve/v1/... instead

Runs grpcio-tools' bundled protoc with `-Iproto`, so the generated imports read
`from genserve.v1 import generate_pb2` and `genserve` is the import root. The
output is committed as generated, never edited by hand; tests/test_proto.py
fails when it is stale.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("genserve/v1/generate.proto",)
# The files protoc writes for each .proto: message classes, type stubs, gRPC stubs.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_paths(out: Path) -> list[Path]:
    """Paths of every generated file under `out`."""
    return [out / (proto.removesuffix(".proto") + suffix)
            for proto in PROTO_FILES for suffix in GENERATED_SUFFIXES]


def generate(out: Path) -> list[Path]:
    """Run protoc into `out` and return the generated files."""
    import grpc_tools  # grpcio-tools: protoc and the well-known types

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}", f"-I{well_known}",
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
        *PROTO_FILES,
    ]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return generated_paths(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT,
                        help="output root; files go to OUT/genserve/v1/ (default: the repo root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
