"""The one failure every ``ipydist`` subcommand reports the same way."""


class CliError(Exception):
    """A failure to report as one line (``ipydist <command>: <message>``) and exit code 1."""
