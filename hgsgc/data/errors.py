"""The one error every data loader raises."""


class DataError(ValueError):
    """A data file is missing, empty, truncated or malformed.

    The message names the file, what is wrong with it and the fix. Loaders check their files
    when they are constructed, on every rank, so a bad file stops the job before training.
    """
