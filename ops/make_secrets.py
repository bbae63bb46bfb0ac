"""Every secret a ferry deployment needs, freshly random, for compose (.env) or Kubernetes (a Secret).

    python ops/make_secrets.py > .env                        # docker compose reads .env beside compose.yaml
    python ops/make_secrets.py --k8s | kubectl apply -f -    # the ferry-secrets Secret (namespace ferry)

Nothing has a default: compose refuses to start without these variables (`${VAR:?...}`), and the
Kubernetes manifests read them from the ferry-secrets Secret, which `kubectl apply -f ops/k8s/` no
longer creates with example values. Values are letters and digits, starting with a letter:
passwords go into nats:// and redis:// URLs, and nats-server's config would read a value that
starts with a digit as a number. Stdlib only: runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import secrets
import string
import sys

NATS_USERS = ("gateway", "prefill_balancer", "decode_balancer", "worker", "kvcache", "admin")
"""ops/nats/auth.conf's users; each one's password is FERRY_NATS_<USER>_PASSWORD."""
REDIS_USERS = ("worker", "kvcache", "admin")
"""ops/redis/users.acl's users; each one's password is FERRY_REDIS_<USER>_PASSWORD."""

SECRET_NAMES = (
    *(f"FERRY_NATS_{user.upper()}_PASSWORD" for user in NATS_USERS),
    "FERRY_NATS_ROUTE_PASSWORD",  # NATS cluster routes (Kubernetes)
    *(f"FERRY_REDIS_{user.upper()}_PASSWORD" for user in REDIS_USERS),
    "FERRY_API_KEYS",  # what HTTP clients send as `Authorization: Bearer <key>`
    "FERRY_GRAFANA_PASSWORD",
)
"""Every secret, in the order they are written."""
SECRET_CHARS = 32
"""62 symbols each: about 190 bits."""


def make_secret() -> str:
    alphabet = string.ascii_letters + string.digits
    return secrets.choice(string.ascii_letters) + "".join(secrets.choice(alphabet) for _ in range(SECRET_CHARS - 1))


def make_secrets() -> dict[str, str]:
    return {name: make_secret() for name in SECRET_NAMES}


def as_env(values: dict[str, str]) -> str:
    header = "# ferry secrets (python ops/make_secrets.py); keep this file private: chmod 600 .env\n"
    return header + "".join(f"{name}={value}\n" for name, value in values.items())


def as_k8s_secret(values: dict[str, str], namespace: str = "ferry") -> str:
    """A Secret manifest; JSON is YAML, so kubectl takes it as it is."""
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "ferry-secrets",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "ferry"},
        },
        "type": "Opaque",
        "stringData": values,
    }
    return json.dumps(secret, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k8s", action="store_true", help="print a Kubernetes Secret instead of .env lines")
    parser.add_argument("--namespace", default="ferry", help="the Secret's namespace (with --k8s)")
    args = parser.parse_args(argv)
    values = make_secrets()
    sys.stdout.write(as_k8s_secret(values, args.namespace) if args.k8s else as_env(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
