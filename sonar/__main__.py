"""`python -m sonar {serve,bench,actor}`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else "serve"
    rest = argv[1:]
    if command == "actor":
        from sonar.actors.host import main as actor_main

        return actor_main(rest)
    if command == "serve":
        from sonar.cli.serve import main as serve_main

        return serve_main(rest)
    if command == "bench":
        sub = rest[0] if rest else ""
        if sub == "actors":
            from sonar.bench.actors import main as bench_actors

            return bench_actors(rest[1:])
        if sub in (
            "serve",
            "throughput",
            "embed",
            "startup",
            "sweep",
            "compare",
            "grammar",
            "scheduler",
            "collectives",
        ):
            import importlib

            return importlib.import_module(f"sonar.bench.{sub}").main(rest[1:])
        print(
            "usage: python -m sonar bench {serve,throughput,embed,startup,sweep,compare,grammar,scheduler,collectives,actors} [ARGS...] "
            "(--help after one explains its flags)",
            file=sys.stderr,
        )
        return 0 if sub in ("-h", "--help", "help") else 2
    if command in ("-h", "--help", "help"):
        print("usage: python -m sonar {serve,bench,actor} [ARGS...]")
        return 0
    print(f"sonar: unknown command {command!r} (expected serve or actor)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
