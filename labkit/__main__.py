"""`labkit <command>` (or `python -m labkit <command>`): the course's command-line tools.

    labkit serve     an OpenAI-compatible HTTP server on labkit's engine
    labkit loadgen   Poisson load against a server: TTFT, TPOT and throughput per request rate
"""

import sys
from importlib import import_module

COMMANDS = {"serve": "labkit.serve.server", "loadgen": "labkit.serve.loadgen"}
# The modules of pyproject.toml's `serve` extra, which both commands need and a plain install lacks.
SERVE_EXTRA = {"starlette", "uvicorn", "h11", "prometheus_client", "httpx"}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    try:
        command = import_module(COMMANDS[argv[0]])
    except ModuleNotFoundError as error:  # one line for a missing extra, not a traceback
        if (error.name or "").split(".")[0] not in SERVE_EXTRA:
            raise
        raise SystemExit(f"labkit {argv[0]}: needs the package {error.name!r} of the serve extra; "
                         "install it with: pip install 'labkit[serve]'") from None
    command.main(argv[1:])


if __name__ == "__main__":
    main()
