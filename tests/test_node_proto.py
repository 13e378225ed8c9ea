"""The generated gRPC code is reproducible from proto/ and imports under the package path."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regenerating_gives_identical_files(tmp_path):
    gen = _generator()
    gen.generate(tmp_path)
    fresh, committed = gen.snapshot(tmp_path), gen.snapshot(gen.OUT)
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run `python proto/generate.py`"


def test_generated_code_imports_by_package_path():
    code = ("from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2, gasloc_pb2_grpc; "
            "m = gasloc_pb2.ExchangeMsg(reject=gasloc_pb2.Reject(code=gasloc_pb2.BUSY)); "
            "print(gasloc_pb2.ExchangeMsg.FromString(m.SerializeToString()).reject.code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         check=True)
    assert out.stdout.strip() == "1"
