"""Index ranges: the one vectorised gather that turns (start, length) pairs into positions.

Examples, segments and spill-file pieces are all runs of consecutive tokens; copying many runs
out of a flat buffer is one numpy fancy-index with the positions built here, never a Python loop
per run.
"""

from __future__ import annotations

import numpy as np


def gather_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices ``starts[j] : starts[j] + lengths[j]`` for all j, concatenated.

    >>> gather_index(np.array([10, 0, 5]), np.array([2, 3, 1])).tolist()
    [10, 11, 0, 1, 2, 5]
    """
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if ends.size else 0)
