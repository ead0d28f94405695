"""What a run's configuration resolves to, shared by the build's story and the Beam graph it runs."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import PackConfig
from pipeline.encode.tokenizer import LoadedTokenizer
from pipeline.read.formats import ExampleFormat
from pipeline.read.inputs import InputsRead
from pipeline.read.sources import Source
from schemas import BuildInputs


@dataclass(frozen=True)
class BuildPlan:
    """A run's config with what it resolves to: the dataset's read tasks, the tokenizer, the
    example format, the manifest's inputs, the fingerprint, and the build directory."""

    config: PackConfig
    source: Source
    tokenizer: LoadedTokenizer
    example_format: ExampleFormat
    inputs: BuildInputs
    fingerprint: str
    out_dir: str
    inputs_read: InputsRead = InputsRead()  # the files and columns read, and the columns not read
