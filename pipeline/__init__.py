from pipeline.parent_watch import watch_from_environment

watch_from_environment()  # in a worker process of a pack command: end when the command does
