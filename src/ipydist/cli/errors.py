"""The one failure every ``ipydist`` subcommand reports the same way."""

from ipydist.error_base import IpydistError


class CliError(IpydistError):
    """A failure to report as one line (``ipydist <command>: <message>``) and exit code 1."""
