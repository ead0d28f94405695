from pipeline.parent_watch import watch_from_environment

watch_from_environment()  # in a worker process of a pack command: end when the command does; before anything heavy


def __getattr__(name: str):
    """``from pipeline import pack_dataset``, imported on first use (Beam and the tokenizers behind it are heavy)."""
    if name == "pack_dataset":
        from pipeline.in_memory import pack_dataset

        return pack_dataset
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
