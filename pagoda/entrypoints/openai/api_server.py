"""`python -m pagoda.entrypoints.openai.api_server --model M ...`: vLLM's old entry point, same flags
as `pagoda serve`."""

from __future__ import annotations

import argparse
import logging
import sys

from pagoda.cli.serve import add_serve_args, serve
from pagoda.cli.vllm_flags import undot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.entrypoints.openai.api_server")
    add_serve_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return serve(parser.parse_args(undot(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
