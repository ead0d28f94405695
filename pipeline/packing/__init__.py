"""Pack: lengths in, an assignment of examples to rows out; groups, shard plans, spill files."""
