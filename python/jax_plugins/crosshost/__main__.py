"""``python -m jax_plugins.crosshost doctor [...]`` (see doctor.py)."""

import sys

USAGE = "usage: python -m jax_plugins.crosshost doctor [--help | options]"


def _main(argv: list[str]) -> int:
    if not argv or argv[0] != "doctor":
        print(USAGE, file=sys.stderr)
        return 2
    from .doctor import main

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
