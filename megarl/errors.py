"""Errors any layer may raise, in a module that imports nothing of megarl: the dataset reader,
the launcher and the scorers raise ConfigError without importing the argument parser (and through
it the algorithms, rewards and models)."""


class ConfigError(ValueError):
    """A configuration mistake; the message is one line that names the option."""


class TeacherServerError(RuntimeError):
    """The distillation teacher's server (--teacher-server) did not answer as it must during the run; every
    rank raises it alike and the message is one line that names the URL (megarl/teacher_server.py)."""
