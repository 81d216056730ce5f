"""Errors about model files that the user can fix: one clear line each."""


class ModelError(Exception):
    """A model reference or file is missing, malformed, unsupported or incompatible."""


def incompatible_pair(target: str, draft: str, problems: list[str] | tuple[str, ...]) -> ModelError:
    """The one line that refuses a draft for a target (file names), every reason given."""
    return ModelError(f"draft {draft} cannot speculate for target {target}: " + "; ".join(problems))
