"""Write: shards, the manifest, storage, the build lock."""
