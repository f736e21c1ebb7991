"""A progress bar: tqdm when it is installed, otherwise a one-line text bar on stderr."""
from __future__ import annotations

import sys
import time


class _TextBar:
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.start = time.time()

    def set_postfix_str(self, text: str):
        self.postfix = text

    def update(self, n: int = 1):
        self.n += n
        width = 30
        done = int(width * self.n / max(1, self.total))
        elapsed = time.time() - self.start
        sys.stderr.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] "
                         f"{self.n}/{self.total} {elapsed:5.1f}s {self.postfix}   ")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total: int, desc: str):
    """An object with update(n), set_postfix_str(text) and close()."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total, desc)
    return tqdm(total=total, desc=desc, dynamic_ncols=True)
