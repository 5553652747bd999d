"""``python -m pipeline`` and the ``pipeline`` console script: library warnings routed, then the CLI."""

from pipeline.library_warnings import route_library_warnings


def main() -> None:
    """Route library warnings to the debug log before the CLI imports the libraries that warn at import time."""
    route_library_warnings()
    from pipeline.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
