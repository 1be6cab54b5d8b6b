"""``python -m coliworker``: the command line (serve, info, demo, top)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from coliworker.server.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
