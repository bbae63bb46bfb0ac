"""Copy ops/nats/auth.conf and ops/redis/{redis.conf,users.acl,start.sh} into their Kubernetes ConfigMaps.

The manifests stay plain YAML (kubectl apply -f ops/k8s/), so the server configs are embedded
copies; run this after editing either file:

    python ops/k8s/sync_configs.py          # rewrite the copies
    python ops/k8s/sync_configs.py --check  # exit 1 if a copy is stale (tests/ops/test_k8s.py checks too)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parents[1]
# (manifest, ConfigMap data key, source file)
COPIES = (
    (OPS / "k8s/nats.yaml", "auth.conf", OPS / "nats/auth.conf"),
    (OPS / "k8s/redis.yaml", "redis.conf", OPS / "redis/redis.conf"),
    (OPS / "k8s/redis.yaml", "users.acl", OPS / "redis/users.acl"),
    (OPS / "k8s/redis.yaml", "start.sh", OPS / "redis/start.sh"),
)
INDENT = "    "


def embed(manifest: str, key: str, text: str) -> str:
    """Replace the block scalar `  <key>: |` (up to the next key or document) with `text`."""
    lines = manifest.splitlines(keepends=True)
    start = lines.index(f"  {key}: |\n") + 1
    end = start
    while end < len(lines) and (lines[end].startswith(INDENT) or lines[end] == "\n"):
        end += 1
    body = [INDENT + line if line.strip() else "\n" for line in text.splitlines(keepends=True)]
    return "".join(lines[:start] + body + lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale copies")
    args = parser.parse_args(argv)
    stale = []
    for manifest, key, source in COPIES:
        current = manifest.read_text()
        wanted = embed(current, key, source.read_text())
        if wanted != current:
            stale.append(f"{manifest.name}: {key}")
            if not args.check:
                manifest.write_text(wanted)
    if stale:
        print(("stale: " if args.check else "updated: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
