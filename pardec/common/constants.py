"""Constants shared across layers, each defined once."""

from __future__ import annotations

# Label value that cross-entropy ignores (torch's default ``ignore_index``).
IGNORE_INDEX = -100

# The special token every non-AR recipe adds to the tokenizer (an input symbol only; converted
# checkpoints never emit it, see ``pardec.inference.checkpoint.forbid_output_token``).
MASK_TOKEN = "<|mask|>"

# Key under which an export's ``config.json`` holds its :class:`pardec.common.metadata.CheckpointMetadata`.
METADATA_KEY = "pardec"
