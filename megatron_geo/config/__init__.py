"""Config schema, YAML loading with overrides, and validation."""

from .loader import ConfigError, config_to_dict, dump_config, load_config
from .schema import Config
from .validate import validate_config

__all__ = ["Config", "ConfigError", "config_to_dict", "dump_config", "load_config", "validate_config"]
