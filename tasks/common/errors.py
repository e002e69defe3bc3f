"""The project's refusal of its input: one line per parameter or field, each naming it and what to
do, raised where the input is checked (the plan, a stage that reads a run folder) and answered the
same way everywhere: the failed run's message in the UI, exit status 2 on the command line."""
from __future__ import annotations


class ParameterError(ValueError):
    """Invalid flow parameters; `errors` holds one message per field."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid parameters:\n" + "\n".join(f"  - {e}" for e in errors))
