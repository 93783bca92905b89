"""The one error type a user sees for bad configuration: a single line naming the field."""


class ConfigError(ValueError):
    """Raised for any invalid configuration value; the message names the field and what was expected."""
