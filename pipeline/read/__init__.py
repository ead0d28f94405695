"""Read: where source rows come from (local files, the Hub, synthetic data)."""
