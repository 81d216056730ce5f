"""Errors about model files that the user can fix: one clear line each."""


class ModelError(Exception):
    """A model reference or file is missing, malformed, unsupported or incompatible."""
