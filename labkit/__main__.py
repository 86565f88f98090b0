"""`labkit <command>` (or `python -m labkit <command>`): the course's command-line tools.

    labkit serve     an OpenAI-compatible HTTP server on labkit's engine
    labkit loadgen   Poisson load against a server: TTFT, TPOT and throughput per request rate
"""

import sys
from importlib import import_module

COMMANDS = {"serve": "labkit.serve.server", "loadgen": "labkit.serve.loadgen"}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
