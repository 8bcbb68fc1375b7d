"""The gRPC contract: `buf lint` is clean and the committed stubs match the .proto files."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_gen_proto():
    """scripts/gen_proto.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_proto", REPO_ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_proto = _load_gen_proto()

REGENERATE = "run `python scripts/gen_proto.py` and commit the result"


def _buf() -> str:
    """The buf binary: the one the buf-bin package put next to this Python, else PATH's."""
    for candidate in (Path(sys.executable).parent / "buf", Path(sysconfig.get_path("scripts")) / "buf"):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("buf")
    if found is None:
        pytest.skip("buf is not installed (pip install buf-bin)")
    return found


def test_buf_lint_is_clean():
    result = subprocess.run([_buf(), "lint"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_committed_stubs_match_the_proto(tmp_path):
    fresh = gen_proto.generate(tmp_path)
    committed = gen_proto.generated_paths(REPO_ROOT)
    for new, old in zip(fresh, committed, strict=True):
        assert old.is_file(), f"{old.relative_to(REPO_ROOT)} is missing: {REGENERATE}"
        assert new.read_bytes() == old.read_bytes(), f"{old.relative_to(REPO_ROOT)} is stale: {REGENERATE}"


def test_stubs_import_and_round_trip():
    from genserve.v1 import generate_pb2 as pb
    from genserve.v1 import generate_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=0.0))
    decoded = pb.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.sampling.HasField("temperature") and not decoded.sampling.HasField("top_p")
    assert not decoded.HasField("max_tokens") and decoded.WhichOneof("prompt_input") == "prompt"
    assert hasattr(pb_grpc, "GenerateServiceStub") and hasattr(pb_grpc, "add_GenerateServiceServicer_to_server")
