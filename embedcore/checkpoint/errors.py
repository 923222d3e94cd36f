"""The one error type of checkpoint reading and writing."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, or is corrupt, truncated, or does not match the engine."""
