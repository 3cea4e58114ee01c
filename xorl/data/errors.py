"""The one error type of data reading (its own module: every reader raises it, none imports another)."""


class DataError(ValueError):
    """A dataset file that cannot be read as documents; the message names the file and the line."""
