"""Config schema and YAML loading with overrides (validation: :mod:`megatron_geo.training.validate`)."""

from .loader import ConfigError, config_to_dict, dump_config, load_config
from .schema import Config

__all__ = ["Config", "ConfigError", "config_to_dict", "dump_config", "load_config"]
