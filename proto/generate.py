"""Regenerate the Python stubs of the gRPC contract into kvbm_client/_gen/.

The generated code is committed (so a plain ``pip install .`` needs no protoc);
``python proto/generate.py --check`` fails when the committed stubs are not current
(tests/test_contract_current.py runs it).
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "kvbm_client" / "_gen"
PROTOS = ["kvbm/v1/kvbm.proto"]
PACKAGE = "kvbm_client._gen"


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc

    (out / "kvbm" / "v1").mkdir(parents=True, exist_ok=True)
    for pkg in (out, out / "kvbm", out / "kvbm" / "v1"):
        (pkg / "__init__.py").write_text("")
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(PROTO_DIR / p) for p in PROTOS]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # The grpc plugin imports its _pb2 absolutely ("from kvbm.v1 import"); make it package-relative.
    for path in (out / "kvbm" / "v1").glob("*_pb2_grpc.py"):
        text = re.sub(r"^from kvbm\.v1 import", f"from {PACKAGE}.kvbm.v1 import", path.read_text(), flags=re.M)
        path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare with the committed stubs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = pathlib.Path(tmp) / "_gen"
        generate(fresh)
        if args.check:
            stale = [str(p.relative_to(fresh)) for p in fresh.rglob("*.py*")
                     if not (OUT_DIR / p.relative_to(fresh)).exists()
                     or not filecmp.cmp(p, OUT_DIR / p.relative_to(fresh), shallow=False)]
            if stale:
                print("stale generated stubs: " + ", ".join(stale) + " (run python proto/generate.py)")
                return 1
            print("generated stubs are current")
            return 0
        shutil.rmtree(OUT_DIR, ignore_errors=True)
        shutil.copytree(fresh, OUT_DIR)
    print(f"wrote {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
