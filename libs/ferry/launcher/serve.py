"""`ferry serve <name>`: run one service in this process.

The same code as `python -m ferry_services.<name>`: the service's `__main__` module runs as the
main module, reading its settings from `FERRY_*` environment variables.
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy

from ferry.launcher import SERVICE_MODULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(SERVICE_MODULES), help="which service")
    parser.epilog = "Settings come from FERRY_* environment variables (see docs/internals.md, Services)."


def run(args: argparse.Namespace) -> int:
    module = SERVICE_MODULES[args.name]
    if importlib.util.find_spec(f"{module}.__main__") is None:
        raise SystemExit(f"ferry: service {args.name!r} is not available in this build ({module})")
    from ferry.bus.connect import CredentialsRefused, NatsUnreachable

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except (CredentialsRefused, NatsUnreachable) as exc:  # a setting, not a bug: no stack trace
        raise SystemExit(f"ferry serve {args.name}: {exc} (FERRY_NATS_URL)") from None
    except SystemExit as exc:  # the service's main() exits with its status
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        raise  # a message (bad settings): let it print
    return 0
