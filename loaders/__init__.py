"""The read side: packed shards -> FlashAttention-2 varlen batches.

Imports only torch, pyarrow and numpy (fsspec, for a build at a URL), so it loads on a GPU
machine without Beam, datasets or tokenizers.
"""

from loaders.collate import FixedShape
from loaders.dataset import PackedIterableDataset
from loaders.mixture import PackedMixture, load_mixture_file
from loaders.shard_reader import Shard, open_shard

__all__ = ["FixedShape", "PackedIterableDataset", "PackedMixture", "Shard", "load_mixture_file", "open_shard"]
