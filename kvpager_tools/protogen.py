"""Regenerate the committed gRPC stubs: ``python -m kvpager_tools.protogen``.

Sources live in ``proto/kvpager/v1/*.proto``; output goes to ``kvpager/v1/``
so that imports read ``from kvpager.v1 import memory_pb2``. The same function
generates into a temporary folder for the staleness test.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "kvpager" / "v1"

# Lines that only record which generator version ran; ignored when comparing.
_VERSION_LINES = re.compile(
    r"(Protobuf Python Version|_runtime_version\.|GRPC_GENERATED_VERSION|^\s*\d+,\s*$|^\s*'',\s*$)"
)


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on every .proto; returns the generated files (under out_root/kvpager/v1)."""
    from grpc_tools import protoc  # only the generator needs grpcio-tools

    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    out_dir = out_root / "kvpager" / "v1"
    (out_dir / "__init__.py").write_text('"""Generated gRPC stubs; regenerate with `python -m kvpager_tools.protogen`."""\n')
    return sorted(p for p in out_dir.iterdir() if p.suffix in (".py", ".pyi"))


def normalized(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not _VERSION_LINES.search(line))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)
    files = generate(ROOT)
    print(f"generated {len(files)} files under {ROOT / 'kvpager' / 'v1'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
