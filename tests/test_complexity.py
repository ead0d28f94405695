"""The read and encode stages stay readable: no function there is rated worse than C by radon's
cyclomatic complexity (a new kind of example or source is a new class, not one more branch)."""

from __future__ import annotations

from pathlib import Path

from radon.complexity import cc_rank, cc_visit

STAGES = ("pipeline/read", "pipeline/encode")


def test_no_function_of_the_read_and_encode_stages_is_rated_worse_than_c():
    root = Path(__file__).parents[1]
    worse = [
        f"{path.relative_to(root)}:{block.lineno} {block.fullname} {cc_rank(block.complexity)} ({block.complexity})"
        for stage in STAGES
        for path in sorted((root / stage).glob("*.py"))
        for block in cc_visit(path.read_text())
        if cc_rank(block.complexity) > "C"
    ]
    assert not worse, "split these functions:\n" + "\n".join(worse)
