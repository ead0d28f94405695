"""Write: shards and the manifest, the build directory's lifecycle, the build lock."""
