"""The one exception the command line turns into a one-line error."""


class FragsimError(Exception):
    """A user-facing error: bad input, bad option, unreadable file.

    The message names what was wrong (file, row, field, option) and what is allowed;
    the CLI prints it as ``fragsim: error: <message>`` and exits with status 2.
    """
