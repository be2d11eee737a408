"""Errors a user can cause. Each carries one line that names the problem and the fix."""

import warnings


class UserError(Exception):
    """Bad config, data or combination: printed as one line, exit status 2, no traceback."""


class ConfigError(UserError):
    """The composed config is invalid or asks for an impossible combination."""


def warn_one_line(message: str, category: type[Warning] = UserWarning) -> None:
    """Issues ``message`` as a warning of ``category`` that prints as one line.

    ``warnings.warn`` prints the warning and then the source line it points at; this one
    points at no file ("syncbn_lab", line 0), so the default format is the message alone:
    ``syncbn_lab:0: UserWarning: <message>``. Filters (``-W``, ``warnings.simplefilter``,
    pytest) see an ordinary warning of ``category``; callers decide how often to warn.
    """
    warnings.warn_explicit(message, category, filename="syncbn_lab", lineno=0)
