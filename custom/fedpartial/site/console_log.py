"""``python -m fedpartial.site.console_log FILE``: copy standard input to FILE, rotating it by size
(``FILE.1`` ... ``FILE.<backups>``), as FLARE's own log files rotate. ``fedpartial-site start`` pipes a
kit's console output through it; it ends when the last writer closes the pipe."""
from __future__ import annotations

import argparse
import os
import sys
from typing import BinaryIO


def rotate(path: str, backups: int) -> None:
    """``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest dropped); no backups: truncate."""
    if backups < 1:
        open(path, "wb").close()
        return
    for k in range(backups - 1, 0, -1):
        if os.path.exists(f"{path}.{k}"):
            os.replace(f"{path}.{k}", f"{path}.{k + 1}")
    if os.path.exists(path):
        os.replace(path, f"{path}.1")


def copy(source: BinaryIO, path: str, max_bytes: int, backups: int) -> None:
    """Append ``source``'s lines to ``path``, rotating before a line would take it over ``max_bytes``."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    out = open(path, "ab")
    try:
        for line in iter(source.readline, b""):
            if out.tell() and out.tell() + len(line) > max_bytes:
                out.close()
                rotate(path, backups)
                out = open(path, "ab")
            out.write(line)
            out.flush()
    finally:
        out.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fedpartial.site.console_log", description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--max-bytes", type=int, default=20 << 20)
    p.add_argument("--backups", type=int, default=3)
    args = p.parse_args(argv)
    copy(sys.stdin.buffer, args.file, args.max_bytes, args.backups)


if __name__ == "__main__":
    main()
