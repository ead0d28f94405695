"""Report: progress, the end-of-run report, figures."""
