"""``logging.wandb=online`` needs W&B credentials; they are looked up where wandb looks, without the network and
without importing wandb, so that a missing key is a start-up error and not a ``UsageError`` after the run began.

wandb reads, in this order: the ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``) environment variable, the
netrc file (``NETRC``, else ``~/.netrc`` or ``~/_netrc``) entry of the server's host (``WANDB_BASE_URL``, default
``https://api.wandb.ai``; ``wandb login`` writes it), and ``api_key`` in the ``[default]`` section of its settings
files (``WANDB_CONFIG_DIR/settings`` or ``~/.config/wandb/settings``, and ``<run_dir>/wandb/settings``).
"""

from __future__ import annotations

import configparser
import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

from ..config import Config, ConfigError

DEFAULT_BASE_URL = "https://api.wandb.ai"


def _settings_files(run_dir: str) -> list[Path]:
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    system = Path(config_dir).expanduser() / "settings" if config_dir else Path("~/.config/wandb/settings").expanduser()
    return [system, Path(run_dir) / "wandb" / "settings"]


def _settings_value(run_dir: str, key: str) -> str | None:
    value = None
    for path in _settings_files(run_dir):  # the run's own settings file wins, as in wandb
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_option("default", key) and parser.get("default", key).strip():
            value = parser.get("default", key).strip()
    return value


def _netrc_path() -> Path:
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    unix = Path("~/.netrc").expanduser()
    windows = Path("~/_netrc").expanduser()
    return windows if not unix.exists() and windows.exists() else unix


def wandb_credentials(run_dir: str = ".") -> str | None:
    """Where wandb would find credentials for its server (a short description), or None when it would find none.

    Reads environment variables and files only (no network, no wandb import); whether the key is valid is for
    wandb to say.
    """
    if os.environ.get("WANDB_API_KEY", "").strip():
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE", "").strip():
        return "WANDB_IDENTITY_TOKEN_FILE"
    base = os.environ.get("WANDB_BASE_URL") or _settings_value(run_dir, "base_url") or DEFAULT_BASE_URL
    host = urlsplit(base if "://" in base else f"https://{base}").hostname
    path = _netrc_path()
    if host:
        try:
            creds = netrc.netrc(str(path)).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            creds = None
        if creds and creds[2]:
            return f"{path} (machine {host})"
    if _settings_value(run_dir, "api_key"):
        return "the wandb settings file"
    return None


def check_wandb_login(cfg: Config) -> None:
    """With ``logging.wandb=online``, that wandb will find credentials (:func:`wandb_credentials`); call it before
    any process group starts and before anything is written.

    Raises:
        ConfigError: no credentials, naming ``logging.wandb`` and the three fixes.
    """
    if cfg.logging.wandb != "online" or wandb_credentials(cfg.train.run_dir) is not None:
        return
    raise ConfigError(
        "logging.wandb=online but no W&B API key is set up on this machine (no WANDB_API_KEY, no entry for "
        f"{urlsplit(os.environ.get('WANDB_BASE_URL') or DEFAULT_BASE_URL).hostname or 'api.wandb.ai'} in "
        f"{_netrc_path()}, no api_key in the wandb settings); run `wandb login` (or export WANDB_API_KEY=...) "
        "where the run starts, or use logging.wandb=offline and `wandb sync` the run folder's wandb/ later"
    )
