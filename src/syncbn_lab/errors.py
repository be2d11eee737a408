"""Errors a user can cause. Each carries one line that names the problem and the fix."""


class UserError(Exception):
    """Bad config, data or combination: printed as one line, exit status 2, no traceback."""


class ConfigError(UserError):
    """The composed config is invalid or asks for an impossible combination."""
