"""Print which packages a newer resolution changes against the lock: `python .ci/lockdiff.py LOCK NEW`.

Used by `make test-latest`, so that a failure there names the releases that moved. Exit status is 0 either way.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^ ;\\]+)\s*(?:;\s*([^\\]*?))?\s*\\?$")


def pins(path: Path) -> dict[str, str]:
    """`name` (with its environment marker, if any) -> exact version, from a `uv pip compile` output."""
    found = {}
    for line in path.read_text().splitlines():
        if match := PIN.match(line):
            name, version, marker = match.groups()
            found[f"{name} ; {marker}" if marker else name] = version
    return found


def main(lock: str, new: str) -> None:
    """Print one line per package that is new, gone or at another version in `new` than in `lock`."""
    old, latest = pins(Path(lock)), pins(Path(new))
    changes = [
        f"  {name}: {old.get(name, '(not locked)')} -> {latest.get(name, '(gone)')}"
        for name in sorted(old.keys() | latest.keys())
        if old.get(name) != latest.get(name)
    ]
    print(f"newest releases against {lock}: {len(changes)} differ" + (":" if changes else ""))
    print("\n".join(changes))


if __name__ == "__main__":
    main(*sys.argv[1:])
