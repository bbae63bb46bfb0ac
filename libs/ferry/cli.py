"""The `ferry` console command.

Each subcommand lives in its own module and is imported only when it runs, so `ferry --help`
stays instant and never loads torch. A subcommand module exposes:

    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int        # exit status

Add a subcommand by adding one line to SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("ferry.launcher.up", "start nats, redis and every service as local processes"),
    "serve": ("ferry.launcher.serve", "run one service in this process (gateway, worker, ...)"),
    "generate": ("ferry.engine.generate_cli", "generate text with the engine in-process"),
    "make-model": ("ferry.model.make_model", "write a random-weight HF checkpoint for tests and demos"),
    "export-hf": ("ferry.model.export_hf", "write a GGUF model as a float32 HF checkpoint folder (for peers)"),
    "bench": ("ferry.bench.cli", "benchmark an OpenAI-compatible server or the engine offline"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferry",
        description="ferry: LLM serving as NATS microservices (gateway, balancers, "
        "prefill/decode workers, Redis KV cache).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ferry import __version__

    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the module that will run
            _load(module_name).add_arguments(sp)
    return parser


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("ferry"):
            raise SystemExit(f"ferry: this subcommand is not available in this build ({exc.name})") from None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module_name = SUBCOMMANDS[args.command][0]
    try:
        return int(_load(module_name).run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
