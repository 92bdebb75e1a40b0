"""A user's own Lightning ``Logger`` for the tests: the abstract members filled in, ``log_metrics`` left to each test's
subclass (tests/validators/test_logger_copies.py, test_logger_refeed.py, tests/value_copies/test_refed_loggers.py)."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.loggers import Logger


class UserLogger(Logger):
    """A logger of the user's (its class outside Lightning's packages), named ``NAME``, version 0, hyper-parameters
    dropped."""

    NAME = "user"

    @property
    def name(self) -> str:
        return self.NAME

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass
