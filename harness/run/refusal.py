"""Why a command will not go on, in one line: the command line prints `COMMAND: message` and exits with `status`
(2: bad input or a directory in use; 1: the machine failed a step before any result; 130: stopped by Ctrl-C,
SIGTERM or SIGHUP)."""


class Refusal(Exception):
    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status
