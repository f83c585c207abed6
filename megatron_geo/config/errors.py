"""The config's one error type (the entry point prints it as one ``error:`` line and exits with status 2)."""


class ConfigError(ValueError):
    """A bad config file, key, value or combination of sizes."""
