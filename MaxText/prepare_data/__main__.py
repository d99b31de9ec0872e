"""python -m MaxText.prepare_data: the command users know, for MaxText.input_pipeline.prepare_data.

A package rather than a module beside input_pipeline/: `python -m` needs a file at this name."""

from MaxText import runtime
from MaxText.input_pipeline.prepare_data import main

runtime.run(main)
